"""`fastrehearse eval`: run a policy on a benchmark with its own checker; resumable.

  fastrehearse eval --suite bfcl --categories simple_python multi_turn_base --policy gold --out runs/eval/gold
  fastrehearse eval --suite builtin --policy smollm2 --limit 20 --rehearsal-budget 2 --out runs/eval/smol-r2
  fastrehearse eval --suite builtin --policy smollm2 --rehearsal-budget 2 --rehearsal-commit select ...
  fastrehearse eval --suite builtin --policy runs/demo/export --drift rename,units --out runs/eval/drift
  fastrehearse eval --config configs/mcp_example.yaml --policy gold --out runs/eval/mcp-gold

Every item runs as one episode of the rollout engine (fastrehearse.rollout, the driver training
uses), scored by the benchmark's own checker. Writes OUT/items.jsonl (one line per finished item,
appended as items finish), OUT/results.json, OUT/results.md and OUT/accuracy.png. Rerunning with the
same --out skips scored items and retries items that could not run (errors, never scored).
Exit status: 0 all items scored, 1 some could not run, 2 a usage error (nothing run).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from fastrehearse.eval import aggregate, report, suites
from fastrehearse.eval.drift import DriftEnv, DriftSpec
from fastrehearse.eval.rehearsal import DEFAULT_PREFIX_CACHE_BYTES, RehearsalPolicy
from fastrehearse.eval.rehearsal import FORMS as REHEARSAL_FORMS, MODES as REHEARSAL_MODES
from fastrehearse.eval.results import ResultStore, per_category
from fastrehearse.eval.runner import EVAL_ROLLOUT, EvalSettings, eval_engine, evaluate_items, fidelity_pending
from fastrehearse.rollout.backends.vllm_options import BACKENDS
from fastrehearse.rollout.config import CUT_OUTCOMES, MALFORMED_OUTCOMES
from fastrehearse.rollout.engine.policy import GoldPolicy, ModelPolicy

# fastrehearse.train.config and fastrehearse.model import transformers (about 2.5 s): they are
# imported in the functions that need them, so `fastrehearse eval --help` does not wait for them.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastrehearse eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--suite", choices=suites.SUITES)
    which.add_argument("--config", help="a trainer config (YAML): evaluate its env (any suite, its options, "
                       "e.g. an MCP server) on its env.eval_split, with its rollout limits, seed and eval "
                       "temperature; the flags given here override them")
    p.set_defaults(given=frozenset())
    p.add_argument("--categories", nargs="+", default=None,
                   help="builtin: splits (default test); bfcl: categories (default: all 8 single-turn "
                        "AST + 4 multi-turn); tau2: domains (default telecom); --config: splits of its "
                        "suite (default: its env.eval_split). Commas also separate.")
    p.add_argument("--policy", required=True,
                   help="'gold' (replay ground truth), or a model spec for fastrehearse.model.load_model: "
                        "an HF dir (e.g. a trainer export), a .gguf, 'smollm2', 'tiny-llama', ...")
    p.add_argument("--limit", type=int, default=None, help="first N items of each category (N >= 1)")
    p.add_argument("--offset", type=int, default=0,
                   help="skip each category's first K items (with --limit N: items K .. K+N-1, e.g. a "
                        "pilot set disjoint from the reported first N)")
    p.add_argument("--rehearsal-budget", type=int, default=0,
                   help="test-time rehearsal: private rehearsals before each committed turn (0 = off)")
    p.add_argument("--rehearsal-mode", choices=REHEARSAL_MODES, default="parallel")
    p.add_argument("--rehearsal-commit", choices=REHEARSAL_FORMS, default="memory",
                   help="memory: the rehearsals and the model's own assessment of each become one "
                        "rehearsal memory in context before the committed turn (the paper's form); "
                        "select: commit the greedy turn or a draft, whichever the world model predicts "
                        "will not fail (see fastrehearse/eval/rehearsal.py)")
    p.add_argument("--rehearsal-horizon", type=int, default=1,
                   help="agent turns each private rehearsal looks ahead (each with predicted responses)")
    p.add_argument("--drift", default=None, help="perturb real responses, e.g. 'rename,errors,units,"
                   "formats,remove:TOOL' or 'all' (see fastrehearse/eval/drift.py)")
    p.add_argument("--measure-fidelity", action="store_true",
                   help="also run each item in rehearse mode and compare every rehearsed response with "
                        "the real one (on by default with --drift and a model policy)")
    p.add_argument("--out", required=True, help="run directory (resumable)")
    # engine settings: the names and defaults of fastrehearse.rollout.RolloutConfig (EVAL_ROLLOUT)
    p.add_argument("--batch-size", action=_Given, type=int, default=EVAL_ROLLOUT.max_batch_size,
                   help="episodes decoded together (the engine's max_batch_size)")
    p.add_argument("--max-turns", MAX_STEPS_ALIAS, dest="max_turns", type=int, default=None, action=_Given,
                   help="agent turns per user turn (the engine's max_turns; default: bfcl 20 as BFCL's "
                        f"own limit, builtin 12, tau2 16); --policy gold is never cut. "
                        f"{MAX_STEPS_ALIAS}: its old name, still accepted")
    p.add_argument("--max-new-tokens", action=_Given, type=int, default=EVAL_ROLLOUT.max_new_tokens,
                   help="tokens per agent turn and per rehearsed response")
    p.add_argument("--on-max-new-tokens", action=_Given, choices=CUT_OUTCOMES, default=EVAL_ROLLOUT.on_max_new_tokens,
                   help="a turn cut by --max-new-tokens: closed as written (end_turn, as BFCL's runner "
                        "does) or the episode ends")
    p.add_argument("--on-malformed", action=_Given, choices=MALFORMED_OUTCOMES, default=EVAL_ROLLOUT.on_malformed,
                   help="a malformed tool call: the agent sees a JSON error (error_response) or the "
                        "episode ends")
    p.add_argument("--max-episode-tokens", action=_Given, type=int, default=None,
                   help="tokens per episode, prompt included (default: the model's context length); "
                        "an item whose prompt alone does not fit is an error, never truncated")
    p.add_argument("--temperature", action=_Given, type=float, default=EVAL_ROLLOUT.temperature,
                   help="committed turns (0 = greedy)")
    p.add_argument("--rehearsal-temperature", type=float, default=0.7,
                   help="private rehearsal drafts (sampled, so parallel drafts differ)")
    p.add_argument("--rehearsal-cache-gib", type=float, default=DEFAULT_PREFIX_CACHE_BYTES / 2**30,
                   help="prefix KV cache shared by the private rehearsals, so a turn's drafts prefill "
                        "the context once and the next turn only its new tokens (0 = off: re-prefill)")
    p.add_argument("--seed", action=_Given, type=int, default=0)
    p.add_argument("--backend", action=_Given, choices=BACKENDS, default=EVAL_ROLLOUT.backend,
                   help="generation backend: hf (transformers, the engine's sampler) or vllm (one vLLM "
                        "instance; rehearsal drafts share it). results.json records backend, "
                        "backend_startup_s and rollout_s")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="start no new chunk of items after this many seconds (rerun to resume)")
    p.add_argument("--quiet", action="store_true")
    return p


MAX_STEPS_ALIAS = "--max-steps"


class _Given(argparse.Action):
    """Stores the value and records the flag as given (`args.given`): with --config, the flags
    not given take the config's values."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = frozenset(namespace.given) | {self.dest}


