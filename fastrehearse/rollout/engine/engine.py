"""World-rehearsal rollout: many episodes at once, the role swap inline, on a generation backend.

Every episode is one token sequence that only ever grows. Its per-row state machine (row.py)
decides what comes next; the model writes *segments* -- a policy turn up to its end-of-turn (or
call-close) marker, a rehearsed tool response up to the tool-turn end -- and everything between
them (chat scaffolding, real tool responses, user turns, forced turns) is appended by the row
itself. The decode loop (decode.py) keeps one segment in flight per live row on a backend
(fastrehearse/rollout/backends/: segments.py the protocol; hf_segments.py Hugging Face KV-cache
decoding with the engine's own sampler; vllm_backend.py vLLM with prefix caching), so a batch never
waits for its slowest turn. Call routing and execution: calls.py; episode + metrics assembly:
episode.py; the hook for a separate response simulator (the rollout benchmark's baseline):
simulator.py.

The environment protocol (fastrehearse.envs.base) decides everything env-specific: user turns
(none / scripted / a simulator), tools that change mid-task (`env.tools`, re-read after each user
turn: later parsing accepts the new tools and the template renders them as it would), the stop
tool (`finished`, `control_tools`, which are always executed), whether the env judges calls
itself (`validates_calls`), single-turn graded-call tasks (`grades_calls_only`: one turn,
nothing executed) and drift statistics. A policy (policy.py) decides who writes the agent's turns:
the model (sampled or greedy), scripted / gold turns, or a test-time rehearsal.

Token in, token out: episode tokens are exactly the sampled ids plus forced ids; generated text is
decoded only to detect stops and parse calls, never re-tokenized. The rollout log-prob of each
sampled token is the backend's log-prob of it under the sampling distribution (HF:
log_softmax(logits / temperature); NaN for forced tokens).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

from fastrehearse.data import Episode
from fastrehearse.envs.base import Suite, Task, ToolEnv, Trajectory
from fastrehearse.rollout.backends.generator import Generator, HFGenerator
from fastrehearse.rollout.backends.hf_segments import HFBackend, LogitsProcessor
from fastrehearse.rollout.backends.segments import Sampling, SegmentBackend, StopMatcher
from fastrehearse.rollout.config import Prompt, RolloutConfig
from fastrehearse.rollout.engine.decode import decode
from fastrehearse.rollout.engine.episode import build_episode, rollout_metrics
from fastrehearse.rollout.engine.policy import Policy
from fastrehearse.rollout.engine.row import Row, RowSettings
from fastrehearse.rollout.engine.simulator import ResponseSimulator, simulate
from fastrehearse.rollout.text.template import TOOL_CALL_CLOSE, ChatTemplate

__all__ = ["RolloutEngine", "RolloutResult"]


@dataclass
class RolloutResult:
    episodes: list[Episode]
    trajectories: list[Trajectory]
    metrics: dict[str, Any]


class RolloutEngine:
    """Batched world-rehearsal rollouts over a causal LM (see the module docstring).

    engine = RolloutEngine(model, tokenizer, RolloutConfig(mode="hybrid", hybrid_p=0.3))
    result = engine.rollout(tasks, suite, group_size=4, seed=0)   # episodes, trajectories, metrics
    result = engine.rollout(tasks, suite, policy=GoldPolicy())    # who writes the agent's turns
    result = engine.generate(prompts)                              # from token prefixes (no env:
                                                                   # private rehearsal)
    `model` may be None when no token will ever be sampled (a policy that forces every turn, with
    mode="real"): a row that needs the model then raises.

    `backend_factory` (hf backend): a factory of token-level `Generator`s (default: `HFGenerator`
    over `model`), read at each batch, so callers may swap it (a shared PrefixCache).
    `backend` (a SegmentBackend) overrides `config.backend`; with backend="vllm" the process's one
    vLLM instance for `model` is used (fastrehearse.rollout.backends.vllm_backend.shared_backend).
    `simulator` (simulator.py): rehearsed responses are written by it, outside the episode, instead
    of inline (the rollout benchmark's separate-simulator baseline).
    """

    def __init__(self, model, tokenizer, config: RolloutConfig | None = None, *,
                 template: ChatTemplate | None = None, backend_factory: Callable[[], Generator] | None = None,
                 logits_processor: LogitsProcessor | None = None, backend: SegmentBackend | None = None,
                 simulator: ResponseSimulator | None = None):
        self.config = config or RolloutConfig()
        self.config.validate()
        self.model = model
        self.template = template or ChatTemplate(tokenizer)
        tok = self.template.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.backend_factory = backend_factory or (lambda: HFGenerator(self._need_model(), pad_id=self.pad_id))
        self.logits_processor = logits_processor
        self.eos_ids = {i for i in (tok.eos_token_id,) if i is not None}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]) - {None}
        for m in self.template.assistant_end_markers:
            ids = tok.encode(m, add_special_tokens=False)
            if len(ids) == 1:
                self.eos_ids.add(ids[0])
        # Decode window for stop detection: enough tokens to spell the longest marker.
        longest = max(len(tok.encode(m, add_special_tokens=False))
                      for m in self.template.assistant_end_markers + self.template.tool_end_markers
                      + [TOOL_CALL_CLOSE])
        self.window = longest + 8
        self.stops = StopMatcher(tok, self.window)
        if backend is not None and logits_processor is not None and backend.name != "hf":
            raise ValueError(f"a logits_processor needs rollout.backend=hf (the {backend.name} backend "
                             "samples in its own process)")
        if backend is None and self.config.backend == "vllm":
            if logits_processor is not None:
                raise ValueError("a logits_processor needs rollout.backend=hf (vLLM samples in its own "
                                 "process)")
            # local: vllm_backend imports fastrehearse.model (transformers, ~4 s), never needed with hf
            from fastrehearse.rollout.backends.vllm_backend import require_vllm
            require_vllm()      # refused here, one line naming the package, before any work
        self._backend = backend
        self.simulator = simulator
        self._env_errors: Counter = Counter()
        self.policy: Policy | None = None     # the token source of the current generate() call

    @property
    def backend(self) -> SegmentBackend:
        """The segment backend. vLLM starts at the first use (a policy that forces every turn never
        needs it; with model=None a row that needs the model raises as with hf)."""
        if self._backend is None:
            if self.config.backend == "vllm":
                from fastrehearse.rollout.backends.vllm_backend import shared_backend  # local: as above
                self._backend = shared_backend(self._need_model(), self.template.tokenizer, self.config)
            else:
                self._backend = HFBackend(lambda: self.backend_factory, self.stops, max_chunk=self.config.max_chunk,
                                          logits_processor=lambda: self.logits_processor)
        return self._backend

    def _count_env_error(self, kind: str) -> None:
        self._env_errors[kind] += 1

    def _need_model(self):
        if self.model is None:
            raise ValueError("RolloutEngine(model=None) cannot sample: a row needs the model (a policy "
                             "that does not force every turn, or a rehearsed call)")
        return self.model

    # -- public API ----------------------------------------------------------------------------
    def prompt_for(self, task: Task, env: ToolEnv, seed: int) -> Prompt:
        reset = env.reset(task)
        r = self.template.render_prompt(reset.messages, reset.tools)
        return Prompt(r.input_ids, r.roles, reset.tools, list(reset.messages), task, env, seed)

    def rollout(self, tasks: Sequence[Task], envs: Suite | Callable[[], ToolEnv], *,
                group_size: int = 1, seed: int = 0, policy: Policy | None = None) -> RolloutResult:
        """`group_size` episodes per task (the GRPO group), each with its own environment.
        `policy` (policy.py): who writes the agent's turns; None: the model."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        make_env = envs.make_env if isinstance(envs, Suite) else envs
        if not callable(make_env):
            raise ValueError("envs must be a Suite or a callable returning a ToolEnv")
        prompts = []
        try:
            for ti, task in enumerate(tasks):
                for g in range(group_size):
                    env = make_env()
                    if not isinstance(env, ToolEnv):
                        raise TypeError(f"the env factory returned {type(env).__name__}, not a "
                                        "fastrehearse.envs.base.ToolEnv (the protocol the engine reads)")
                    try:
                        prompts.append(self.prompt_for(task, env, seed * 7_919_993 + ti * group_size + g))
                    except BaseException:
                        env.close()
                        raise
            result = self.generate(prompts, policy=policy)
        finally:
            for p in prompts:
                try:
                    p.env.close()
                except Exception:
                    pass
        for ep, (ti, g) in zip(result.episodes, [(i, g) for i in range(len(tasks)) for g in range(group_size)]):
            ep.metadata.update(group=ti, sample=g)
        return result

    def generate(self, prompts: Sequence[Prompt], *, policy: Policy | None = None) -> RolloutResult:
        """Run rows from token prefixes. Rows without an env only rehearse (test-time rehearsal).
        `policy` as in `rollout`."""
        for i, p in enumerate(prompts):
            if len(p.input_ids) == 0 or len(p.input_ids) != len(p.roles):
                raise ValueError(f"prompts[{i}]: input_ids must be non-empty and match roles")
        t0 = time.perf_counter()
        stats = Counter()
        # Reentrant: a policy may call generate() on this engine for private rehearsals while an
        # outer generate() waits for its answer; the outer call's policy and counters come back.
        outer = (self.policy, self._env_errors)
        self.policy, self._env_errors = policy, Counter()
        try:
            settings = RowSettings(self.config, self.template, frozenset(self.eos_ids),
                                   has_policy=policy is not None, count_env_error=self._count_env_error,
                                   simulated=self.simulator is not None)
            sampling = Sampling(self.config.temperature, self.config.top_p)
            backend = _Lazy(lambda: self.backend)   # opened only when a row needs the model
            sim = (None if self.simulator is None else
                   partial(simulate, simulator=self.simulator, settings=settings, backend=backend,
                           sampling=sampling, stats=stats))
            rows = [Row(settings, i, p) for i, p in enumerate(prompts)]
            # vLLM schedules every request itself (continuous batching, its own max_num_seqs): all of
            # this call's rows go to it at once. The HF backend decodes max_batch_size rows together.
            vllm = (self._backend.name if self._backend is not None else self.config.backend) == "vllm"
            bs = max(1, len(rows)) if vllm else self.config.max_batch_size
            for s in range(0, len(rows), bs):
                decode(rows[s:s + bs], backend, sampling, stats, policy=policy, simulate=sim)
            episodes = [build_episode(r) for r in rows]
            wall = time.perf_counter() - t0
            metrics = rollout_metrics(rows, episodes, stats, self._env_errors, wall)
            metrics["backend"] = self.config.backend if self._backend is None else self._backend.name
            return RolloutResult(episodes, [r.traj for r in rows], metrics)
        finally:
            self.policy, self._env_errors = outer


class _Lazy:
    """A SegmentBackend resolved at its first session (so an engine whose rows never sample never
    starts vLLM, and model=None raises only where a row needs the model)."""

    def __init__(self, get: Callable[[], SegmentBackend]):
        self.get = get

    def session(self, sampling: Sampling, stats: Counter):
        return self.get().session(sampling, stats)
