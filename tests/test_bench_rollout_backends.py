"""benchmarks/bench_rollout.py --backends: fresh tasks every round, a GRPO-shaped workload (groups of
group_size samples per prompt), each round's load recorded and rounds above the core count marked
loaded; a tiny hf-only smoke run (tiny random Llama, seconds)."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fr_bench_rollout", ROOT / "benchmarks" / "bench_rollout.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["fr_bench_rollout"] = bench
_spec.loader.exec_module(bench)


def test_round_tasks_are_fresh_and_refuse_too_few():
    tasks = list(range(6))
    assert [bench.round_tasks(tasks, r, 2) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(SystemExit, match="not enough"):
        bench.round_tasks(tasks, 3, 2)


def test_loaded_is_load_above_the_core_count():
    assert bench.mark_loaded({"loadavg_1m_start": 0.5, "loadavg_1m": 2.5}, cores=2)["loaded"]
    assert bench.mark_loaded({"loadavg_1m_start": 2.5, "loadavg_1m": 0.5}, cores=2)["loaded"]
    assert not bench.mark_loaded({"loadavg_1m_start": 2.0, "loadavg_1m": 1.9}, cores=2)["loaded"]


def test_wait_idle_waits_at_most_its_limit():
    got = bench.wait_idle(max_load=-1.0, limit_s=0.3, poll_s=0.1)     # never idle: waits the limit
    assert 0.3 <= got["idle_wait_s"] < 2.0 and got["loadavg_1m_start"] >= 0
    assert bench.wait_idle(max_load=1e9, limit_s=60)["idle_wait_s"] < 1.0   # idle: no wait


def test_hf_smoke_run(tmp_path):
    out = tmp_path / "r.json"
    bench.main(["--backends", "hf", "--model", "tiny-llama", "--tasks", "4", "--rounds", "2",
                "--workloads", "builtin_mixed,builtin_grpo", "--group-size", "2", "--idle-wait-s", "0",
                "--threads", "1", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["fresh_tasks_per_round"] and d["group_size"] == 2
    for name, per_task in (("builtin_mixed", 1), ("builtin_grpo", 2)):
        (rec,) = d["workloads"][name]["records"]
        rounds = rec["rounds"]
        assert len(rounds) == 2 and d["workloads"][name]["episodes_per_task"] == per_task
        assert not set(rounds[0]["task_ids"]) & set(rounds[1]["task_ids"])          # fresh tasks
        assert all(r["episodes"] == len(r["task_ids"]) * per_task for r in rounds)
        assert all(r["loaded"] == (max(r["loadavg_1m_start"], r["loadavg_1m"]) > os.cpu_count())
                   for r in rounds)
    assert len(d["workloads"]["builtin_grpo"]["records"][0]["rounds"][0]["task_ids"]) == 2   # 4 // 2


def test_bad_values_are_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        bench.main(["--backends", "hf", "--rounds", "0", "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--workloads: unknown"):
        bench.main(["--backends", "hf", "--model", "no-such-model", "--workloads", "nope",
                    "--json", str(tmp_path / "x.json")])          # refused before the model loads
