"""Eval report: the untrained SmolLM2-135M base (and the demo-trained checkpoint when one exists) on
builtin-test, BFCL v4 (all 12 listed categories) and tau2 telecom (solo), with and without test-time
rehearsal, plus an API-drift row with world-model fidelity.

    python benchmarks/bench_eval.py                       # sized for a 2-core CPU, ~15 minutes
    python benchmarks/bench_eval.py --limit-builtin 50 --limit-bfcl 20 --limit-tau2 20 --budget-s 0

Every run is a `fastrehearse eval` run directory under --runs (resumable: rerunning the benchmark
continues where it stopped). Runs go in priority order; once --budget-s seconds have passed, the
remaining runs are listed as skipped instead of started. Sample sizes are tiny on a CPU: read the
accuracies as a smoke check of the pipeline, not as model quality (n is in every row).

Writes --json (all rows + per-category results), a markdown table next to it, and a PNG of
accuracy / generated tokens against the rehearsal budget N.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrehearse.eval import cli, report  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model  # noqa: E402

DEMO_CANDIDATES = ("runs/demo/export", "runs/demo/hf", "runs/demo/final", "runs/demo")


def find_demo_checkpoint() -> str | None:
    """The demo run's exported HF checkpoint, if the trainer produced one (config + safetensors)."""
    for c in DEMO_CANDIDATES:
        p = ROOT / c
        if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            return str(p)
    return None




SINGLE = "simple_python,multiple,parallel,parallel_multiple,live_simple,live_multiple,irrelevance,live_irrelevance"
MULTI = "multi_turn_base,multi_turn_miss_func,multi_turn_miss_param,multi_turn_long_context"
# (run name, suite, categories, rehearsal N, drift) in priority order: cheap, informative runs first.
JOBS = [
    ("builtin-r0", "builtin", None, 0, None),
    ("builtin-easy-r0", "builtin", "test:easy:task", 0, None),
    ("bfcl-single-r0", "bfcl", SINGLE, 0, None),
    ("builtin-r1", "builtin", None, 1, None),
    ("builtin-r2", "builtin", None, 2, None),
    ("builtin-r4", "builtin", None, 4, None),
    ("bfcl-single-r2", "bfcl", SINGLE, 2, None),
    ("tau2-r0", "tau2", None, 0, None),
    ("bfcl-multi-base-r0", "bfcl", "multi_turn_base", 0, None),
    ("builtin-r0-drift", "builtin", None, 0, "all"),
    ("bfcl-multi-r0", "bfcl", MULTI, 0, None),
    ("bfcl-multi-r2", "bfcl", MULTI, 2, None),
    ("tau2-r2", "tau2", None, 2, None),
    ("builtin-easy-r2", "builtin", "test:easy:task", 2, None),
]


