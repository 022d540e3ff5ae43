"""The README's vLLM rollout table, recomputed from benchmarks/results/rollout_backends_cpu.json:
each row's HF / vLLM medians and ratio (and the RL step's seconds) as formatted here must be on the
README row, and the check must fail on a README copy with one figure edited."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def expected() -> dict[str, list[str]]:
    d = json.loads((ROOT / "benchmarks" / "results" / "rollout_backends_cpu.json").read_text())
    assert d["rounds"] >= 3 and d["fresh_tasks_per_round"] is True
    out = {}
    names = {"builtin_mixed": "builtin `mixed`", "builtin_grpo": "builtin GRPO-shaped",
             "bfcl_multi_turn": "BFCL multi-turn base"}
    for w, label in names.items():
        v = d["workloads"][w]
        med = {b: statistics.median(r["tokens_per_s"] for x in v["records"] if x["backend"] == b for r in x["rounds"])
               for b in ("hf", "vllm")}
        assert all(len(x["rounds"]) >= 3 for x in v["records"])
        out[label] = [f"{med['hf']:.1f}", f"{med['vllm']:.1f}", f"{v['ratio_tokens_per_s']:.2f}x"]
    rl = d["rl_step_bfcl_multi_turn"]
    out["RL step on BFCL"] = [f"{rl['hf']['step_s']:.1f} s", f"{rl['vllm']['step_s']:.1f} s", f"{rl['speedup']:.2f}x"]
    out["raw `LLM.generate`"] = [f"{d['engine_vs_raw_generate']['ratio']:.2f}x"]
    return out


def check(readme: str) -> list[str]:
    bad = []
    for label, figs in expected().items():
        rows = [ln for ln in readme.splitlines() if ln.startswith("|") and label in ln]
        if len(rows) != 1:
            bad.append(f"{label}: {len(rows)} table rows")
            continue
        cells = [c.strip() for c in rows[0].strip("|").split("|")][1:]
        bad += [f"{label}: {f} not in {cells}" for f in figs if f not in cells]
    return bad


def test_readme_rollout_table_matches_its_json():
    assert check((ROOT / "README.md").read_text()) == []


def test_an_edited_figure_fails():
    text = (ROOT / "README.md").read_text()
    for figs in expected().values():
        for f in figs:
            row = next(ln for ln in text.splitlines() if ln.startswith("|") and f" {f} " in ln)
            edited = text.replace(row, row.replace(f" {f} ", " 9" + f + " ", 1))
            assert check(edited), f"editing {f} went unnoticed"