# flag (args attribute) -> where a trainer config holds it
CONFIG_FLAGS = {"max_turns": "rollout.max_turns", "max_new_tokens": "rollout.max_new_tokens",
                "on_max_new_tokens": "rollout.on_max_new_tokens", "on_malformed": "rollout.on_malformed",
                "max_episode_tokens": "rollout.max_episode_tokens", "temperature": "eval.temperature",
                "seed": "seed", "backend": "rollout.backend", "batch_size": "rollout.max_batch_size"}


def load_train_config(args: argparse.Namespace):
    """--config: the trainer config (checked as `fastrehearse train` checks it); the flags not given
    take its values, --measure-fidelity its eval.fidelity (off for MCP servers unless the config
    or the flag asks: fidelity executes every rehearsed call for real)."""
    from fastrehearse.train.config import ConfigError, check_env, get_key, load_config
    try:
        cfg = load_config(args.config)
        check_env(cfg)
    except ConfigError as e:
        raise UsageError(f"--config {args.config}: {e}") from None
    for flag, key in CONFIG_FLAGS.items():
        if flag not in args.given:
            setattr(args, flag, get_key(cfg, key))
    if not args.measure_fidelity:
        args.measure_fidelity = bool(cfg.eval.fidelity)
    args.suite = cfg.env.suite
    return cfg


class UsageError(ValueError):
    """A bad argument: `main` prints it as one line and exits 2, before any model loads."""


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v for x in values for v in x.split(",") if v]


GOLD_TOKENIZER = "smollm2"   # gold turns are forced text: a tokenizer suffices, no model runs


