"""The rollout engine's settings (RolloutConfig) and its input rows (Prompt): their own module, so
the modules the engine is built from (the row, the decode loop) import them without importing the
engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fastrehearse.envs.base import Task, ToolEnv
from fastrehearse.rollout.backends.vllm_options import BACKENDS, VLLMOptions

MODES = ("rehearse", "real", "hybrid")
MALFORMED_OUTCOMES = ("error_response", "end_episode")
CUT_OUTCOMES = ("end_turn", "end_episode")


@dataclass
class RolloutConfig:
    mode: Literal[MODES] = "rehearse"
    hybrid_p: float = 0.5               # hybrid: probability that a call is executed for real
    measure_fidelity: bool = False      # rehearsed calls are also executed (never shown to the
                                        # model) to score the world model: exact match / JSON field F1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128           # per generated turn (policy turn or rehearsed response)
    on_max_new_tokens: Literal[CUT_OUTCOMES] = "end_turn"  # a turn cut by max_new_tokens: "end_turn" closes it as
                                        # written (the template's end-of-turn forced as CONTEXT; a
                                        # cut agent turn is parsed like any other, as BFCL's runner
                                        # takes a cut output as the reply) or "end_episode"
    max_turns: int = 6                  # policy turns per user turn (the counter restarts at each
                                        # user turn; one-user-turn tasks: per episode). The eval
                                        # CLI's --max-steps is an alias of it.
    max_episode_tokens: int = 2048      # prompt included: an episode never exceeds it
    parallel_tool_calls: bool = True    # True: a turn ends at its end-of-turn marker and may hold
                                        # several calls; False: it stops at the first </tool_call>
    on_malformed: Literal[MALFORMED_OUTCOMES] = "error_response"  # the one vocabulary, train and eval
    max_batch_size: int = 64            # hf: episodes decoded together (vllm takes all at once)
    max_chunk: int = 64                 # hf: most forced tokens fed to one row in one step
    backend: Literal[BACKENDS] = "hf"   # hf (transformers KV-cache decoding, the engine's sampler) |
                                        # vllm (one vLLM instance per process; docs/rollout.md)
    vllm: VLLMOptions = field(default_factory=VLLMOptions)   # backend=vllm only

    def validate(self) -> None:
        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RolloutConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        choice("mode", MODES)
        choice("on_malformed", MALFORMED_OUTCOMES)
        choice("on_max_new_tokens", CUT_OUTCOMES)
        choice("backend", BACKENDS)
        if not 0.0 <= self.hybrid_p <= 1.0:
            raise ValueError(f"RolloutConfig.hybrid_p must be in [0, 1], got {self.hybrid_p}")
        if self.temperature < 0:
            raise ValueError(f"RolloutConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"RolloutConfig.top_p must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "max_turns", "max_episode_tokens", "max_batch_size", "max_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        self.vllm.validate()


@dataclass
class Prompt:
    """A row to generate from: a token prefix ending where the policy speaks (after a generation
    prompt). `env` None means private rehearsal: every call is rehearsed, nothing is executed."""
    input_ids: list[int]
    roles: list[int]
    tools: list[dict]
    messages: list[dict] = field(default_factory=list)  # the prefix as chat messages (what a policy
                                                        # and a separate simulator are shown)
    task: Task | None = None
    env: ToolEnv | None = None
    seed: int = 0