def eval_args(a, model_spec: str, suite: str, cats: str | None, n: int, drift: str | None, out: Path,
              time_left: float | None):
    limit = {"builtin": a.limit_builtin, "bfcl": a.limit_bfcl, "tau2": a.limit_tau2}[suite]
    steps = {"builtin": a.steps_builtin, "bfcl": a.steps_bfcl, "tau2": a.steps_tau2}[suite]
    argv = ["--suite", suite, "--policy", model_spec, "--limit", str(limit), "--max-steps", str(steps),
            "--max-new-tokens", str(a.max_new_tokens), "--max-response-tokens", str(a.max_response_tokens),
            "--batch-size", str(a.batch_size), "--prefill-batch-cells", str(a.prefill_batch_cells),
            "--rehearsal-budget", str(n), "--rehearsal-mode", a.mode, "--out", str(out), "--quiet"]
    if cats:
        argv += ["--categories", cats]
    if drift:
        argv += ["--drift", drift]
    if suite == "tau2" and a.tau2_prompt_tokens:
        argv += ["--max-prompt-tokens", str(a.tau2_prompt_tokens)]
    if time_left is not None:
        argv += ["--time-limit-s", str(max(1.0, time_left))]
    return cli.build_parser().parse_args(argv)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None,
                   help="comma-separated model specs (default: smollm2, plus the demo checkpoint if found)")
    p.add_argument("--limit-builtin", type=int, default=2)
    p.add_argument("--limit-bfcl", type=int, default=1, help="items per BFCL category (12 categories)")
    p.add_argument("--limit-tau2", type=int, default=1)
    p.add_argument("--steps-builtin", type=int, default=4)
    p.add_argument("--steps-bfcl", type=int, default=1, help="policy turns per BFCL user turn")
    p.add_argument("--steps-tau2", type=int, default=2)
    p.add_argument("--jobs", default=None,
                   help="comma-separated run names from JOBS, run in that order (default: all JOBS)")
    p.add_argument("--tau2-prompt-tokens", type=int, default=0,
                   help="cap tau2's ~11k-token prompt (head + latest tokens kept); 0: the model's context")
    p.add_argument("--mode", default="parallel", choices=("parallel", "sequential"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-response-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--prefill-batch-cells", type=int, default=1,
                   help="1: every prompt decoded alone with KV prefix reuse (fastest on CPU here)")
    p.add_argument("--budget-s", type=float, default=900, help="stop starting runs after this (0: no limit)")
    p.add_argument("--runs", default="benchmarks/results/eval_runs")
    p.add_argument("--json", default="benchmarks/results/eval_smollm2.json")
    a = p.parse_args()
    by_name = {j[0]: j for j in JOBS}
    if a.jobs:
        bad = [n for n in a.jobs.split(",") if n not in by_name]
        if bad:
            raise ValueError(f"--jobs: unknown run(s) {bad}; known: {list(by_name)}")
    jobs = [by_name[n] for n in a.jobs.split(",")] if a.jobs else JOBS   # --jobs order = run order

    import torch

    from fastrehearse.model import load_model

    models = a.models.split(",") if a.models else ["smollm2"] + ([find_demo_checkpoint()] if find_demo_checkpoint() else [])
    t_start = time.perf_counter()
    rows, skipped = [], []
    for spec in models:
        tag = "smollm2-135m-base" if spec == "smollm2" else ("demo-" + Path(spec).name if "demo" in spec else Path(spec).name)
        loaded = None
        for name, suite, cats, n, drift in jobs:
            out = ROOT / a.runs / tag / name
            left = None if not a.budget_s else a.budget_s - (time.perf_counter() - t_start)
            if left is not None and left <= 0:
                skipped.append({"model": tag, "run": name})
                continue
            if loaded is None:
                loaded = load_model(spec)
            t0 = time.perf_counter()
            res = cli.run(eval_args(a, spec, suite, cats, n, drift, out, left), loaded)
            wall = time.perf_counter() - t0
            fid = [c.get("fidelity") for c in res["categories"].values() if c.get("fidelity")]
            label = suite + (" single-turn" if cats == SINGLE else " multi-turn" if cats == MULTI
                             else f" {cats}" if cats else "")
            row = {"model": tag, "suite": label + (f" (drift {res['drift']})" if res["drift"] else ""),
                   "rehearsal": n, "n": res["n"], "overall": res["overall"],
                   "bfcl_overall_strict": res.get("bfcl_overall_strict"),
                   "gen_tokens": res["tokens"]["gen_per_item"], "rehearsal_tokens": res["tokens"]["rehearsal_per_item"],
                   "seconds": res.get("wall_s_total") or wall, "run_dir": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out), "categories": res["categories"],
                   "fidelity": fid[0] if fid else None}
            rows.append(row)
            print(f"[{time.perf_counter() - t_start:6.0f}s] {tag} {name}: acc={res['overall']:.3f} n={res['n']} "
                  f"({wall:.0f}s)", flush=True)
    total = time.perf_counter() - t_start
    meta = {"hardware": {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                         "python": platform.python_version()},
            "settings": {k: v for k, v in vars(a).items() if k not in ("models",)},
            "models": models, "total_wall_s": total, "skipped_runs": skipped,
            "not_selected": [j[0] for j in JOBS if j not in jobs]}
    out_json = ROOT / a.json
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = (f"Eval report ({', '.join(models)}; CPU: {meta['hardware']['cpu']}, torch {torch.__version__}, "
          f"{total:.0f} s wall)\n\n" + report.comparison_markdown(rows))
    fid_rows = [r for r in rows if r["fidelity"]]
    if fid_rows:
        md += "\nWorld-model fidelity (rehearsed vs real response of each real call):\n\n"
        md += "| model | run | calls | exact (%) | field F1 (%) |\n|---|---|---:|---:|---:|\n"
        for r in fid_rows:
            f = r["fidelity"]
            md += (f"| {r['model']} | {r['suite']} | {f.get('n_items', 0):.0f} items | {100 * f.get('exact', 0):.1f} | "
                   f"{100 * f.get('field_f1', 0):.1f} |\n")
    if meta["not_selected"]:
        md += "\nNot run (not selected, CPU time): " + ", ".join(meta["not_selected"]) + "\n"
    if skipped:
        md += f"\nSkipped (time budget {a.budget_s:.0f} s): " + ", ".join(f"{s['model']}/{s['run']}" for s in skipped) + "\n"
    out_json.with_suffix(".md").write_text(md)
    sweep = [r for r in rows if "drift" not in r["suite"]]
    if sweep:
        report.plot_rehearsal_sweep(sweep, out_json.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