def load(args: argparse.Namespace, loaded=None):
    """(model, tokenizer, engine token source) for args.policy. `loaded`: an already loaded (model,
    tokenizer) (benchmarks reuse one). A model that cannot load is a UsageError."""
    from fastrehearse.model import load_model, load_tokenizer

    if loaded is None:
        try:
            loaded = ((None, load_tokenizer(GOLD_TOKENIZER)) if args.policy == "gold" else
                      load_model(args.policy, dtype=args.dtype, device=args.device, seed=args.seed))
        except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
            raise UsageError(f"--policy {args.policy}: {e}") from None
    model, tok = loaded
    if args.policy == "gold":
        return model, tok, GoldPolicy()
    if args.rehearsal_budget:
        return model, tok, RehearsalPolicy(
            model, tok, args.rehearsal_budget, form=args.rehearsal_commit, mode=args.rehearsal_mode,
            horizon=args.rehearsal_horizon, temperature=args.rehearsal_temperature,
            max_new_tokens=args.max_new_tokens, max_episode_tokens=args.max_episode_tokens,
            prefix_cache_bytes=int(args.rehearsal_cache_gib * 2**30), backend=args.backend)
    return model, tok, ModelPolicy()


def settings(args: argparse.Namespace, drift: DriftSpec | None) -> EvalSettings:
    """The flags over EVAL_ROLLOUT (one RolloutConfig); per-category turn limits come from the
    suite (eval/suites.py) when --max-turns is not given."""
    return EvalSettings(
        max_turns=args.max_turns or EVAL_ROLLOUT.max_turns, max_new_tokens=args.max_new_tokens,
        on_max_new_tokens=args.on_max_new_tokens, on_malformed=args.on_malformed,
        max_episode_tokens=args.max_episode_tokens, temperature=args.temperature,
        max_batch_size=args.batch_size, seed=args.seed, backend=args.backend,
        fidelity=args.policy != "gold" and (args.measure_fidelity or drift is not None))


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
    errors = [r for r in items if r.error is not None]
    items = [r for r in items if r.error is None]
    n = len(items)
    res["n"] = n                       # scored items
    res["errors"] = len(errors)        # items that could not run (not scored; a rerun retries them)
    res["rehearsal"] = {"budget": args.rehearsal_budget, "mode": args.rehearsal_mode,
                        "horizon": args.rehearsal_horizon, "commit": args.rehearsal_commit,
                        "prefix_cache_gib": args.rehearsal_cache_gib}
    res["drift"] = drift.describe() if drift else None
    # written after the fidelity pass ended: a results.json without it predates that pass
    res["fidelity_measured"] = args.policy != "gold" and (args.measure_fidelity or drift is not None)
    res["tokens"] = {
        "gen_per_item": sum(r.gen_tokens for r in items) / n if n else 0.0,
        "rehearsal_per_item": sum(r.rehearsal_tokens for r in items) / n if n else 0.0,
        "prompt_per_item": sum(r.prompt_tokens for r in items) / n if n else 0.0,
    }
    res["limit"], res["offset"] = args.limit, args.offset
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
    """0: every item scored; 1: some items could not run (errors; rerun the same --out to retry
    them); 2: a usage error (one line, nothing run)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if any(a == MAX_STEPS_ALIAS or a.startswith(MAX_STEPS_ALIAS + "=") for a in argv):
        print(f"fastrehearse eval: note: {MAX_STEPS_ALIAS} is the old name of --max-turns "
              f"(the engine's max_turns); it still works", file=sys.stderr)
    try:
        res = run(args)
    except UsageError as e:
        print(f"fastrehearse eval: error: {e}", file=sys.stderr)
        return 2
    if res["errors"]:
        print(f"fastrehearse eval: {res['errors']} item(s) could not run (not scored); rerun with the same "
              f"--out to retry them", file=sys.stderr)
        return 1
    return 0


def resolve_device_dtype(device: str, dtype: str) -> tuple[str, str]:
    """--device auto: CUDA when present; --dtype auto: bfloat16 on CUDA, float32 on the CPU (as
    the trainer's model.precision auto). Anything else must name a device / dtype."""
    from fastrehearse.model.loader import resolve_dtype
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch.cuda.is_available() is False on this machine")
    if dtype != "auto":
        try:
            resolve_dtype(dtype)
        except ValueError as e:
            raise UsageError(f"--dtype: {e} (or auto)") from None
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def check_args(args: argparse.Namespace) -> None:
    """Every argument checked before anything is loaded or written (UsageError names it)."""
    args.categories = _split(args.categories)
    if args.categories is not None and not args.categories:
        raise UsageError("--categories: empty list")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1 (items per category), got {args.limit}")
    if args.offset < 0:
        raise UsageError(f"--offset must be >= 0, got {args.offset}")
    for name in ("batch_size", "max_turns", "max_new_tokens", "max_episode_tokens", "rehearsal_horizon"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rehearsal_budget < 0:
        raise UsageError(f"--rehearsal-budget must be >= 0, got {args.rehearsal_budget}")
    if args.policy == "gold" and args.rehearsal_budget:
        raise UsageError("--rehearsal-budget needs a model policy (gold replays ground truth)")
    for name in ("temperature", "rehearsal_temperature", "rehearsal_cache_gib"):
        if not getattr(args, name) >= 0:     # NaN fails too
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.rehearsal_cache_gib == float("inf"):   # a byte budget must be a number of bytes
        raise UsageError("--rehearsal-cache-gib must be finite (0 = off), got inf")
    if args.time_limit_s is not None and not args.time_limit_s > 0:
        raise UsageError(f"--time-limit-s must be > 0, got {args.time_limit_s}")
    args.device, args.dtype = resolve_device_dtype(args.device, args.dtype)
    if args.backend == "vllm" and args.policy != "gold":   # gold forces every turn: nothing to serve
        from fastrehearse.rollout.backends.vllm_backend import VLLMUnavailable, require_vllm
        try:
            require_vllm()
        except VLLMUnavailable as e:
            raise UsageError(f"--backend vllm: {e}") from None


def run(args: argparse.Namespace, loaded=None) -> dict[str, Any]:
    """Run one eval; returns the results.json content. `loaded`: see make_policy."""
    check_args(args)
    train_cfg = load_train_config(args) if args.config else None
    try:   # suites and categories resolve (and fail) before the model loads
        drift = DriftSpec.parse(args.drift)
        turns = 10**6 if args.policy == "gold" else args.max_turns
        if train_cfg is not None:
            sr = suites.from_config(train_cfg, args.categories, args.limit, turns, args.offset)
        else:
            sr = suites.build(args.suite, args.categories, args.limit, turns, args.seed, args.offset)
    except (ValueError, KeyError, FileNotFoundError, TypeError, ImportError) as e:
        raise UsageError(str(e).strip("'\"")) from None
    if not sr.items:
        raise UsageError(f"no items: suite {args.suite} categories {args.categories} are empty")
    if args.policy == "gold":
        args.max_turns = 10**6
    config = {"harness": "engine", "suite": args.suite, "policy": args.policy,
              "rehearsal_budget": args.rehearsal_budget, "rehearsal_mode": args.rehearsal_mode,
              "rehearsal_horizon": args.rehearsal_horizon, "rehearsal_commit": args.rehearsal_commit,
              "rehearsal_temperature": args.rehearsal_temperature,
              "drift": drift.describe() if drift else None, "seed": args.seed,
              "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
              "on_max_new_tokens": args.on_max_new_tokens, "on_malformed": args.on_malformed,
              "max_episode_tokens": args.max_episode_tokens, "temperature": args.temperature,
              "measure_fidelity": args.measure_fidelity,
              "limit": args.limit, "offset": args.offset, "batch_size": args.batch_size, "categories": args.categories}
    if train_cfg is not None:   # a run dir of another env (or other options) is not resumed into
        config["env"] = {"suite": train_cfg.env.suite, "options": train_cfg.env.options}
    try:
        store = ResultStore(args.out, config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    keys = [(c, t.id) for c, t in sr.items]
    todo = sum(not store.done(c, t.id) for c, t in sr.items)
    s = settings(args, drift)
    fid_todo = len(fidelity_pending(store, keys)) if s.fidelity else 0   # a run killed in that pass

    def make_env(c: str):
        env = sr.make_env(c)
        return DriftEnv(env, drift) if drift else env

    t0 = time.perf_counter()
    if todo or fid_todo:
        model, tok, policy = load(args, loaded)
        bar = tqdm(total=todo, desc=f"eval {args.suite}/{args.policy}", disable=args.quiet, file=sys.stderr)
        seen = [0, 0.0]   # items scored, summed score

        def on_item(r):
            bar.update(1)
            if r.error is None:
                seen[0] += 1
                seen[1] += r.score
                bar.set_postfix(acc=f"{seen[1] / seen[0]:.2f}")

        startup = _start_backend(model, tok, s)
        t1 = time.perf_counter()
        evaluate_items(sr.items, make_env, model, tok, policy, store, s, max_turns_for=sr.max_turns_for,
                       deadline=None if args.time_limit_s is None else t0 + args.time_limit_s,
                       on_item=on_item)
        bar.close()
        rollout_s = time.perf_counter() - t1
    res = summarize(args, store, keys, time.perf_counter() - t0, drift)
    res["backend"] = args.backend
    if todo or fid_todo:   # this invocation's: vLLM start-up apart from the items' rollouts
        res["backend_startup_s"], res["rollout_s"] = round(startup, 2), round(rollout_s, 2)
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


def _start_backend(model, tok, s: EvalSettings) -> float:
    """--backend vllm: start the process's vLLM instance before the items (its start-up is reported
    apart from the rollouts); 0 for hf and for gold (nothing sampled)."""
    if s.rollout.backend != "vllm" or model is None:
        return 0.0
    from fastrehearse.rollout.backends.vllm_backend import VLLMStartError
    try:
        return eval_engine(model, tok, s).backend.startup_s
    except VLLMStartError as e:
        raise UsageError(f"--backend vllm: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
