"""Token sources: who writes the agent's turns in an engine episode.

The engine (`RolloutEngine.rollout(..., policy=...)` / `generate(prompts, policy=...)`) asks its
policy once per agent turn, for every row that reaches a turn, in one batched call:

    turns = policy.begin_turns([TurnRequest, ...])      # one Turn | None per request

  None                     the model samples the turn (temperature / top_p of the RolloutConfig:
                           0 = greedy); its tokens are ACT with their rollout log-probs.
  Turn(text=...)           the turn is forced: `text` (content + `<tool_call>` blocks, as
                           `template.assistant_text` writes a message) is encoded and appended as
                           ACT tokens with the end-of-turn marker; log-probs NaN (not sampled).
  Turn(context=...)        CONTEXT text placed at the start of the turn, before what the model (or
                           `text`) writes: e.g. a test-time rehearsal memory. It is never parsed
                           for tool calls and is recorded on the assistant message as "context".

Everything after the turn (parsing calls, executing / rehearsing them, user turns, the end of the
episode) is the engine's, identical for every policy. Policies never see the environment: a
policy that rehearses privately runs its own `engine.generate(...)` on prompts without an env.

Built in: `ModelPolicy` (always None: model sampling), `GoldPolicy` (the task's gold assistant
messages, in order), `ScriptedPolicy` (a fixed list of turn texts, or a function of the request).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from fastrehearse.envs.base import Task
from fastrehearse.rollout.text.gold import gold_replies
from fastrehearse.rollout.text.template import assistant_text


@dataclass
class TurnRequest:
    """What a policy sees when an agent turn starts."""
    row: int                      # index of the prompt in this generate() call
    task: Task | None
    messages: list[dict]          # the conversation so far (initial messages + trajectory)
    tools: list[dict]             # the tools visible now
    input_ids: list[int]          # the episode's tokens so far (they end with the turn opening)
    roles: list[int]
    turn: int                     # agent turns already taken in this episode
    seed: int                     # the row's seed (a policy that samples should derive from it)


@dataclass
class Turn:
    text: str | None = None       # forced turn text; None: the model samples the turn
    context: str | None = None    # CONTEXT text placed before the turn (e.g. a rehearsal memory)
    info: dict = field(default_factory=dict)  # recorded in the episode's metadata["policy"] list


class Policy(Protocol):
    def begin_turns(self, requests: list[TurnRequest]) -> list[Turn | None]: ...


class ModelPolicy:
    """The model samples every turn (greedy when the engine's temperature is 0)."""

    def begin_turns(self, requests: list[TurnRequest]) -> list[Turn | None]:
        return [None] * len(requests)


class GoldPolicy:
    """Replays `task.gold`: agent turn k is the k-th gold assistant message (`gold_replies`; tool
    responses and user turns come from the environment, never from the record). After the last
    one the turn is an empty reply. A task without gold raises ValueError naming it."""

    def begin_turns(self, requests: list[TurnRequest]) -> list[Turn | None]:
        out = []
        for r in requests:
            try:
                gold = gold_replies(r.task)
            except ValueError as e:
                raise ValueError(f"GoldPolicy: {e}") from None
            out.append(Turn(text=assistant_text(gold[r.turn]) if r.turn < len(gold) else ""))
        return out


class ScriptedPolicy:
    """Forced turns from a script: a list of turn texts (the same for every row; past its end the
    model samples), or a function TurnRequest -> Turn | str | None."""

    def __init__(self, script: Sequence[str] | Callable[[TurnRequest], Turn | str | None]):
        self.script = script

    def begin_turns(self, requests: list[TurnRequest]) -> list[Turn | None]:
        out = []
        for r in requests:
            if callable(self.script):
                t = self.script(r)
            else:
                t = self.script[r.turn] if r.turn < len(self.script) else None
            out.append(Turn(text=t) if isinstance(t, str) else t)
        return out
