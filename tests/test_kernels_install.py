"""The kernels-only install: `pip install fastrehearse` (no extras) into a fresh venv that has torch
and nothing else, then both backends.

The venv is built offline and fast: its torch (and torch's own dependencies) are symlinked from
this interpreter's site-packages (a fresh `pip install torch` would take ~30 s and the network);
fastrehearse itself is a wheel built from a copy of the tree and installed with pip. The venv has
no system site-packages, so transformers & co. are really absent, and triton is added only for the
second half.
"""
import importlib.metadata as md
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from _wheel import bare_venv, build_wheel, install_wheel

ROOT = Path(__file__).resolve().parents[1]

CHECK_TORCH = r"""
import importlib.resources, importlib.util, sys
import torch
for absent in ("triton", "transformers", "accelerate", "yaml", "trl", "verl"):
    assert importlib.util.find_spec(absent) is None, f"{absent} is installed in the fresh venv"
import fastrehearse.kernels as k
import fastrehearse.integrations.trl, fastrehearse.integrations.verl   # peers imported lazily
from fastrehearse.kernels import PolicyLossConfig, Role, linear_logprobs, linear_policy_loss
g = torch.Generator().manual_seed(0)
x = torch.randn(13, 24, generator=g, dtype=torch.float64).float().requires_grad_()
w = (3 * torch.randn(101, 24, generator=g)).requires_grad_()
t = torch.randint(0, 101, (13,), generator=g)
mask = torch.rand(13, generator=g) > 0.3
lp, ent = linear_logprobs(x, w, t, mask=mask, temperature=0.7, with_entropy=True)
z = x.detach().double() @ w.detach().double().T / 0.7
ref = torch.log_softmax(z, -1).gather(1, t.view(-1, 1))[:, 0]
ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
assert float((lp.double() - ref * mask).abs().max()) < 1e-4, "logp"
assert float((ent.double() - ref_ent * mask).abs().max()) < 1e-4, "entropy"
(lp.sum() + ent.sum()).backward()
roles = torch.where(mask, int(Role.ACT), int(Role.CONTEXT))
out = linear_policy_loss(x, w, t, roles, torch.randn(13, generator=g), lp.detach(),
                         PolicyLossConfig(temperature=0.7))
out.loss.backward()
assert "triton" not in sys.modules
presets = importlib.resources.files("fastrehearse.configs")
assert presets.joinpath("demo.yaml").is_file(), "config presets not shipped"
print("ok")
"""

CHECK_TRITON = r"""
import torch
from fastrehearse.kernels import linear_logprobs
g = torch.Generator().manual_seed(1)
x, w = torch.randn(7, 16, generator=g), torch.randn(45, 16, generator=g)
t = torch.randint(0, 45, (7,), generator=g)
a, _ = linear_logprobs(x, w, t, backend="triton")
b, _ = linear_logprobs(x, w, t, backend="torch")
assert float((a - b).abs().max()) < 1e-5
print("ok")
"""


def _dist_closure(name, skip):
    """The installed distributions `name` needs at run time (markers evaluated), minus `skip`."""
    seen, todo = {}, [name]
    while todo:
        n = todo.pop().lower().replace("_", "-")
        if n in seen or n in skip:
            continue
        try:
            d = md.distribution(n)
        except md.PackageNotFoundError:
            continue
        seen[n] = d
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _link_dist(dist, site: Path):
    tops = {Path(str(f)).parts[0] for f in dist.files or []}
    for top in tops:
        src = Path(dist.locate_file(top))
        if top.endswith(".pth") or top == ".." or not src.exists():
            continue
        dst = site / top
        if not dst.exists():
            dst.symlink_to(src)


def _run(py, code, **env):
    # cwd outside the repository: `-c` puts the cwd first on sys.path
    full = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300,
                          env=full, cwd=str(py.parents[2]))


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernels_install")
    wheel = build_wheel(tmp)
    py, site = bare_venv(tmp / "venv")
    for d in _dist_closure("torch", skip={"triton"}):
        _link_dist(d, site)
    install_wheel(py, wheel)
    return py, site, wheel


def test_wheel_requires_only_torch_and_triton(fresh_venv):
    py, _, _ = fresh_venv
    lic = _run(py, "import importlib.metadata as m; d = m.distribution('fastrehearse'); "
                   "print(d.metadata['License']); print(any('LICENSE' in str(f) for f in d.files))")
    assert lic.stdout.split() == ["Apache-2.0", "True"], lic.stderr
    urls = _run(py, "import importlib.metadata as m; d = m.distribution('fastrehearse').metadata; "
                    "print(d['Home-page']); print(*d.get_all('Project-URL'), sep='\\n')")
    assert urls.stdout.split("\n")[:2] == ["https://github.com/fastrehearse/fastrehearse",
                                           "Source, https://github.com/fastrehearse/fastrehearse"], urls
    out = _run(py, "import importlib.metadata as m; print('\\n'.join(m.requires('fastrehearse')))")
    assert out.returncode == 0, out.stderr
    base = [Requirement(r) for r in out.stdout.split("\n") if r]
    base = [r for r in base if r.marker is None or "extra" not in str(r.marker)]
    assert sorted(r.name for r in base) == ["torch", "triton"], base
    triton = next(r for r in base if r.name == "triton")
    assert triton.marker is not None   # optional where triton has no wheels (the CPU path)


def test_torch_backend_in_fresh_venv_without_triton(fresh_venv):
    py, _, _ = fresh_venv
    out = _run(py, CHECK_TORCH)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_triton_backend_in_fresh_venv_with_triton(fresh_venv):
    py, site, _ = fresh_venv
    try:
        # the interpreter (TRITON_INTERPRET=1, how CPU runs Triton kernels) also needs numpy
        dists = _dist_closure("triton", skip=set()) + _dist_closure("numpy", skip=set())
    except Exception:  # pragma: no cover
        dists = []
    if not dists:
        pytest.skip("triton not installed here")
    for d in dists:
        _link_dist(d, site)
    try:
        out = _run(py, CHECK_TRITON, TRITON_INTERPRET="1")
    finally:
        for d in dists:   # the torch-only test may run after this one (e.g. -p random)
            for top in {Path(str(f)).parts[0] for f in d.files or []}:
                p = site / top
                if p.is_symlink():
                    p.unlink()
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
