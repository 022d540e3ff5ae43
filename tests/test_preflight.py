"""python -m fastrehearse.preflight: one line per check, the missing ones named with their fix,
exit 1 exactly when a required one is missing (optional vLLM on CPU: reported, not required)."""
import importlib.util
import subprocess
import sys

import pytest

from fastrehearse import preflight

REAL_FIND = importlib.util.find_spec


def _without(monkeypatch, *mods):
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in mods else REAL_FIND(name, *a))


def test_cpu_mode_passes_here(capsys):
    assert preflight.main([]) == 0
    assert "cpu: everything required is here" in capsys.readouterr().out


def test_missing_train_dependency_is_named_with_its_fix(monkeypatch, capsys):
    _without(monkeypatch, "transformers")
    assert preflight.main([]) == 1
    out = capsys.readouterr().out
    assert "MISSING transformers" in out and 'pip install -e ".[train]"' in out
    assert out.strip().splitlines()[-1] == "cpu: missing transformers"


def test_vllm_is_optional_on_cpu(monkeypatch, capsys):
    _without(monkeypatch, "vllm")
    assert preflight.main([]) == 0
    assert "absent  vllm" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_gpu_mode_names_what_a_cpu_box_lacks(monkeypatch, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: nothing to report missing")
    _without(monkeypatch, "flash_attn")
    assert preflight.main(["--gpu"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("gpu: missing") and "GPU" in last and "flash-attn" in last


def test_kernels_mode_and_the_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "fastrehearse.preflight", "--kernels"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok      fastrehearse.kernels" in out.stdout
    assert "transformers" not in out.stdout          # not a kernels-only requirement
