"""Evaluation throughput: items/s of `fastrehearse eval` through the rollout engine vs the former
HF-`generate` harness, on the same items with the same greedy model (SmolLM2-135M, CPU).

The HF-generate harness was removed once the engine path matched its regression reference
(tests/data/eval_reference.json), so the two halves cannot run in one invocation any more: each
half is recorded by running this script on the code of its time with `--label`, and the JSON keeps
every half with its git commit, wall time and load average. The table compares the halves present.

    nice python benchmarks/bench_eval_engine.py --label hf_generate     # at commit a492de8 (old harness)
    nice python benchmarks/bench_eval_engine.py --label engine          # after the switch
    python benchmarks/bench_eval_engine.py --table-only

Writes benchmarks/results/eval_engine_vs_hf.json (and prints a markdown table).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, hardware  # noqa: E402

OUT = RESULTS / "eval_engine_vs_hf.json"
# (suite, categories, limit): one job per suite shape: builtin EASY (multi-step tool use), BFCL
# single-turn AST (one turn, graded on the calls) and BFCL multi-turn (user turns, ~5k-token docs).
JOBS = [("builtin", "test:easy:task", 8), ("bfcl", "simple_python,irrelevance", 4),
        ("bfcl", "multi_turn_base", 1)]
COMMON = ["--policy", "smollm2", "--max-new-tokens", "128", "--max-steps", "6", "--batch-size", "8",
          "--seed", "0", "--quiet"]


def run_half(label: str) -> dict:
    import torch

    from fastrehearse.eval import cli
    from fastrehearse.model import load_model

    torch.set_num_threads(1)
    loaded = load_model("smollm2")
    jobs = []
    for suite, cats, limit in JOBS:
        with tempfile.TemporaryDirectory() as d:
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            res = cli.run(cli.build_parser().parse_args(
                ["--suite", suite, "--categories", cats, "--limit", str(limit), "--out", d] + COMMON),
                loaded=loaded)
            wall = time.perf_counter() - t0
            items = [json.loads(line) for line in open(Path(d) / "items.jsonl")]
        jobs.append({"suite": suite, "categories": cats, "limit": limit, "n": len(items), "wall_s": wall,
                     "items_per_s": len(items) / wall, "overall": res["overall"],
                     "load_1m": [load0, os.getloadavg()[0]],
                     "gen_tokens": sum(r["gen_tokens"] for r in items),
                     "scores": {f"{r['category']}/{r['id']}": r["score"] for r in items},
                     "errors": sum(r.get("error") is not None for r in items)})
        print(f"{label} {suite} {cats}: {len(items)} items in {wall:.1f} s", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    return {"commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "hardware": hardware("cpu"), "jobs": jobs}


def table(data: dict) -> str:
    halves = data["halves"]
    labels = list(halves)
    head = "| job | n | " + " | ".join(f"{l} items/s | {l} accuracy" for l in labels)
    if len(labels) == 2:
        head += f" | {labels[1]} / {labels[0]} speed | same scores |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, (suite, cats, _) in enumerate(JOBS):
        row = [f"{suite} {cats}"]
        jobs = [halves[l]["jobs"][i] for l in labels if i < len(halves[l]["jobs"])]
        if len(jobs) != len(labels):
            continue
        row.append(str(jobs[0]["n"]))
        for j in jobs:
            row += [f"{j['items_per_s']:.3f}", f"{100 * (j['overall'] or 0):.1f}%"]
        if len(jobs) == 2:
            row.append(f"{jobs[1]['items_per_s'] / jobs[0]['items_per_s']:.2f}x")
            same = sum(jobs[0]["scores"].get(k) == v for k, v in jobs[1]["scores"].items())
            row.append(f"{same}/{len(jobs[1]['scores'])}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", help="name of this half (hf_generate, engine)")
    p.add_argument("--table-only", action="store_true")
    a = p.parse_args()
    data = json.loads(OUT.read_text()) if OUT.is_file() else {
        "what": "items/s of fastrehearse eval, same items and greedy SmolLM2-135M, 1 torch thread",
        "jobs": [list(j) for j in JOBS], "settings": COMMON, "halves": {}}
    if not a.table_only:
        if not a.label:
            p.error("--label is required unless --table-only")
        data["halves"][a.label] = run_half(a.label)
        OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
