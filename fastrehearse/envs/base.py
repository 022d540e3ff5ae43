"""The environment interface shared by the builtin suite, BFCL v4 multi-turn and tau2-bench.

One `ToolEnv` instance is one episode's world: `reset(task)` starts it, `execute(call)` runs real
tool calls against it, `score(task, trajectory)` grades task success in [0, 1]. Rollouts create one
instance per episode (`suite.make_env()`), so episodes never share state.

Messages use the OpenAI chat shape that `tokenizer.apply_chat_template` accepts:
  {"role": "system"|"user"|"assistant"|"tool", "content": str,
   "tool_calls": [{"type": "function", "function": {"name": str, "arguments": dict}}]}  # assistant
Tool schemas use the OpenAI function shape: {"type": "function", "function": {"name", "description",
"parameters": <JSON schema>}}.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str = ""            # the text the model emitted for this call (for logging)


@dataclass
class ToolResult:
    content: str             # what goes into the tool-response turn
    ok: bool = True          # False when the call failed (unknown tool, bad args, raised)
    error_kind: str | None = None  # "unknown_tool" | "bad_arguments" | "env_error" | ...


@dataclass
class Task:
    id: str
    split: str                      # "train" | "test" (builtin) or the benchmark's category
    payload: dict[str, Any]         # env-specific (seed, difficulty, BFCL entry, tau2 task, ...)
    gold: list[dict] | None = None  # gold trajectory as assistant/tool messages, when known


@dataclass
class ResetResult:
    tools: list[dict]               # OpenAI function schemas
    messages: list[dict]            # initial messages (system + user)


@dataclass
class Trajectory:
    """What the agent did: every message after the initial ones, plus the calls made for real."""
    messages: list[dict] = field(default_factory=list)
    real_calls: list[ToolCall] = field(default_factory=list)
    final_answer: str | None = None


class ToolEnv(ABC):
    """One episode's world."""

    @abstractmethod
    def reset(self, task: Task) -> ResetResult: ...

    @abstractmethod
    def execute(self, call: ToolCall) -> ToolResult:
        """Run one real call. Must never raise for bad model input: return ok=False instead."""

    @abstractmethod
    def score(self, task: Task, trajectory: Trajectory) -> float:
        """Task success in [0, 1]."""

    def close(self) -> None:
        """Free per-episode resources (BFCL caches instances in module globals, for example)."""


class Suite(ABC):
    """A set of tasks plus a factory for per-episode environments."""
    name: str

    @abstractmethod
    def tasks(self, split: str, limit: int | None = None) -> list[Task]: ...

    @abstractmethod
    def make_env(self) -> ToolEnv: ...
