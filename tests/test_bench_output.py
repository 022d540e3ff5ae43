"""Benchmarks write runs/bench/ unless --record (benchmarks/results/, the committed figures) or an
explicit --json names the file; `make bench` runs with the arguments its cited JSONs were made with."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import _output  # noqa: E402

# every script that writes under benchmarks/results/ (gpu_scale_check.py requires --json; the AOT
# record of tests/test_kernels_aot.py is a test's own)
WRITERS = ["bench_demo_backends", "bench_e2e_gpu", "bench_eval", "bench_eval_engine",
           "bench_integrations", "bench_kernel_revs", "bench_learning", "bench_load_memory",
           "bench_logprobs", "bench_packing", "bench_policy_loss", "bench_rehearsal_cache",
           "bench_rollout", "bench_train_step", "fault_table", "gpu_microbench",
           "probe_rollout_signal", "roofline"]


def test_output_path_rules(tmp_path):
    assert _output.output_path(None, "x.json", False) == ROOT / "runs" / "bench" / "x.json"
    assert _output.output_path(None, "x.json", True) == BENCH / "results" / "x.json"
    assert _output.output_path(tmp_path / "y.json", "x.json", False) == tmp_path / "y.json"
    with pytest.raises(SystemExit, match="--json and --record"):
        _output.output_path(tmp_path / "y.json", "x.json", True)


def test_every_writer_takes_record():
    scripts = {p.stem for p in BENCH.glob("*.py")}
    assert set(WRITERS) <= scripts
    for name in WRITERS:
        src = (BENCH / f"{name}.py").read_text()
        assert "--record" in src or "add_output_args" in src, name
        # no default output path into results/ left outside _output.py
        assert not re.search(r"default=str\(RESULTS|default=\"benchmarks/results", src), name
    # the scripts not listed write nowhere under results/ by default
    for p in BENCH.glob("*.py"):
        if p.stem not in WRITERS and p.stem not in ("_output", "_common"):
            assert "RESULTS /" not in p.read_text(), p.name


def _roofline():
    spec = importlib.util.spec_from_file_location("fr_roofline_out", BENCH / "roofline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fr_roofline_out"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_roofline_json_goes_to_scratch_unless_record(tmp_path, monkeypatch):
    roofline = _roofline()
    monkeypatch.setattr(_output, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(_output, "RESULTS", tmp_path / "results")
    committed = BENCH / "results" / "roofline_h200.json"
    before = committed.read_bytes()
    small = ["--shapes", "576x49152", "--n", "4096", "--fracs", "1.0", "--measured"]
    roofline.main(small + ["--json"])
    assert (tmp_path / "scratch" / "roofline_h200.json").is_file()
    assert not (tmp_path / "results").exists()
    roofline.main(small + ["--record"])
    data = json.loads((tmp_path / "results" / "roofline_h200.json").read_text())
    assert data[0]["kind"] == "assumptions"
    with pytest.raises(SystemExit, match="--json and --record"):
        roofline.main(small + ["--json", str(tmp_path / "z.json"), "--record"])
    assert committed.read_bytes() == before


def _make_var(name: str) -> list[str]:
    m = re.search(rf"^{name}\s*:=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, name
    return shlex.split(m.group(1))


def _argv_without_output(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif a != "--record":
            out.append(a)
    return out


@pytest.mark.parametrize("var, result", [("BENCH_LOGPROBS", "bench_logprobs_cpu.json"),
                                         ("BENCH_LOGPROBS_FWD", "bench_logprobs_fwd_cpu.json"),
                                         ("BENCH_POLICY_LOSS", "bench_policy_loss_cpu.json")])
def test_make_bench_uses_the_recorded_arguments(var, result):
    recorded = json.loads((BENCH / "results" / result).read_text())["argv"]
    assert _make_var(var) == _argv_without_output(recorded)
