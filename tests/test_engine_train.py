"""The trainer on BFCL multi-turn through the engine: configs/smoke_bfcl.yaml (tiny random Llama,
all four categories, 80/20 hold-out) runs 2 RL steps in rehearse and in hybrid mode, as
`fastrehearse train --config configs/smoke_bfcl.yaml --set steps=2` does.

What this covers: BFCL tasks, their ~4-9k-token prompts, cut turns closed as written and the user
turns that follow them (a random model never ends a turn within 16 tokens: each turn is cut and
read as a text reply, so every episode walks through all its user turns), BFCL's checker as the
reward, packing and the policy update. A random model writes no tool call, so rehearsal and real
calls are covered by tests/test_engine_protocol.py and tests/test_engine_benchmarks.py."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bfcl_eval")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rehearse", "hybrid"])
def test_smoke_bfcl_trains_two_rl_steps(tmp_path, mode):
    cmd = [sys.executable, "-m", "fastrehearse.cli", "train", "--config", "configs/smoke_bfcl.yaml",
           "--set", "steps=2", "--set", f"rollout.mode={mode}", "--set", f"run_dir={tmp_path}",
           "--set", "eval.before=false"]   # the held-out eval runs once, after training
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x]
    rl = [r for r in rows if r.get("stage") == "rl"]
    assert len(rl) == 2, rows
    for r in rl:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["tokens_act"] > 0 and r["episode_tokens"] > 3000   # BFCL prompts + sampled turns
    assert "eval after: success" in out.stdout + out.stderr
    assert (tmp_path / "export").exists() or any(tmp_path.glob("**/model*.safetensors"))
