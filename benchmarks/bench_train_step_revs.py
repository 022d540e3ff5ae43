"""The whole packed + fused train step (bench_train_step.py, "ours") at two git revisions, in
alternating processes on one box: did a refactor cost speed or change the loss?

The old revision is extracted with `git archive` into a temp dir and its own
benchmarks/bench_train_step.py runs there with that tree first on PYTHONPATH (so it imports its
own fastrehearse and kernels); the new one is this checkout. Rounds alternate the order (ABBA...),
the 1-minute load is recorded before each run, and the loss of both must be equal (lr 0: the
same weights and episodes give the same loss up to summation order).

    nice .venv/bin/python benchmarks/bench_train_step_revs.py --old 6bf59bb --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _output import add_output_args, output_path  # noqa: E402
from bench_kernel_revs import export_rev  # noqa: E402


def run_once(tree: Path, out: Path, threads: int, episodes: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    load = os.getloadavg()[0]
    subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_train_step.py"), "--json", str(out),
                    "--episodes", str(episodes)], cwd=tree, env=env, check=True, capture_output=True)
    rec = json.loads(out.read_text())
    ours = next(r for r in rec["results"] if r["method"].startswith("ours"))
    return {"median_s": ours["median_s"], "loss": ours["loss"], "load_1m_before": load}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(p)
    p.add_argument("--old", required=True, help="the baseline git revision")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--episodes", type=int, default=8)
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    runs = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = export_rev(a.old, Path(tmp) / "old")
        for i in range(a.rounds):
            for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
                tree = old_tree if which == "old" else ROOT
                r = run_once(tree, Path(tmp) / f"{which}{i}.json", a.threads, a.episodes)
                runs[which].append({"round": i, **r})
                print(f"round {i + 1} {which}: {r['median_s']:.2f} s (load {r['load_1m_before']:.2f})", flush=True)
    med = {k: statistics.median(x["median_s"] for x in v) for k, v in runs.items()}
    losses = {x["loss"] for v in runs.values() for x in v}
    rel = (max(losses) - min(losses)) / max(1e-12, abs(min(losses)))
    res = {"what": "bench_train_step.py 'ours' (packed + fused train step) at two revisions, alternating processes",
           "old_rev": a.old, "new_rev": head + ("+dirty" if dirty else ""), "threads": a.threads,
           "episodes": a.episodes, "runs": runs, "median_s": med, "new_over_old": med["new"] / med["old"],
           "loss_rel_spread": rel}
    t = Table(title=f"train step: {a.old} vs {res['new_rev']} ({a.rounds} rounds, {a.threads} threads)")
    for c in ("rev", "median s", "runs s", "loads"):
        t.add_column(c)
    for k in ("old", "new"):
        t.add_row(k, f"{med[k]:.2f}", ", ".join(f"{x['median_s']:.2f}" for x in runs[k]),
                  ", ".join(f"{x['load_1m_before']:.2f}" for x in runs[k]))
    Console().print(t)
    print(f"new / old = {res['new_over_old']:.3f}; loss relative spread {rel:.1e}")
    out = output_path(a.json, "train_step_revs_cpu.json", a.record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0 if rel < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
