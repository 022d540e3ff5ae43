"""Test-time rehearsal prefill, side by side: re-prefill every private prompt (the behaviour before)
vs prefill duplicate prompts once vs the prefix KV cache (fastrehearse/rollout/backends/prefix_cache.py).

One real BFCL multi-turn entry (its first `--user-turns` user turns; ~7.4k-token prompts, mostly
tool docs) runs through the evaluation engine with `RehearsalPolicy` (N drafts, `--commit` form);
only the private engines' generators differ between variants, so the committed episode must be the
same token for token (checked). Per variant: wall and CPU seconds per episode (1 torch thread: CPU
seconds are the work done, less sensitive to a shared box), tokens prefilled by the private engines,
committed turns. Variants alternate order every round; medians over rounds; x_wall / x_cpu and
same_episode_as_first are relative to the first variant listed (default: re-prefill).

    nice python benchmarks/bench_rehearsal_cache.py                       # demo checkpoint if present
    python benchmarks/bench_rehearsal_cache.py --policy smollm2 --rounds 1 --user-turns 1

Writes runs/bench/bench_rehearsal_cache.json (--record: benchmarks/results/) and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_output_args, hardware, output_path, print_table, write_json  # noqa: E402

from fastrehearse.eval import suites  # noqa: E402
from fastrehearse.eval.rehearsal import DEFAULT_PREFIX_CACHE_BYTES, RehearsalPolicy  # noqa: E402
from fastrehearse.eval.runner import EvalSettings, eval_engine  # noqa: E402

# name -> (prefix cache bytes, prefill duplicate prompts once)
VARIANTS = {"re-prefill (before)": (0, False), "dedupe only": (0, True),
            "prefix cache": (DEFAULT_PREFIX_CACHE_BYTES, True)}


def default_policy() -> str:
    demo = ROOT / "runs/demo/export"
    return str(demo) if (demo / "config.json").is_file() else "smollm2"


def counting_policy(model, tok, a, cache_bytes: int, dedupe: bool) -> tuple[RehearsalPolicy, list[int]]:
    """The policy as built, its private engines' generators (the policy's own) set to `dedupe` and
    counting the tokens they prefill."""
    pol = RehearsalPolicy(model, tok, a.budget, form=a.commit, mode=a.mode, max_new_tokens=a.max_new_tokens,
                          prefix_cache_bytes=cache_bytes)
    fed = [0]

    def counting(factory):
        def make():
            g = factory()
            g.dedupe = dedupe
            start = g.start

            def counted(prompts):
                out = start(prompts)
                fed[0] += sum(map(len, prompts)) - g.reused_tokens
                return out
            g.start = counted
            return g
        return make

    for eng in (pol.drafts, pol.greedy, pol.assess):
        eng.backend_factory = counting(eng.backend_factory)
    return pol, fed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default=None, help="model spec (default: runs/demo/export, else smollm2)")
    p.add_argument("--category", default="multi_turn_base")
    p.add_argument("--entry", type=int, default=0, help="which entry of the category")
    p.add_argument("--user-turns", type=int, default=2, help="first user turns of the entry to run")
    p.add_argument("--max-turns", type=int, default=2, help="agent turns per user turn")
    p.add_argument("--budget", type=int, default=2, help="private rehearsals per committed turn (N)")
    p.add_argument("--commit", default="select", choices=("select", "memory"))
    p.add_argument("--mode", default="parallel", choices=("parallel", "sequential"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    add_output_args(p)
    a = p.parse_args()
    a.json = output_path(a.json, "bench_rehearsal_cache.json", a.record)
    for name in ("user_turns", "max_turns", "budget", "max_new_tokens", "rounds", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        p.error(f"--variants: unknown {bad}; known: {list(VARIANTS)}")
    torch.set_num_threads(a.threads)
    a.policy = a.policy or default_policy()

    from fastrehearse.model import load_model
    sr = suites.build("bfcl", [a.category], a.entry + 1, a.max_turns, 0)
    if len(sr.items) <= a.entry:
        p.error(f"--entry {a.entry}: {a.category} has {len(sr.items)} entries")
    cat, task = sr.items[a.entry]
    pay = task.payload
    task = dataclasses.replace(task, payload={**pay, "user_turns": pay["user_turns"][:a.user_turns],
                                              "added_tools": pay["added_tools"][:a.user_turns]})
    model, tok = load_model(a.policy)
    settings = EvalSettings(max_turns=a.max_turns, max_new_tokens=a.max_new_tokens)

    runs: dict[str, list[dict]] = {v: [] for v in names}
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for v in order:
            cache_bytes, dedupe = VARIANTS[v]
            pol, fed = counting_policy(model, tok, a, cache_bytes, dedupe)
            engine = eval_engine(model, tok, settings, policy=pol)
            w0, c0 = time.perf_counter(), time.process_time()
            res = engine.rollout([task], lambda: sr.make_env(cat), policy=pol, seed=0)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            ep = res.episodes[0]
            n0 = len(engine.prompt_for(task, sr.make_env(cat), 0).input_ids)
            meta = [i for i in ep.metadata.get("policy", []) if isinstance(i, dict)]
            runs[v].append({"wall_s": wall, "cpu_s": cpu, "private_prefill_tokens": fed[0],
                            "prompt_tokens": n0, "episode_tokens": len(ep.input_ids),
                            "committed_turns": len(meta),
                            "rehearsal_tokens": sum(int(i.get("rehearsal_tokens", 0)) for i in meta),
                            "tokens_sha": hashlib.sha256(str(ep.input_ids).encode()).hexdigest()[:16],
                            "prefix_cache": pol.prefix_cache.stats() if pol.prefix_cache else None})
            print(f"round {rnd} {v}: {wall:.1f} s wall, {cpu:.1f} s CPU, {fed[0]} private tokens prefilled",
                  flush=True)

    ref = runs[names[0]]
    rows = []
    for v in names:
        rs = runs[v]
        wall = statistics.median(r["wall_s"] for r in rs)
        cpu = statistics.median(r["cpu_s"] for r in rs)
        rows.append({"method": v, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                     "x_wall": round(wall / statistics.median(r["wall_s"] for r in ref), 3),
                     "x_cpu": round(cpu / statistics.median(r["cpu_s"] for r in ref), 3),
                     "private_prefill_tokens": rs[0]["private_prefill_tokens"],
                     "committed_turns": rs[0]["committed_turns"], "rehearsal_tokens": rs[0]["rehearsal_tokens"],
                     "same_episode_as_first": all(r["tokens_sha"] == ref[0]["tokens_sha"] for r in rs)})
    print_table(f"Test-time rehearsal on BFCL {a.category}[{a.entry}] (first {a.user_turns} user turns, "
                f"N={a.budget} {a.commit}, {a.policy}), median of {a.rounds}",
                rows, ["method", "wall_s", "cpu_s", "x_wall", "x_cpu",
                       "private_prefill_tokens", "committed_turns", "rehearsal_tokens", "same_episode_as_first"])
    write_json(a.json, {"benchmark": "bench_rehearsal_cache", "hardware": hardware("cpu"),
                        "settings": vars(a), "entry": f"{cat}/{task.id}", "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
