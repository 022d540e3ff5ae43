"""Build fastrehearse's wheel from a copy of the tree (the tests that install it for real)."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of setup.py, README, LICENSE and the package folders, built with this
    interpreter's pip, offline (no build isolation)."""
    src = tmp / "src"
    src.mkdir()
    for item in ("setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / item, src / item)
    for d in ("fastrehearse", "kernels", "configs"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
                    "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, timeout=300)
    return next(wheels.glob("fastrehearse-*.whl"))


def bare_venv(path: Path) -> tuple[Path, Path]:
    """A venv without pip or packages: (its python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    py = path / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    return py, site


def install_wheel(py: Path, wheel: Path) -> None:
    """Install the wheel alone (no dependencies, no index) into the venv of `py`."""
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python",
                    str(py), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
