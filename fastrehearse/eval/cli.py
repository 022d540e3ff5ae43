"""`fastrehearse eval`: run a policy on a benchmark with its own checker; resumable.

  fastrehearse eval --suite bfcl --categories simple_python multi_turn_base --policy gold --out runs/eval/gold
  fastrehearse eval --suite builtin --policy smollm2 --limit 20 --rehearsal-budget 2 --out runs/eval/smol-r2
  fastrehearse eval --suite builtin --policy runs/demo/export --drift rename,units --out runs/eval/drift

Writes OUT/items.jsonl (one line per finished item, appended as items finish), OUT/results.json,
OUT/results.md and OUT/accuracy.png. Rerunning with the same --out skips finished items.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

from fastrehearse.eval import aggregate, report, suites
from fastrehearse.eval.drift import DriftEnv, DriftSpec
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.results import ResultStore, per_category


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastrehearse eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", required=True, choices=suites.SUITES)
    p.add_argument("--categories", nargs="+", default=None,
                   help="builtin: splits (default test); bfcl: categories (default: all 8 single-turn "
                        "AST + 4 multi-turn); tau2: domains (default telecom). Commas also separate.")
    p.add_argument("--policy", required=True,
                   help="'gold' (replay ground truth), or a model spec for fastrehearse.model.load_model: "
                        "an HF dir (e.g. a trainer export), a .gguf, 'smollm2', 'tiny-llama', ...")
    p.add_argument("--limit", type=int, default=None, help="first N items of each category")
    p.add_argument("--rehearsal-budget", type=int, default=0,
                   help="test-time rehearsal: private rehearsals before each committed turn (0 = off)")
    p.add_argument("--rehearsal-mode", choices=("parallel", "sequential"), default="parallel")
    p.add_argument("--rehearsal-commit", choices=("note", "select"), default="note",
                   help="note: the rehearsals become a note in context before the committed turn; "
                        "select: commit the greedy turn or a draft, whichever the world model "
                        "predicts will not fail (see fastrehearse/eval/rehearsal.py)")
    p.add_argument("--rehearsal-horizon", type=int, default=1,
                   help="steps each private rehearsal looks ahead (policy turn + predicted responses)")
    p.add_argument("--drift", default=None, help="perturb real responses, e.g. 'rename,errors,units,"
                   "formats,remove:TOOL' or 'all' (see fastrehearse/eval/drift.py)")
    p.add_argument("--measure-fidelity", action="store_true",
                   help="also rehearse every real call and compare with the real response "
                        "(on by default with --drift and a model policy)")
    p.add_argument("--out", required=True, help="run directory (resumable)")
    p.add_argument("--batch-size", type=int, default=8, help="episodes decoded together")
    p.add_argument("--max-steps", type=int, default=None,
                   help="policy turns per user turn (default: bfcl 20 as BFCL's own limit, builtin 12, "
                        "tau2 16); --policy gold is never cut (its record is finite)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per assistant turn")
    p.add_argument("--max-response-tokens", type=int, default=128, help="tokens per rehearsed response")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="default: the model's context length minus --max-new-tokens; longer prompts "
                        "drop their oldest turns, then their middle")
    p.add_argument("--temperature", type=float, default=0.0, help="committed turns (0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefill-batch-cells", type=int, default=None,
                   help="max B*T^2 of one padded prefill (default 8M); 1 = every prompt alone, "
                        "which maximizes KV prefix reuse (best on CPU when prompts are long)")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="start no new item after this many seconds (live ones finish; rerun to resume)")
    p.add_argument("--quiet", action="store_true")
    return p


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v for x in values for v in x.split(",") if v]


def make_policy(args: argparse.Namespace, loaded=None):
    """`loaded`: an already loaded (model, tokenizer) for args.policy (benchmarks reuse one)."""
    if args.policy == "gold":
        if args.rehearsal_budget:
            raise ValueError("--rehearsal-budget needs a model policy (gold replays ground truth)")
        from fastrehearse.eval.policies import GoldPolicy
        return GoldPolicy()
    from fastrehearse.eval.policies import GenConfig, ModelPolicy
    from fastrehearse.model import load_model

    model, tok = loaded or load_model(args.policy, dtype=args.dtype, device=args.device, seed=args.seed)
    gen = GenConfig(max_new_tokens=args.max_new_tokens, max_response_tokens=args.max_response_tokens,
                    max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature, seed=args.seed,
                    kv_cache_entries=max(8, args.batch_size))
    if args.prefill_batch_cells is not None:
        gen.pad_cells = args.prefill_batch_cells
    policy = ModelPolicy(model, tok, name=str(args.policy), gen=gen)
    if args.rehearsal_budget:
        from fastrehearse.eval.rehearsal import RehearsalPolicy
        policy = RehearsalPolicy(policy, args.rehearsal_budget, args.rehearsal_mode, args.rehearsal_horizon,
                                 commit=args.rehearsal_commit)
    return policy


def summarize(args: argparse.Namespace, store: ResultStore, keys_in_order: list[tuple[str, str]],
              wall_s: float, drift: DriftSpec | None) -> dict[str, Any]:
    keys = set(keys_in_order)
    items = [r for r in store.items() if r.key in keys]
    cats = per_category(items)
    order = list(dict.fromkeys(c for c, _ in keys_in_order))   # the order categories were asked in
    cats = {c: cats[c] for c in order if c in cats}
    res: dict[str, Any] = {"suite": args.suite, "policy": args.policy, "categories": cats}
    if args.suite == "bfcl":
        agg = aggregate.bfcl_overall(cats)
        res["overall"] = agg["overall"]
        res["bfcl_overall_strict"] = agg["bfcl_overall_strict"]
        res["bfcl_groups"] = agg["groups"]
        res["aggregation"] = ("BFCL v4 leaderboard formula over the categories run (see "
                              "fastrehearse/eval/aggregate.py)")
    else:
        res["overall"] = aggregate.mean_overall(cats)
        res["aggregation"] = "mean over items"
    n = len(items)
    res["n"] = n
    res["rehearsal"] = {"budget": args.rehearsal_budget, "mode": args.rehearsal_mode,
                        "horizon": args.rehearsal_horizon, "commit": args.rehearsal_commit}
    res["drift"] = drift.describe() if drift else None
    res["tokens"] = {
        "gen_per_item": sum(r.gen_tokens for r in items) / n if n else 0.0,
        "rehearsal_per_item": sum(r.rehearsal_tokens for r in items) / n if n else 0.0,
        "prompt_per_item": sum(r.prompt_tokens for r in items) / n if n else 0.0,
    }
    res["limit"] = args.limit
    res["wall_s_last_invocation"] = wall_s
    res["host"] = {"python": platform.python_version(), "machine": platform.machine(),
                   "cpu": _cpu_name()}
    return res


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


def run(args: argparse.Namespace, loaded=None) -> dict[str, Any]:
    """Run one eval; returns the results.json content. `loaded`: see make_policy."""
    args.categories = _split(args.categories)
    for name in ("batch_size", "max_steps", "max_new_tokens", "max_response_tokens", "max_prompt_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rehearsal_budget < 0:
        raise ValueError(f"--rehearsal-budget must be >= 0, got {args.rehearsal_budget}")
    drift = DriftSpec.parse(args.drift)
    if args.policy == "gold":
        args.max_steps = 10**6
    sr = suites.build(args.suite, args.categories, args.limit, args.max_steps, args.seed)
    config = {"suite": args.suite, "policy": args.policy, "rehearsal_budget": args.rehearsal_budget,
              "rehearsal_mode": args.rehearsal_mode, "rehearsal_horizon": args.rehearsal_horizon,
              **({"rehearsal_commit": args.rehearsal_commit} if args.rehearsal_commit != "note" else {}),
              "drift": drift.describe() if drift else None, "seed": args.seed,
              "max_steps": args.max_steps, "max_new_tokens": args.max_new_tokens,
              "max_response_tokens": args.max_response_tokens, "temperature": args.temperature,
              "max_prompt_tokens": args.max_prompt_tokens, "measure_fidelity": args.measure_fidelity,
              "prefill_batch_cells": args.prefill_batch_cells,
              "limit": args.limit, "batch_size": args.batch_size, "categories": args.categories}
    store = ResultStore(args.out, config)
    keys = [(c, t.id) for c, t in sr.items]
    todo = sum(not store.done(c, t.id) for c, t in sr.items)
    policy = make_policy(args, loaded) if todo else None
    measure = policy is not None and args.policy != "gold" and (args.measure_fidelity or drift is not None)

    def make_env(c: str):
        env = sr.make_env(c)
        return DriftEnv(env, drift) if drift else env

    t0 = time.perf_counter()
    if todo:
        from tqdm import tqdm
        bar = tqdm(total=todo, desc=f"eval {args.suite}/{args.policy}", disable=args.quiet, file=sys.stderr)
        seen = [0, 0.0]   # items finished, summed score

        def on_item(r):
            seen[0] += 1
            seen[1] += r.score
            bar.update(1)
            bar.set_postfix(acc=f"{seen[1] / seen[0]:.2f}")

        cfg = HarnessConfig(batch_size=args.batch_size, measure_fidelity=measure,
                            deadline=None if args.time_limit_s is None else t0 + args.time_limit_s)
        run_items(sr.items, make_env, policy, store, cfg, max_steps_for=sr.max_steps_for, on_item=on_item)
        bar.close()
    res = summarize(args, store, keys, time.perf_counter() - t0, drift)
    prev = store.dir / "results.json"
    try:   # wall time summed over every invocation that ran items of this directory
        old = json.loads(prev.read_text()) if prev.exists() else {}
        before = float(old.get("wall_s_total", old.get("wall_s_last_invocation", 0.0)))
    except (ValueError, OSError):
        before = 0.0
    res["wall_s_total"] = before + (res["wall_s_last_invocation"] if todo else 0.0)
    res["items_run_last_invocation"] = todo
    store.write_results(res)
    report.write_run_report(res, args.out)
    if not args.quiet:
        print(report.results_markdown(res))
        print(f"wrote {store.dir / 'results.json'}  ({len(sr.items) - todo} items resumed, {todo} run)")
    return res


if __name__ == "__main__":
    sys.exit(main())
