"""One evaluation routine for `fastrehearse eval` and the trainer's held-out number.

    engine = eval_engine(model, tok, EvalSettings(max_turns=12, max_new_tokens=256))
    results = evaluate_items(items, make_env, engine, policy, store, settings)

`EvalSettings` holds every knob that changes a number; the CLI builds it from its flags and the
trainer from its config (rollout limits, eval temperature), so a checkpoint evaluated by either,
with the same settings and seed, gets the same per-item results (tests/test_eval_engine.py).

World-model fidelity (`fidelity=True`) is measured the way training measures it: a second pass of
the same items in rehearse mode, where every rehearsed response is also executed against a fresh
real environment and compared (exact match, JSON field F1). It never touches the scored pass.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from fastrehearse.envs.base import Task, ToolEnv
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.results import ItemResult, ResultStore


@dataclass
class EvalSettings:
    max_turns: int = 12                     # agent turns per user turn (BFCL: its step limit)
    max_new_tokens: int = 256               # per agent turn (and per rehearsed response)
    max_episode_tokens: int | None = None   # None: the model's context length
    temperature: float = 0.0                # 0 = greedy
    top_p: float = 1.0
    mode: str = "real"                      # how calls run in the scored pass (the trainer may
                                            # measure success in rehearse mode; the CLI never does)
    batch_size: int = 8
    seed: int = 0
    fidelity: bool = False                  # second, rehearse-mode pass for world-model fidelity
    engine_options: dict | None = None      # further RolloutConfig fields (the trainer's
                                            # rollout.options, e.g. parallel_tool_calls)


def context_length(model) -> int:
    """The model's context length; no model (forced turns only: gold) -> no limit of its own."""
    if model is None:
        return 1 << 20
    return int(getattr(getattr(model, "config", None), "max_position_embeddings", None) or 8192)


def eval_engine(model, tokenizer, s: EvalSettings, *, mode: str | None = None, measure_fidelity: bool = False,
                policy=None):
    """The rollout engine an evaluation runs on. An episode's score is the benchmark's own
    (`malformed_reward=None`: a malformed call is fed back as an error and graded by the checker,
    never overridden). With a test-time rehearsal `policy` that keeps a prefix cache, the engine
    reads it (an item's first prefill is the context its first rehearsal already stored)."""
    from fastrehearse.rollout.engine import RolloutConfig, RolloutEngine

    cfg = RolloutConfig(
        mode=mode or s.mode, measure_fidelity=measure_fidelity, temperature=s.temperature, top_p=s.top_p,
        max_new_tokens=s.max_new_tokens, max_turns=s.max_turns,
        max_episode_tokens=s.max_episode_tokens or context_length(model),
        malformed_reward=None, max_batch_size=s.batch_size, **(s.engine_options or {}))
    engine = RolloutEngine(model, tokenizer, cfg)
    shared = getattr(policy, "backend_factory", None)
    factory = shared(engine) if callable(shared) and model is not None else None
    if factory is not None:
        engine.backend_factory = factory
    return engine


def evaluate_items(items: list[tuple[str, Task]], make_env: Callable[[str], ToolEnv], model, tokenizer,
                   policy, store: ResultStore, s: EvalSettings, *,
                   max_turns_for: Callable[[str], int] | None = None, deadline: float | None = None,
                   on_item: Callable[[ItemResult], None] | None = None) -> list[ItemResult]:
    """Score every (category, task) not yet scored in `store`; items that could not run are stored
    as errors. `max_turns_for(category)` overrides `s.max_turns` per category."""
    out: list[ItemResult] = []
    hcfg = HarnessConfig(batch_size=s.batch_size, deadline=deadline)
    groups: dict[int, list[tuple[str, Task]]] = {}
    for c, t in items:   # one engine per turn limit (categories keep their order inside a group)
        groups.setdefault(max_turns_for(c) if max_turns_for else s.max_turns, []).append((c, t))
    for turns, group in groups.items():
        st = replace(s, max_turns=turns)
        done = run_items(group, make_env, eval_engine(model, tokenizer, st, policy=policy), policy, store, hcfg,
                         seed=s.seed, on_item=None if s.fidelity else on_item)
        if s.fidelity:
            _add_fidelity(group, make_env, model, tokenizer, policy, store, st, hcfg)
            for r in done:
                if on_item is not None:
                    on_item(r)
        out += done
    return out


def fidelity_pending(store: ResultStore, keys) -> dict[tuple[str, str], ItemResult]:
    """The scored items among `keys` that have no fidelity yet: the ones just scored, and on a
    resume the ones an interrupted run scored before its fidelity pass ended (that pass keeps
    nothing on disk). Items that made no call stay without fidelity and are retried."""
    wanted = set(keys)
    return {r.key: r for r in store.items() if r.key in wanted and r.error is None and not r.fidelity}


def _add_fidelity(group, make_env, model, tokenizer, policy, store: ResultStore,
                  s: EvalSettings, hcfg: HarnessConfig) -> None:
    """Rehearse-mode pass over `fidelity_pending` items of `group` (this call's just-scored items
    are in `store` already); their fidelity is stored with them."""
    scored = fidelity_pending(store, [(c, t.id) for c, t in group])
    todo = [(c, t) for c, t in group if (c, t.id) in scored]
    if not todo:
        return
    scratch = MemoryStore()
    run_items(todo, make_env, eval_engine(model, tokenizer, s, mode="rehearse", measure_fidelity=True),
              policy, scratch, replace(hcfg, keep_transcripts=False), seed=s.seed)
    for r in scratch.items():
        item = scored[r.key]
        if r.error is None and r.fidelity:
            item.fidelity = r.fidelity
            store.add(item)        # the later line of an item replaces the earlier one on read


class MemoryStore(ResultStore):
    """A ResultStore that keeps results in memory only (the fidelity pass, the trainer)."""

    def __init__(self) -> None:   # no directory, no run.json
        self._items: dict = {}

    def add(self, result: ItemResult) -> None:
        self._items[result.key] = result

