"""`python -m fastrehearse.train` and `torchrun -m fastrehearse.train` work from the repository
root and from any other folder, with a regular (non-editable) install.

From the root, `-m` puts the working directory first on sys.path, so the source folder
`fastrehearse/` shadows the installed package; the wheel installs the top-level `kernels/` as
`fastrehearse.kernels`, which that folder lacks (`fastrehearse/__init__.py` maps it). The venv
here gets the wheel (non-editable) and reaches the development venv's other packages through a
.pth file -- which Python does not scan for further .pth files, so the editable install's
finder is absent, as on a user's machine.
"""
import socket
import subprocess
import sysconfig
from pathlib import Path

import pytest

from _wheel import bare_venv, build_wheel, install_wheel

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("installed")
    wheel = build_wheel(tmp)
    py, site = bare_venv(tmp / "venv")
    # the development venv's packages, without its .pth files (so without the editable finder)
    (site / "dev_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install_wheel(py, wheel)
    return py, site


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(py, cwd, run_dir, torchrun=False):
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                f"--master_port={_free_port()}"] if torchrun else []
    cmd = [str(py), *launcher, "-m", "fastrehearse.train", "--config", str(ROOT / "configs/smoke.yaml"),
           "--set", f"run_dir={run_dir}", "--set", "steps=1", "--set", "eval.num_tasks=0",
           "--set", "checkpoint.export=false", "--set", "log.progress=false"]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(run_dir.parent)})


WHERE = "import fastrehearse, fastrehearse.kernels as k; print(fastrehearse.__file__); print(k.__file__)"


def test_import_from_the_root_and_elsewhere(installed, tmp_path):
    py, site = installed
    root = subprocess.run([str(py), "-c", WHERE], cwd=ROOT, capture_output=True, text=True)
    assert root.returncode == 0, root.stderr[-2000:]
    pkg, kern = root.stdout.split()
    assert pkg == str(ROOT / "fastrehearse" / "__init__.py")       # the source folder shadows
    assert kern == str(ROOT / "kernels" / "__init__.py")             # ... and finds its kernels
    away = subprocess.run([str(py), "-c", WHERE], cwd=tmp_path, capture_output=True, text=True)
    assert away.returncode == 0, away.stderr[-2000:]
    assert all(p.startswith(str(site)) for p in away.stdout.split())   # the installed package


@pytest.mark.parametrize("torchrun", [False, True])
@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_train_module_runs(installed, tmp_path, torchrun, where):
    py, _ = installed
    out = _train(py, ROOT if where == "root" else tmp_path, tmp_path / "run", torchrun)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


PRESET = "from fastrehearse.train.config import resolve_config_path as r; print(r('smoke'))"


def test_preset_name_with_the_wheel(installed, tmp_path):
    """`--config smoke` finds the preset in the wheel's package data away from the repository,
    and the top-level configs/ from its root (where the source folder shadows the package)."""
    py, site = installed
    away = subprocess.run([str(py), "-c", PRESET], cwd=tmp_path, capture_output=True, text=True)
    assert away.returncode == 0, away.stderr[-2000:]
    path = Path(away.stdout.strip())
    assert str(path).startswith(str(site)) and path.read_bytes() == (ROOT / "configs/smoke.yaml").read_bytes()
    root = subprocess.run([str(py), "-c", PRESET], cwd=ROOT, capture_output=True, text=True)
    assert root.returncode == 0, root.stderr[-2000:]
    assert Path(root.stdout.strip()) == ROOT / "configs" / "smoke.yaml"
