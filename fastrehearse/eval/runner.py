"""One evaluation routine for `fastrehearse eval` and the trainer's held-out number.

    engine = eval_engine(model, tok, EvalSettings(max_turns=12, max_new_tokens=256))
    results = evaluate_items(items, make_env, engine, policy, store, settings)

`EvalSettings` holds every knob that changes a number. Its engine knobs are one
`fastrehearse.rollout.RolloutConfig` (turn and token limits, cut turns, malformed calls,
decoding): the CLI builds it from its flags over `EVAL_ROLLOUT`, the trainer with
`EvalSettings.from_rollout(cfg.rollout.engine, ...)` from its own rollout config, so no field is
restated or dropped, and a checkpoint evaluated by either, with the same settings and seed, gets
the same per-item results (tests/test_eval_engine.py).

World-model fidelity (`fidelity=True`) is measured the way training measures it: a second pass of
the same items in rehearse mode, where every rehearsed response is also executed against a fresh
real environment and compared (exact match, JSON field F1). It never touches the scored pass.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from fastrehearse.envs.base import Task, ToolEnv
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.results import ItemResult, ResultStore
from fastrehearse.rollout.config import RolloutConfig
from fastrehearse.rollout.engine.engine import RolloutEngine

# What `fastrehearse eval` runs with unless told otherwise: real tools, greedy, 12 agent turns per
# user turn, 256 tokens per turn, 8 episodes decoded together; every other engine knob is
# RolloutConfig's own default. (A suite may set its own turn limit: eval/suites.py.)
EVAL_ROLLOUT = RolloutConfig(mode="real", temperature=0.0, max_turns=12, max_new_tokens=256,
                             max_batch_size=8)
_ENGINE_FIELDS = {f.name for f in fields(RolloutConfig)}


@dataclass(init=False)
class EvalSettings:
    """rollout: the engine's settings for the scored pass (its `mode` says how calls run there;
    `measure_fidelity` is the evaluation's own, set by `eval_engine`);
    fit_context: episodes may use the model's whole context (rollout.max_episode_tokens is then
    ignored); seed; fidelity: a second, rehearse-mode pass for world-model fidelity."""
    rollout: RolloutConfig
    seed: int
    fidelity: bool
    fit_context: bool

    def __init__(self, rollout: RolloutConfig | None = None, *, seed: int = 0,
                 fidelity: bool = False, fit_context: bool | None = None, **engine):
        """rollout: the base engine config (default EVAL_ROLLOUT); engine: RolloutConfig fields
        replacing its values (`batch_size` is `max_batch_size`; `max_episode_tokens=None` means
        the model's context length, the default without a base config). Unknown names raise."""
        if "batch_size" in engine:
            engine["max_batch_size"] = engine.pop("batch_size")
        unknown = sorted(set(engine) - _ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"EvalSettings: unknown engine setting(s) {unknown}; RolloutConfig "
                            f"fields are {sorted(_ENGINE_FIELDS)}")
        if fit_context is None:
            fit_context = rollout is None
        if "max_episode_tokens" in engine:
            fit_context = engine["max_episode_tokens"] is None
            if fit_context:
                del engine["max_episode_tokens"]
        self.rollout = replace(rollout or EVAL_ROLLOUT, **engine)
        self.rollout.validate()
        self.seed, self.fidelity, self.fit_context = seed, fidelity, fit_context

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, *, seed: int, fidelity: bool = False,
                     **overrides) -> "EvalSettings":
        """The evaluation of a run whose engine is configured by `rollout` (the trainer's
        `cfg.rollout.engine`): every engine field carried over (on_max_new_tokens, on_malformed,
        parallel_tool_calls, max_episode_tokens, max_batch_size, ...); `overrides` replace named
        RolloutConfig fields, e.g. `temperature=cfg.eval.temperature, mode=cfg.eval.mode`."""
        return cls(rollout, seed=seed, fidelity=fidelity, **overrides)

    def with_engine(self, **engine) -> "EvalSettings":
        return EvalSettings(self.rollout, seed=self.seed, fidelity=self.fidelity,
                            fit_context=self.fit_context, **engine)

    @property
    def max_turns(self) -> int:
        return self.rollout.max_turns

    @property
    def batch_size(self) -> int:
        return self.rollout.max_batch_size


def context_length(model) -> int:
    """The model's context length; no model (forced turns only: gold) -> no limit of its own."""
    if model is None:
        return 1 << 20
    return int(getattr(getattr(model, "config", None), "max_position_embeddings", None) or 8192)


def eval_engine(model, tokenizer, s: EvalSettings, *, mode: str | None = None, measure_fidelity: bool = False,
                policy=None):
    """The rollout engine an evaluation runs on: `s.rollout`, with the evaluation's own rules. An
    episode's score is the benchmark's own (the engine reports `env.score`: a malformed call is fed
    back as an error and graded by the checker). With a test-time rehearsal `policy`
    that keeps a prefix cache, the engine reads it (an item's first prefill is the context its
    first rehearsal already stored)."""
    cfg = replace(s.rollout, mode=mode or s.rollout.mode, measure_fidelity=measure_fidelity,
                  max_episode_tokens=(context_length(model) if s.fit_context
                                      else s.rollout.max_episode_tokens))
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
        st = s.with_engine(max_turns=turns)
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

