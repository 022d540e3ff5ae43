"""benchmarks/bench_e2e_gpu.py --tiny: rollout + FSDP2 (1-rank gloo) RL update run on the CPU."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_e2e_tiny_runs_on_cpu(tmp_path):
    out = tmp_path / "e2e.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_e2e_gpu.py"), "--tiny",
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["fsdp2"] == "1-rank gloo" and d["episodes"] == 8
    assert d["generated_tokens"] == 8 * 8
    assert d["update_tokens"] == 8 * (24 + 8)          # every packed token, prompt included
    for k in ("rollout_tokens_per_s", "update_tokens_per_s", "update_mfu", "rollout_mfu"):
        assert d[k] > 0 and math.isfinite(d[k]), k
    assert all(math.isfinite(x) and x != 0.0 for x in d["losses"])
    assert d["update_peak_bytes"] and d["update_peak_bytes"] > 0
