"""Evaluation throughput: `fastrehearse eval` through the rollout engine vs the former HF-`generate`
harness, on the same items with the same greedy model (SmolLM2-135M, CPU, 1 torch thread).

The HF-generate harness was removed from the tree once the engine path matched its regression
reference (tests/data/eval_reference.json). This benchmark still runs it side by side: it extracts
the whole `fastrehearse` package at OLD_COMMIT (the last commit with that harness) with `git
archive` into a temporary directory and runs each job there and on the current tree, as separate
processes, alternating which goes first. The machine is shared, so besides wall time it records
each process's CPU time (1 torch thread: CPU seconds are the work done, less sensitive to what else
runs) and the 1-minute load average around every job.

    nice python benchmarks/bench_eval_engine.py                 # all jobs, both paths
    python benchmarks/bench_eval_engine.py --table-only

Writes runs/bench/eval_engine_vs_hf.json (--record: benchmarks/results/) and prints a markdown table.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, add_output_args, hardware, output_path  # noqa: E402

OUT = RESULTS / "eval_engine_vs_hf.json"
OLD_COMMIT = "a492de8"
# (suite, categories, limit, max steps): builtin EASY (multi-step tool use), BFCL single-turn AST
# (one turn, graded on the calls) and BFCL multi-turn (scripted user turns over ~5k-token tool docs).
JOBS = [("builtin", "test:easy:task", 8, 6), ("bfcl", "simple_python,irrelevance", 2, 1),
        ("bfcl", "multi_turn_base", 1, 3)]
COMMON = ["--policy", "smollm2", "--max-new-tokens", "96", "--batch-size", "8", "--seed", "0", "--quiet"]


def one_job(index: int) -> dict:
    """Run job `index` with whatever `fastrehearse` is importable (old or current); JSON to stdout."""
    import torch

    from fastrehearse.eval import cli
    from fastrehearse.model import load_model

    torch.set_num_threads(1)
    suite, cats, limit, steps = JOBS[index]
    loaded = load_model("smollm2")
    with tempfile.TemporaryDirectory() as d:
        load0 = os.getloadavg()[0]
        c0, t0 = time.process_time(), time.perf_counter()
        res = cli.run(cli.build_parser().parse_args(
            ["--suite", suite, "--categories", cats, "--limit", str(limit), "--max-steps", str(steps),
             "--out", d] + COMMON), loaded=loaded)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        items = [json.loads(line) for line in open(Path(d) / "items.jsonl")]
    return {"suite": suite, "categories": cats, "limit": limit, "max_steps": steps, "n": len(items),
            "wall_s": wall, "cpu_s": cpu, "items_per_s": len(items) / wall, "items_per_cpu_s": len(items) / cpu,
            "overall": res["overall"], "load_1m": [load0, os.getloadavg()[0]],
            "gen_tokens": sum(r["gen_tokens"] for r in items), "steps": sum(r["steps"] for r in items),
            "scores": {f"{r['category']}/{r['id']}": r["score"] for r in items},
            "errors": sum(r.get("error") is not None for r in items)}


def run_path(label: str, index: int, pythonpath: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--one-job", str(index)], env=env, cwd=pythonpath,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{label} job {index} failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{label:12s} {row['suite']} {row['categories']}: {row['n']} items, {row['wall_s']:.1f} s wall, "
          f"{row['cpu_s']:.1f} s CPU, load {row['load_1m'][0]:.1f}-{row['load_1m'][1]:.1f}", file=sys.stderr)
    return row


def table(data: dict) -> str:
    head = ("| job | n | HF generate: wall s / CPU s | engine: wall s / CPU s | engine speed-up, CPU time "
            "(wall) | accuracy HF / engine | same per-item scores | load 1m |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for old, new in zip(data["hf_generate"], data["engine"]):
        same = sum(old["scores"].get(k) == v for k, v in new["scores"].items())
        load = old["load_1m"] + new["load_1m"]
        lines.append(
            f"| {old['suite']} {old['categories']} (max steps {old['max_steps']}) | {old['n']} | "
            f"{old['wall_s']:.0f} / {old['cpu_s']:.0f} | {new['wall_s']:.0f} / {new['cpu_s']:.0f} | "
            f"{old['cpu_s'] / new['cpu_s']:.2f}x ({old['wall_s'] / new['wall_s']:.2f}x) | "
            f"{100 * (old['overall'] or 0):.1f}% / {100 * (new['overall'] or 0):.1f}% | {same}/{len(new['scores'])} | "
            f"{min(load):.1f}-{max(load):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one-job", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--jobs", default=None, help="comma-separated job indices (default: all)")
    p.add_argument("--table-only", action="store_true", help="print the table of --json (default: the committed one)")
    add_output_args(p)
    a = p.parse_args()
    if a.one_job is not None:
        print(json.dumps(one_job(a.one_job)))
        return 0
    if a.table_only:
        print(table(json.loads(Path(a.json or OUT).read_text())))
        return 0
    idx = [int(x) for x in a.jobs.split(",")] if a.jobs else list(range(len(JOBS)))
    data = {"what": "fastrehearse eval, same items, greedy SmolLM2-135M (embedded GGUF), 1 torch thread, "
                    "old (HF generate) and engine paths as separate processes, alternating order",
            "old_commit": OLD_COMMIT, "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
            "settings": COMMON, "jobs": [list(JOBS[i]) for i in idx], "hardware": hardware("cpu"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "hf_generate": [], "engine": []}
    with tempfile.TemporaryDirectory() as old_root:
        arch = subprocess.run(["git", "archive", OLD_COMMIT, "fastrehearse"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", old_root], input=arch.stdout, check=True)
        for k, i in enumerate(idx):
            order = [("hf_generate", Path(old_root)), ("engine", ROOT)]
            for label, path in (order if k % 2 == 0 else order[::-1]):
                data[label].append(run_path(label, i, path))
    out = output_path(a.json, OUT.name, a.record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
