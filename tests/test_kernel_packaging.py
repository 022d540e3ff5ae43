"""The torch backend works where triton is absent, and `import fastrehearse.kernels` pulls in
neither triton nor transformers / trainer code (the kernels-only install, `pip install fastrehearse`)."""
import subprocess
import sys

NO_TRITON = r"""
import sys

class _NoTriton:
    # what an environment without triton looks like: every import of it fails
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, _NoTriton())
import torch
import fastrehearse.kernels as k
from fastrehearse.kernels import PolicyLossConfig, Role, linear_logprobs, linear_policy_loss

g = torch.Generator().manual_seed(0)
x, w = torch.randn(9, 8, generator=g, requires_grad=True), torch.randn(50, 8, generator=g)
t = torch.randint(0, 50, (9,), generator=g)
lp, ent = linear_logprobs(x, w, t, with_entropy=True, backend="torch")
lp2, _ = linear_logprobs(x, w, t, backend="auto", bias=torch.randn(50), logit_softcap=5.0)
(lp.sum() + ent.sum() + lp2.sum()).backward()
ref = torch.log_softmax(x.detach().double() @ w.double().T, -1).gather(1, t.view(-1, 1))[:, 0]
assert float((lp.detach().double() - ref).abs().max()) < 1e-5
roles = torch.full((9,), int(Role.ACT))
out = linear_policy_loss(x, w, t, roles, torch.randn(9, generator=g), None, PolicyLossConfig(),
                         backend="torch")
out.loss.backward()
try:
    linear_logprobs(x, w, t, backend="triton")
except ValueError as e:
    assert "backend='triton' needs the triton package" in str(e), e
    print("triton backend:", e)
else:
    raise SystemExit("backend='triton' ran without triton")
banned = ("triton", "transformers", "accelerate", "safetensors", "gguf", "fastrehearse.train",
          "fastrehearse.model", "fastrehearse.rollout", "fastrehearse.envs", "fastrehearse.eval",
          "fastrehearse.algo", "fastrehearse.packing", "fastrehearse.data")
bad = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned))
assert not bad, bad
print("ok")
"""


def test_torch_backend_without_triton():
    out = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True,
                         timeout=180, env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("ok"), out.stdout
    assert "blocked by the test" in out.stdout   # refused naming the failed import


def test_bench_kernel_revs_runs_two_revisions_side_by_side(tmp_path):
    """benchmarks/bench_kernel_revs.py imports kernels/ at a git revision as its own package beside
    the checked-out one and times both (tiny shape, one pair): a table and the JSON."""
    from pathlib import Path
    import json
    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        import pytest
        pytest.skip("not a git checkout")
    out = tmp_path / "revs.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_kernel_revs.py"), "--old", "HEAD",
                        "--reps", "1", "--shape", "7,16,97", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(v["old_ms"] > 0 and v["new_ms"] > 0 for v in rows.values())
    assert "policy_loss (torch fast path)" in r.stdout
