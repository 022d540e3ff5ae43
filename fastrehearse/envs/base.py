"""The environment protocol: everything an episode driver may ask of an environment, in one place.

One `ToolEnv` instance is one episode's world. `reset(task)` starts it, `execute(call)` runs real
tool calls against it, `score(task, trajectory)` grades task success in [0, 1]. Rollouts create one
instance per episode (`suite.make_env()`), so episodes never share state. The episode driver is
`fastrehearse.rollout.RolloutEngine` (training, evaluation and test-time rehearsal alike); it reads
only the members declared below, never anything else (no `getattr` probing).

Required: `reset`, `execute`, `score`.
Optional, with the defaults of this class (override what the environment needs):

  tools               the tool schemas visible *now*, or None (the default) for "the ones `reset`
                      returned, unchanged". Read by the driver after every user turn: an env whose
                      tools change mid-task (BFCL miss_func adds held-out functions) keeps it current.
  next_user_message(reply)
                      the next user turn after the agent ended its turn with `reply` (an assistant
                      message without tool calls): a user message dict, or None when the task is
                      over. Default None (single user turn: builtin, tau2 solo). Scripted turns
                      (BFCL multi-turn) ignore `reply`; a user simulator (tau2 conversational) answers
                      it. May raise when the simulator is unreachable: the driver records an error.
  finished            True once the agent has ended the task itself (tau2's `done` stop tool); the
                      driver ends the episode after the turn in which it turned True. Default False.
  control_tools       names of tools that control the episode rather than query the world (tau2's
                      `done`): always executed for real, never rehearsed. Default empty.
  validates_calls     True when `execute` judges calls itself (tool name and arguments): the driver
                      then checks only the syntax of a call and leaves the rest to the environment
                      (BFCL: its executor runs any function of the involved classes -- its ground
                      truth calls a miss_func function before the turn that reveals it -- and does
                      not enforce declared types, which its ground truth also relies on). Default
                      False: the driver also checks the name against the visible tools and the
                      arguments against the tool's JSON schema (a failing call is malformed).
  grades_calls_only   True for single-turn tasks graded on the calls themselves (BFCL AST
                      categories): the episode is exactly one policy turn, nothing is executed, and
                      `score` reads the turn (its "raw_text" holds what the model wrote).
  drift_stats()       per-episode counters of a response-perturbing wrapper (eval/drift.py's
                      DriftEnv); {} by default. The driver copies a non-empty dict into the
                      episode's metadata["drift"].
  close()             free per-episode resources (BFCL caches instances in module globals).

A wrapper (DriftEnv) must forward every member it does not change to the wrapped env explicitly:
the defaults here would otherwise shadow the inner env's behaviour.

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
    gold: list[dict] | None = None  # gold trajectory as assistant/tool(/user) messages, when known


@dataclass
class ResetResult:
    tools: list[dict]               # OpenAI function schemas
    messages: list[dict]            # initial messages (system + user)


@dataclass
class Trajectory:
    """What the agent did: every message after the initial ones (later user turns included), plus
    the calls made for real."""
    messages: list[dict] = field(default_factory=list)
    real_calls: list[ToolCall] = field(default_factory=list)
    final_answer: str | None = None


class ToolEnv(ABC):
    """One episode's world (the protocol is described in the module docstring)."""

    tools: list[dict] | None = None
    finished: bool = False
    control_tools: frozenset[str] = frozenset()
    validates_calls: bool = False
    grades_calls_only: bool = False

    @abstractmethod
    def reset(self, task: Task) -> ResetResult: ...

    @abstractmethod
    def execute(self, call: ToolCall) -> ToolResult:
        """Run one real call. Must never raise for bad model input: return ok=False instead."""

    @abstractmethod
    def score(self, task: Task, trajectory: Trajectory) -> float:
        """Task success in [0, 1]."""

    def next_user_message(self, reply: dict | None = None) -> dict | None:
        """The user's next turn after the agent's text reply, or None: the task is over."""
        return None

    def drift_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Free per-episode resources."""


class WrappedEnv(ToolEnv):
    """A `ToolEnv` around another (`self.inner`): every part of the protocol is forwarded to it --
    ToolEnv's class-level defaults would otherwise shadow the inner env's values -- and a wrapper
    overrides only what it changes (eval/drift.py's DriftEnv, envs/scramble.py's ScrambleEnv)."""

    def __init__(self, inner: ToolEnv):
        self.inner = inner

    @property
    def tools(self) -> list[dict] | None:
        return self.inner.tools

    @property
    def finished(self) -> bool:
        return self.inner.finished

    @property
    def control_tools(self) -> frozenset[str]:
        return self.inner.control_tools

    @property
    def validates_calls(self) -> bool:
        return self.inner.validates_calls

    @property
    def grades_calls_only(self) -> bool:
        return self.inner.grades_calls_only

    def reset(self, task: Task) -> ResetResult:
        return self.inner.reset(task)

    def execute(self, call: ToolCall) -> ToolResult:
        return self.inner.execute(call)

    def score(self, task: Task, trajectory: Trajectory) -> float:
        return self.inner.score(task, trajectory)

    def next_user_message(self, reply: dict | None = None) -> dict | None:
        return self.inner.next_user_message(reply)

    def drift_stats(self) -> dict[str, int]:
        return self.inner.drift_stats()

    def close(self) -> None:
        self.inner.close()


class Suite(ABC):
    """A set of tasks plus a factory for per-episode environments.

    Training reward modes (fastrehearse.algo.rewards; docs/training.md "Rewards"): "real" is always
    `env.score`; a suite that can also grade a trajectory another way lists the mode in
    `reward_modes` and implements `task_reward` (e.g. "consistent": inside the episode's own,
    possibly rehearsed, world). `response_spec(tool)` describes a tool's successful response
    ({"keys": [...], "echo": {output key: argument}}) for the world-model reward's format term;
    None when the suite does not say. `check_reward` and `costly_calls` are optional checks the
    trainer asks before it starts (defaults: nothing to refuse, calls are cheap)."""
    name: str
    reward_modes: tuple[str, ...] = ("real",)

    @abstractmethod
    def tasks(self, split: str, limit: int | None = None) -> list[Task]: ...

    @abstractmethod
    def make_env(self) -> ToolEnv: ...

    def task_reward(self, task: Task, trajectory: Trajectory, mode: str) -> float:
        """Task success of `trajectory` under reward `mode` (one of `reward_modes` but "real")."""
        raise ValueError(f"suite {self.name!r} has no reward mode {mode!r}; it has {list(self.reward_modes)}")

    def response_spec(self, tool: str) -> dict | None:
        return None

    def check_reward(self, mode: str, tasks: list[Task]) -> None:
        """Refuse (ValueError, one line) a task reward some of `tasks` cannot be graded by (an MCP
        task without `check.source` under "consistent"); called before training starts."""

    @classmethod
    def costly_calls(cls, options: dict) -> bool:
        """True when executing a call for real may cost money or have side effects (an MCP server
        not declared free of them): the trainer then measures no fidelity (which executes every
        rehearsed call) unless the config asks for it. Decided from the options, before building."""
        return False
