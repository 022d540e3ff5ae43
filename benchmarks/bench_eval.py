"""Eval report: the untrained SmolLM2-135M base and the demo-trained checkpoints (rehearse-only and
hybrid-trained, when their exports exist) on builtin-test, builtin EASY (the demo's task
distribution), BFCL v4 (all 12 listed categories) and tau2 telecom (solo), with and without
test-time rehearsal (N in {0, 1, 2, 4} on builtin EASY), plus API-drift rows with world-model
fidelity for the trained models.

    python benchmarks/bench_eval.py                                    # the committed CPU report
    python benchmarks/bench_eval.py --models smollm2 --jobs builtin-easy-r0 --limit-easy 4
    python benchmarks/bench_eval.py --models base=smollm2,mine=runs/x/export --budget-s 0

Every run is a `fastrehearse eval` run directory under --runs/<model tag>/<job> (resumable:
rerunning continues where it stopped; rerunning with larger limits runs only the new items). Runs go
in job order, model by model within a job; once --budget-s seconds have passed the remaining runs
are listed as skipped instead of started.

Model tags say what the model is: `smollm2-135m-base` (the embedded GGUF, untrained) and, for a
trainer export, `smollm2-135m-demo-<rollout.mode>-trained` read from the run directory's
config.yaml (e.g. rehearse-trained, hybrid-trained). `--models TAG=SPEC` names a model explicitly.

Writes --json (all rows with per-category results, settings, hardware, load), a markdown report
next to it (summary table by model, all rows, BFCL per category, drift/fidelity, rehearsal sweep;
then the text of --notes if given) and a PNG (accuracy and token cost against rehearsal N; accuracy
per row and model).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrehearse.eval import cli, report  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, SCRATCH, add_output_args, cpu_model, output_path  # noqa: E402

DEMO_RUNS = ("runs/demo", "runs/demo_hybrid")
BASE_TAG = "smollm2-135m-base"

SINGLE = "simple_python,multiple,parallel,parallel_multiple,live_simple,live_multiple,irrelevance,live_irrelevance"
MULTI = "multi_turn_base,multi_turn_miss_func,multi_turn_miss_param,multi_turn_long_context"
EASY = "test:easy:task"
EASY_ANSWER = "test:easy:task:answer"   # EASY tasks, and the final answer must state the tool's result
DRIFT = "rename,errors,units,formats"
# name -> (suite, categories, rehearsal N, drift, limit key, measure fidelity, trained models only)
# in run order: the cheap, informative runs first.
JOBS = {
    "builtin-easy-r0":       ("builtin", EASY, 0, None, "easy", True, False),
    "builtin-easy-r0-drift": ("builtin", EASY, 0, DRIFT, "easy", True, True),
    # a removed tool: EASY tasks have one tool, dropped from the schemas, so success is impossible by
    # construction; the row measures what the model does instead (calls to the missing tool, text answers)
    "builtin-easy-r0-remove": ("builtin", EASY, 0, "remove", "easy", True, True),
    "builtin-easy-answer-r0":       ("builtin", EASY_ANSWER, 0, None, "easy", True, True),
    "builtin-easy-answer-r0-drift": ("builtin", EASY_ANSWER, 0, DRIFT, "easy", True, True),
    "builtin-r0":            ("builtin", None, 0, None, "builtin", False, False),
    "bfcl-single-r0":        ("bfcl", SINGLE, 0, None, "bfcl", False, False),
    "builtin-easy-r1":       ("builtin", EASY, 1, None, "easy", False, False),
    "builtin-easy-r2":       ("builtin", EASY, 2, None, "easy", False, False),
    "builtin-easy-r4":       ("builtin", EASY, 4, None, "easy", False, False),
    "builtin-r2":            ("builtin", None, 2, None, "builtin", False, False),
    "bfcl-single-r1":        ("bfcl", SINGLE, 1, None, "bfcl", False, False),
    "bfcl-single-r2":        ("bfcl", SINGLE, 2, None, "bfcl", False, False),
    "bfcl-single-r4":        ("bfcl", SINGLE, 4, None, "bfcl", False, False),
    "bfcl-multi-r0":         ("bfcl", MULTI, 0, None, "bfcl_multi", False, False),
    "tau2-r0":               ("tau2", None, 0, None, "tau2", False, False),
    "bfcl-multi-r1":         ("bfcl", MULTI, 1, None, "bfcl_multi", False, False),
    "bfcl-multi-r2":         ("bfcl", MULTI, 2, None, "bfcl_multi", False, False),
    "tau2-r2":               ("tau2", None, 2, None, "tau2", False, False),
    # test-time rehearsal with --rehearsal-commit select (no memory in context; best of greedy + drafts)
    "builtin-easy-s1":       ("builtin", EASY, 1, None, "easy", False, False, "select"),
    "builtin-easy-s2":       ("builtin", EASY, 2, None, "easy", False, False, "select"),
    "builtin-easy-s4":       ("builtin", EASY, 4, None, "easy", False, False, "select"),
    "builtin-easy-answer-s1": ("builtin", EASY_ANSWER, 1, None, "easy", False, True, "select"),
    "builtin-easy-answer-s2": ("builtin", EASY_ANSWER, 2, None, "easy", False, True, "select"),
    "builtin-easy-answer-r1": ("builtin", EASY_ANSWER, 1, None, "easy", False, True),
    "builtin-easy-answer-r2": ("builtin", EASY_ANSWER, 2, None, "easy", False, True),
    "bfcl-single-s2":        ("bfcl", SINGLE, 2, None, "bfcl", False, False, "select"),
    "bfcl-multi-s1":         ("bfcl", MULTI, 1, None, "bfcl_multi", False, False, "select"),
    "bfcl-multi-s2":         ("bfcl", MULTI, 2, None, "bfcl_multi", False, False, "select"),
    "tau2-s2":               ("tau2", None, 2, None, "tau2", False, False, "select"),
}
LABELS = {SINGLE: "bfcl single-turn (8 AST categories)", MULTI: "bfcl multi-turn (4 categories)",
          EASY: "builtin test:easy (demo task distribution)",
          EASY_ANSWER: "builtin test:easy + answer check"}


def model_tag(spec: str) -> str:
    """A name that says what the model is (base, or a demo export and how it was trained)."""
    if spec == "smollm2":
        return BASE_TAG
    p = Path(spec)
    cfg = (ROOT / p if not p.is_absolute() else p).parent / "config.yaml"
    if cfg.is_file():
        import yaml
        c = yaml.safe_load(cfg.read_text()) or {}
        mode = (c.get("rollout") or {}).get("mode", "rehearse")
        base = (c.get("model") or {}).get("spec", "model")
        name = "smollm2-135m" if base == "smollm2" else Path(str(base)).name
        suffix = "-demo" if Path(str(c.get("run_dir", ""))).name.startswith("demo") else ""
        return f"{name}{suffix}-{mode}-trained"
    return p.name if p.name != "export" else p.parent.name + "-export"


def default_models() -> list[tuple[str, str]]:
    out = [(BASE_TAG, "smollm2")]
    for run in DEMO_RUNS:
        p = ROOT / run / "export"
        if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            spec = str(p.relative_to(ROOT))
            out.append((model_tag(spec), spec))
    return out


def parse_models(text: str | None) -> list[tuple[str, str]]:
    if not text:
        return default_models()
    out = []
    for item in text.split(","):
        tag, _, spec = item.rpartition("=")
        out.append((tag or model_tag(spec), spec))
    return out


def job_commit(job: tuple) -> str:
    """How a job's test-time rehearsal commits (the optional 8th field; default: memory, the form
    that replaced the pre-engine "note"; rows recorded before the engine say "note")."""
    return job[7] if len(job) > 7 else "memory"


def eval_args(a, spec: str, job: tuple, out: Path, time_left: float | None, backend: str = "hf"):
    suite, cats, n, drift, limit_key, fidelity = job[:6]
    limit = getattr(a, f"limit_{limit_key}")
    steps = {"builtin": a.steps_builtin, "bfcl": a.steps_bfcl, "tau2": a.steps_tau2}[suite]
    argv = ["--suite", suite, "--policy", spec, "--limit", str(limit), "--max-steps", str(steps),
            "--max-new-tokens", str(a.max_new_tokens_bfcl if suite == "bfcl" else a.max_new_tokens),
            "--batch-size", str(a.batch_size),
            "--rehearsal-budget", str(n), "--rehearsal-mode", a.mode,
            "--rehearsal-commit", job_commit(job), "--backend", backend, "--out", str(out), "--quiet"]
    if cats:
        argv += ["--categories", cats]
    if drift:
        argv += ["--drift", drift]
    if fidelity:
        argv += ["--measure-fidelity"]
    if time_left is not None:
        argv += ["--time-limit-s", str(max(1.0, time_left))]
    return cli.build_parser().parse_args(argv)


def record_invocation(out: Path, load: tuple[float, float], wall: float, ran: bool) -> None:
    """Append this invocation's 1-minute load average (start, end) to OUT/bench_invocations.json, so a
    report rebuilt later (--report-only) still states the load each run saw."""
    if not ran:
        return
    path = out / "bench_invocations.json"
    old = json.loads(path.read_text()) if path.is_file() else []
    old.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_1m_start": load[0], "load_1m_end": load[1],
                "wall_s": wall})
    path.write_text(json.dumps(old, indent=1))


def load_range(out: Path) -> tuple:
    path = out / "bench_invocations.json"
    if not path.is_file():
        return ()
    xs = [v for d in json.loads(path.read_text()) for v in (d["load_1m_start"], d["load_1m_end"])]
    return (min(xs), max(xs)) if xs else ()


def row_from(tag: str, job_name: str, job: tuple, res: dict, out: Path) -> dict:
    suite, cats, n, drift, *_ = job
    label = LABELS.get(cats, suite + (f" {cats}" if cats else (" test (mixed levels)" if suite == "builtin"
                                                              else " telecom (solo)" if suite == "tau2" else "")))
    items = [json.loads(x) for x in (out / "items.jsonl").read_text().splitlines() if x.strip().endswith("}")]
    fid = [c["fidelity"] for c in res["categories"].values() if c.get("fidelity")]
    return {
        "model": tag, "job": job_name, "suite": label + (f" [drift {res['drift']}]" if res["drift"] else ""),
        "rehearsal": n, "commit": job_commit(job), "n": res["n"], "overall": res["overall"],
        "passed": sum((c["accuracy"] or 0) * c["n"] for c in res["categories"].values()),
        "bfcl_overall_strict": res.get("bfcl_overall_strict"),
        "gen_tokens": res["tokens"]["gen_per_item"], "rehearsal_tokens": res["tokens"]["rehearsal_per_item"],
        "prompt_tokens": res["tokens"]["prompt_per_item"],
        "real_calls": (sum(c["mean_real_calls"] * c["n"] for c in res["categories"].values()) / res["n"]
                       if res["n"] else 0.0),
        "errors": sum(c["errors"] for c in res["categories"].values()),
        "seconds": res.get("wall_s_total") or 0.0,
        "backend": res.get("backend", "hf"), "backend_startup_s": res.get("backend_startup_s"),
        "rollout_s": res.get("rollout_s"),
        "items_in_dir": len(items),
        "run_dir": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
        "categories": res["categories"], "drift": res["drift"],
        "fidelity": fid[0] if len(fid) == 1 else (_merge_fid(res["categories"]) if fid else None),
        "load_avg_1m": load_range(out),
    }


def _merge_fid(cats: dict) -> dict:
    fs = [(c["fidelity"], c["fidelity"].get("n_items", 1)) for c in cats.values() if c.get("fidelity")]
    tot = sum(w for _, w in fs)
    keys = {k for f, _ in fs for k in f if k != "n_items"}
    out = {k: sum(f.get(k, 0.0) * w for f, w in fs) / tot for k in keys}
    out["n_items"] = tot
    return out


# ------------------------------------------------------------------ markdown
def _n(r: dict) -> str:
    """Rehearsal budget N as shown in tables: '2' (note in context, pre-engine rows), '2 memory' or
    '2 select'."""
    c = r.get("commit", "note")
    return f"{r['rehearsal']}" + (f" {c}" if c != "note" and r["rehearsal"] else "")


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def summary_table(rows: list[dict], tags: list[str]) -> str:
    """One line per job, one column per model: accuracy % (passed/n) and generated tok/item."""
    jobs = list(dict.fromkeys(r["job"] for r in rows))
    by = {(r["model"], r["job"]): r for r in rows}
    head = "| row | rehearsal N | " + " | ".join(tags) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(tags)]
    for j in jobs:
        any_r = next(r for r in rows if r["job"] == j)
        cells = []
        for t in tags:
            r = by.get((t, j))
            if r is None:
                cells.append("not run")
                continue
            acc = _pct(r["overall"])
            if r["suite"].startswith("bfcl"):
                cells.append(f"{acc} ({r['passed']:.0f}/{r['n']} items)")
            else:
                cells.append(f"{acc} ({r['passed']:.0f}/{r['n']})")
        lines.append(f"| {any_r['suite']} | {_n(any_r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def all_rows_table(rows: list[dict]) -> str:
    lines = ["| model | row | N | n | accuracy (%) | committed tok/item | rehearsal tok/item | "
             "prompt tok/item | real calls/item | errors | wall s | load 1m (min-max) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        la = r.get("load_avg_1m") or ()
        lines.append(f"| {r['model']} | {r['suite']} | {_n(r)} | {r['n']} | {_pct(r['overall'])} | "
                     f"{r['gen_tokens']:.0f} | {r['rehearsal_tokens']:.0f} | {r['prompt_tokens']:.0f} | "
                     f"{r['real_calls']:.2f} | {r['errors']} | {r['seconds']:.0f} | "
                     + ("-".join(f"{x:.1f}" for x in la) if la else "-") + " |")
    return "\n".join(lines) + "\n"


def bfcl_table(rows: list[dict]) -> str:
    brows = [r for r in rows if r["suite"].startswith("bfcl")]
    if not brows:
        return ""
    cats = [c for c in (SINGLE + "," + MULTI).split(",") if any(c in r["categories"] for r in brows)]
    lines = ["| model | N | " + " | ".join(cats) + " | overall (BFCL formula, groups run) | strict (missing = 0) |",
             "|---|---:|" + "---:|" * (len(cats) + 2)]
    keyed: dict = {}
    for r in brows:
        k = (r["model"], _n(r))
        keyed.setdefault(k, {"cats": {}, "ov": [], "strict": []})
        keyed[k]["cats"].update(r["categories"])
    # overall over single + multi together: recompute with BFCL's helpers on the merged categories
    from fastrehearse.eval import aggregate
    for (m, n), d in keyed.items():
        agg = aggregate.bfcl_overall(d["cats"])
        cells = [(f"{100 * d['cats'][c]['accuracy']:.0f} ({d['cats'][c]['n']})" if c in d["cats"] else "-")
                 for c in cats]
        lines.append(f"| {m} | {n} | " + " | ".join(cells) + f" | {_pct(agg['overall'])} | "
                     f"{_pct(agg['bfcl_overall_strict'])} |")
    return "\n".join(lines) + "\n"


def fidelity_table(rows: list[dict]) -> str:
    frows = [r for r in rows if r["fidelity"] or r["drift"]]   # drift rows even with no call to compare
    if not frows:
        return ""
    lines = ["| model | row | n tasks | task success (%) | real calls/item | rehearsed calls compared | "
             "fidelity exact (%) | fidelity field F1 (%) | responses drifted | calls to removed tool |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in frows:
        f = r["fidelity"] or {}
        calls = sum(c.get("fidelity", {}).get("calls", 0) * c.get("fidelity", {}).get("n_items", 0)
                    for c in r["categories"].values())
        # drift stats are stored per item since session 4; earlier drift runs show "n/r"
        ds = [c["drift"] for c in r["categories"].values() if c.get("drift")]
        changed = (f"{sum(d['changed'] for d in ds)}/{sum(d['responses'] for d in ds)}" if ds
                   else "n/r" if r["drift"] else "-")
        removed = (str(sum(d["removed_tool_calls"] for d in ds)) if ds and "remove" in (r["drift"] or "")
                   else "-")
        lines.append(f"| {r['model']} | {r['suite']} | {r['n']} | {_pct(r['overall'])} | {r['real_calls']:.2f} | "
                     f"{calls:.0f} | {_pct(f.get('exact'))} | {_pct(f.get('field_f1'))} | {changed} | {removed} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], tags: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 6.0), gridspec_kw={"width_ratios": [1, 1, 1.6]})
    sweep_suites = [s for s in dict.fromkeys(r["suite"] for r in rows if not r["drift"])
                    if len({r["rehearsal"] for r in rows if r["suite"] == s}) >= 3]
    for s in sweep_suites:
        for k, t in enumerate(tags):
            for commit, style in (("note", "-"), ("memory", "-."), ("select", "--")):
                # N = 0 (no rehearsal) starts both series
                rs = sorted((r for r in rows if r["suite"] == s and r["model"] == t
                             and (r["rehearsal"] == 0 or r.get("commit", "note") == commit)),
                            key=lambda r: r["rehearsal"])
                if len(rs) < 2:
                    continue
                ns = [r["rehearsal"] for r in rs]
                kw = dict(marker="o" if s == sweep_suites[0] else "s", linestyle=style, color=f"C{k}",
                          label=f"{t}, {s.split(' (')[0]} ({commit})")
                a1.plot(ns, [100 * (r["overall"] or 0) for r in rs], **kw)
                a2.plot(ns, [r["gen_tokens"] + r["rehearsal_tokens"] for r in rs], **kw)
    for a, yl in ((a1, "accuracy (%)"), (a2, "generated tokens / task (committed + rehearsal)")):
        a.set_xlabel("test-time rehearsal budget N")
        a.set_ylabel(yl, fontsize=8)
        a.set_xticks([0, 1, 2, 4])
    a1.set_title("accuracy vs test-time rehearsal N", fontsize=9)
    a2.set_title("token cost vs N", fontsize=9)
    a1.set_ylim(-3, 103)
    # under the figure: with several suites an in-axes legend would hide the curves
    h, lab = a1.get_legend_handles_labels()
    if h:
        fig.legend(h, lab, loc="lower left", bbox_to_anchor=(0.01, 0.0), ncol=3, fontsize=6)
    jobs = [j for j in dict.fromkeys(r["job"] for r in rows)]
    by = {(r["model"], r["job"]): r for r in rows}
    w = 0.8 / max(1, len(tags))
    for k, t in enumerate(tags):
        xs = [i + (k - (len(tags) - 1) / 2) * w for i in range(len(jobs))]
        ys = [100 * (by[(t, j)]["overall"] or 0) if (t, j) in by else 0 for j in jobs]
        a3.bar(xs, ys, w, label=t)
    a3.set_xticks(range(len(jobs)), jobs, rotation=40, ha="right", fontsize=7)
    a3.set_ylabel("accuracy (%)")
    a3.set_ylim(0, 100)
    a3.set_title("every row (n per row in the .md)", fontsize=9)
    a3.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None,
                   help="comma-separated [TAG=]SPEC (default: smollm2 plus runs/demo/export and "
                        "runs/demo_hybrid/export when present)")
    p.add_argument("--limit-builtin", type=int, default=24, help="builtin test (mixed levels) tasks")
    p.add_argument("--limit-easy", type=int, default=32, help="builtin test:easy tasks")
    p.add_argument("--limit-bfcl", type=int, default=4, help="items per BFCL single-turn category (8)")
    p.add_argument("--limit-bfcl-multi", type=int, default=1, help="items per BFCL multi-turn category (4)")
    p.add_argument("--limit-tau2", type=int, default=2)
    p.add_argument("--steps-builtin", type=int, default=6, help="policy turns per builtin task")
    p.add_argument("--steps-bfcl", type=int, default=3, help="policy turns per BFCL user turn")
    p.add_argument("--steps-tau2", type=int, default=4)
    p.add_argument("--jobs", default=None, help=f"comma-separated job names, run in that order; known: {list(JOBS)}")
    p.add_argument("--mode", default="parallel", choices=("parallel", "sequential"))
    p.add_argument("--max-new-tokens", type=int, default=64, help="per assistant turn (builtin, tau2)")
    p.add_argument("--max-new-tokens-bfcl", type=int, default=128,
                   help="per assistant turn on BFCL (gold parallel calls are 60-120 tokens)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=0, help="stop starting runs after this (0: no limit)")
    p.add_argument("--runs", default=None,
                   help="eval run dirs (default runs/bench/eval_runs; --record: benchmarks/results/eval_runs)")
    add_output_args(p)
    p.add_argument("--notes", default=None, help="markdown file appended to the report (caveats)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: robust on a shared box, and about as fast for 135M here)")
    p.add_argument("--backends", default="hf",
                   help="comma list of generation backends (hf, vllm), each job run once per backend, side by "
                        "side; a vllm run's job name and run dir get '@vllm'")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing new: rebuild the report from finished items of every selected run")
    a = p.parse_args()
    a.json = output_path(a.json, "eval_smollm2.json", a.record)
    a.runs = a.runs or (RESULTS if a.record else SCRATCH) / "eval_runs"
    names = a.jobs.split(",") if a.jobs else list(JOBS)
    bad = [n for n in names if n not in JOBS]
    if bad:
        raise SystemExit(f"--jobs: unknown run(s) {bad}; known: {list(JOBS)}")
    backends = a.backends.split(",")
    bad = [b for b in backends if b not in cli.BACKENDS]
    if bad:
        raise SystemExit(f"--backends: unknown {bad}; known: {list(cli.BACKENDS)}")

    import torch

    from fastrehearse.model import load_model

    if a.threads:
        torch.set_num_threads(a.threads)

    models = parse_models(a.models)
    tags = [t for t, _ in models]
    t_start = time.perf_counter()
    rows, skipped = [], []
    loaded: dict[str, object] = {}
    for name, backend in [(n, b) for n in names for b in backends]:
        job = JOBS[name]
        run_name = name if backend == "hf" else f"{name}@{backend}"
        for tag, spec in models:
            if job[6] and tag == BASE_TAG:
                continue               # drift / answer rows: trained models only (the base makes no calls)
            out = ROOT / a.runs / tag / run_name
            left = None if not a.budget_s else a.budget_s - (time.perf_counter() - t_start)
            if a.report_only:
                if not (out / "results.json").is_file():
                    skipped.append({"model": tag, "run": run_name})
                    continue
                res = json.loads((out / "results.json").read_text())
                rows.append(row_from(tag, run_name, job, res, out))
                continue
            if left is not None and left <= 0:
                skipped.append({"model": tag, "run": run_name})
                continue
            if spec not in loaded:
                loaded.clear()          # one model in memory at a time
                loaded[spec] = load_model(spec)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            res = cli.run(eval_args(a, spec, job, out, left, backend), loaded[spec])
            wall = time.perf_counter() - t0
            record_invocation(out, (load0, os.getloadavg()[0]), wall, res.get("items_run_last_invocation", 0) > 0)
            rows.append(row_from(tag, run_name, job, res, out))
            acc = "n/a" if res["overall"] is None else f"{res['overall']:.3f}"
            print(f"[{time.perf_counter() - t_start:6.0f}s] {tag} {run_name}: acc={acc} n={res['n']} errors={res['errors']} "
                  f"({wall:.0f}s, load {load0:.1f}->{os.getloadavg()[0]:.1f})", flush=True)
    total = time.perf_counter() - t_start
    meta = {"hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                         "threads": torch.get_num_threads(), "python": platform.python_version()},
            "settings": {k: v for k, v in vars(a).items() if k != "models" and not (
                a.report_only and k.startswith(("limit_", "steps_", "max_", "budget")))},
            "per_run_configuration": ("<run_dir>/run.json: eval settings (its limit is the first invocation's); "
                                      "<run_dir>/results.json: n and the last invocation's limit"),
            "models": dict(models), "wall_s_this_invocation": total,
            "wall_s_runs_total": sum(r["seconds"] for r in rows), "skipped_runs": skipped,
            "not_selected": [j for j in JOBS if j not in names]}
    out_json = ROOT / a.json
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = [f"# Eval report: SmolLM2-135M, untrained base vs demo-trained checkpoints (CPU)\n",
          f"Models: " + "; ".join(f"`{t}` = `{s}`" for t, s in models) + ".  ",
          f"Hardware: {meta['hardware']['cpu']} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, fp32, greedy. Sum of run wall times: "
          f"{meta['wall_s_runs_total']:.0f} s.\n",
          "## Summary: accuracy % (passed / n) per row and model\n", summary_table(rows, tags)]
    ft = fidelity_table(rows)
    if ft:
        md += ["\n## API drift and world-model fidelity (builtin EASY; every real call also rehearsed and "
               "compared with the real, possibly drifted, response)\n", ft]
    bt = bfcl_table(rows)
    if bt:
        md += ["\n## BFCL per category: accuracy % (n)\n", bt]
    md += ["\n## All rows (token columns per task; wall s summed over invocations)\n", all_rows_table(rows)]
    if meta["not_selected"]:
        md.append("\nNot run (not selected): " + ", ".join(meta["not_selected"]) + "\n")
    if skipped:
        by_model: dict[str, list[str]] = {}
        for s in skipped:
            by_model.setdefault(s["model"], []).append(s["run"])
        md.append(("\nNot run (CPU time; no finished run directory):\n" if a.report_only else
                   "\nSkipped (time budget):\n")
                  + "".join(f"- {m}: {', '.join(r)}\n" for m, r in by_model.items()))
    if a.notes:
        md.append("\n" + (ROOT / a.notes).read_text())
    text = "\n".join(md)
    out_json.with_suffix(".md").write_text(text)
    if rows:
        plot(rows, tags, out_json.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
