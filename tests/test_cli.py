"""The `fastrehearse` command: dispatch, config errors, missing model path, lazy eval import."""
import subprocess
import sys
from pathlib import Path

import pytest

from fastrehearse import cli

ROOT = Path(__file__).resolve().parents[1]


def test_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "fastrehearse {train,eval}" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_train_config_errors_are_clear(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config error: config file not found" in capsys.readouterr().err
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  groupsize: 4\n")
    assert cli.main(["train", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'rollout.groupsize'" in err and "did you mean 'group_size'" in err
    assert cli.main(["train", "--config", str(p), "--set", "rollout={group_size: x}"]) == 2


def test_eval_dispatch_is_lazy(monkeypatch, capsys):
    import importlib

    def boom(name):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(importlib, "import_module", boom)
    assert cli.main(["eval", "--help"]) == 2
    assert "evaluation module is not available" in capsys.readouterr().err


def test_console_script_and_module_entry_points():
    exe = Path(sys.executable).parent / "fastrehearse"
    if not exe.exists():
        pytest.skip("console script not installed (pip install -e .)")
    out = subprocess.run([str(exe), "train", "--config", "/nonexistent.yaml"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "config file not found" in out.stderr
    out = subprocess.run([sys.executable, "-m", "fastrehearse.train", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "--resume" in out.stdout
