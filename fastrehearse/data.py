"""The episode record: what the rollout produces and packing consumes.

An episode is one token sequence built from the generation record (token in, token out) -- never by
re-tokenizing generated text, so roles and rollout log-probs stay aligned with what was sampled.
`roles[i]` is the role of token i itself (the role that *produced* it). Packing shifts by one: the
loss at position t is about token t+1, so it uses `roles[t+1]` and `rollout_logprobs[t+1]`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fastrehearse.kernels.roles import NUM_ROLES, Role


@dataclass
class Episode:
    input_ids: list[int]
    roles: list[int]
    task_id: str
    reward: float = 0.0
    # Log-prob of each token under the behaviour (rollout) policy; NaN where the token was not
    # sampled (CONTEXT / OBSERVED). Same length as input_ids, or None when unknown.
    rollout_logprobs: list[float] | None = None
    # Optional per-role reward overrides (e.g. a world-model fidelity reward for REHEARSE tokens).
    role_rewards: dict[int, float] = field(default_factory=dict)
    # Per-token advantages, what packing reads (None: 0 everywhere); computed by
    # fastrehearse.algo.compute_advantages and set on new episodes by `with_advantages`.
    advantages: list[float] | None = None
    # The engine's record (fastrehearse/rollout/engine/engine.py): stop_reason, turns, user_turns, calls,
    # malformed, prompt_tokens, fidelity, seed, group/sample; when present: tools_changed, policy,
    # drift, error (the episode could not run or be scored to its end: its reward is not a result).
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return len(self.input_ids)

    def validate(self) -> None:
        n = len(self.input_ids)
        if n == 0:
            raise ValueError(f"Episode(task_id={self.task_id!r}) is empty: an episode needs >= 1 token")
        if len(self.roles) != n:
            raise ValueError(
                f"Episode(task_id={self.task_id!r}): roles has {len(self.roles)} entries, input_ids {n}")
        bad = next((r for r in self.roles if not 0 <= int(r) < NUM_ROLES), None)
        if bad is not None:
            raise ValueError(f"Episode(task_id={self.task_id!r}): unknown role id {bad} "
                             f"(allowed: {[int(r) for r in Role]})")
        for name in ("rollout_logprobs", "advantages"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"Episode(task_id={self.task_id!r}): {name} has {len(v)} entries, "
                                 f"input_ids {n}")
        if not math.isfinite(self.reward):
            raise ValueError(f"Episode(task_id={self.task_id!r}): reward is {self.reward}")
