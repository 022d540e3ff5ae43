"""One episode's state machine: what comes after each model-written segment.

Phases: "act" (a policy turn), "tool" (the model rehearses a tool response), "done". The row appends
known tokens itself (`force`: scaffolding, real responses, user turns, forced turns) and asks for a
segment when the model must write (`segment_request`); the decode loop (decode.py) runs the
requests on a backend and hands each finished segment back (`on_segment`):

  policy turn (ACT)  --turn ends, calls parsed-->  force "close assistant + open tool turn"
     per call:  rehearse  -> the same model writes the response (REHEARSE) until the tool-turn end
                real      -> env.execute(call); its text is forced (OBSERVED)
                malformed -> an error message is forced (CONTEXT: the engine wrote it, no
                             environment did), or the episode ends
     force "close tool + reopen assistant"  -->  next policy turn
  a text reply (no calls) -> env.next_user_message(reply):
     a user message -> rendered with the chat template and forced (CONTEXT) -> next policy turn
     None           -> the episode ends
  env.finished after a tool turn (tau2's stop tool) / max_turns policy turns within one user turn /
  token limits -> the episode ends.

A row is given its settings and callbacks (`RowSettings`), never the engine.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fastrehearse.envs.base import Trajectory
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.backends.segments import Segment, SegmentRequest
from fastrehearse.rollout.config import Prompt, RolloutConfig
from fastrehearse.rollout.engine.calls import execute_call, route_calls
from fastrehearse.rollout.engine.fidelity import FidelityScore, score_pair
from fastrehearse.rollout.engine.policy import Turn, TurnRequest
from fastrehearse.rollout.text.template import TOOL_CALL_CLOSE, ChatTemplate
from fastrehearse.rollout.text.toolcall import (
    ParsedCall,
    malformed_response,
    parse_tool_calls,
)


@dataclass
class RowSettings:
    config: "RolloutConfig"
    template: ChatTemplate
    stop_ids: frozenset[int]                 # end-of-sequence token ids: every segment stops there
    has_policy: bool                         # a policy says who writes each turn (else the model)
    count_env_error: Callable[[str], None]   # an env reported an error result of this kind
    simulated: bool = False                  # a separate simulator writes rehearsed responses
                                             # (simulator.py), not the row itself


class Row:
    def __init__(self, settings: RowSettings, index: int, prompt: "Prompt"):
        self.s, self.cfg, self.tmpl = settings, settings.config, settings.template
        self.index, self.p = index, prompt
        self.env = prompt.env
        self.ids = list(prompt.input_ids)
        self.roles = [int(r) for r in prompt.roles]
        self.logps = [math.nan] * len(self.ids)
        self.tools = list(prompt.tools)
        self.phase = "act"
        self.seg_start = len(self.ids)
        self.turns = 0                                # policy turns in the episode
        self.turn_steps = 0                           # policy turns since the last user turn
        self.user_turns = 0                           # user turns added after the prompt
        self.awaiting_turn = False                    # the policy must say who writes this turn
        self.cut_turns = 0                            # turns closed at max_new_tokens
        self.turn_context: str | None = None          # CONTEXT the policy put before this turn
        self.stop_reason = ""
        self.error: str | None = None                 # the episode could not run to its end
        self.queue: list[tuple[ParsedCall, str]] = []
        self.traj = Trajectory()
        self.malformed: Counter = Counter()
        self.call_log: list[dict] = []
        self.policy_log: list[dict] = []
        self.tools_changed: list[int] = []            # user turns at which the tools changed
        self.fidelity: list[FidelityScore] = []
        self.rng = random.Random(prompt.seed * 1_000_003 + 17)
        self.waiting_sim: ParsedCall | None = None    # a rehearsed call the simulator answers
        if len(self.ids) >= self.cfg.max_episode_tokens:
            self._finish("max_episode_tokens")
        else:
            self._begin_act()

    # -- state -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def sample_role(self) -> Role:
        return Role.REHEARSE if self.phase == "tool" else Role.ACT

    @property
    def needs_segment(self) -> bool:
        """The model writes next (after the policy answered and any simulator ran)."""
        return not self.done and not self.awaiting_turn and self.waiting_sim is None

    def _room(self) -> int:
        return self.cfg.max_episode_tokens - len(self.ids)

    def force(self, tokens: Sequence[int], role: Role = Role.CONTEXT) -> bool:
        """Append known tokens; False (and the episode ends) when they do not fit."""
        tokens = list(tokens)
        fit = tokens[:max(0, self._room())]
        self.ids += fit
        self.roles += [int(role)] * len(fit)
        self.logps += [math.nan] * len(fit)
        if len(fit) < len(tokens):
            self._finish("max_episode_tokens")
            return False
        return True

    def _finish(self, reason: str) -> None:
        if self.phase == "tool" and self.queue:  # a rehearsal cut short by a limit is still a call
            pc, _ = self.queue.pop(0)
            self.call_log.append({"name": pc.call.name, "mode": "rehearse", "error_kind": None,
                                  "truncated": True})
        self.phase = "done"
        self.awaiting_turn = False
        self.stop_reason = self.stop_reason or reason

    def _segment_text(self) -> str:
        return self.tmpl.tokenizer.decode(self.ids[self.seg_start:])

    def _new_segment(self, phase: str) -> None:
        self.phase = phase
        self.seg_start = len(self.ids)

    # -- the model's segments ----------------------------------------------------------------
    def stop_strings(self) -> tuple[str, ...]:
        if self.phase == "act":
            markers = list(self.tmpl.assistant_end_markers)
            if not self.cfg.parallel_tool_calls:
                markers.append(TOOL_CALL_CLOSE)
            return tuple(markers)
        return tuple(self.tmpl.tool_end_markers)

    def segment_request(self) -> SegmentRequest | None:
        """What the model writes next; None (and the episode ends) when no token fits."""
        if self._room() <= 0:
            self._finish("max_episode_tokens")
            return None
        left = self.cfg.max_new_tokens - (len(self.ids) - self.seg_start)
        return SegmentRequest(key=self.index, tokens=self.ids, roles=self.roles, role=self.sample_role,
                              max_tokens=max(1, min(left, self._room())), stop_strings=self.stop_strings(),
                              stop_ids=self.s.stop_ids, seed=self.p.seed)

    def on_segment(self, seg: Segment) -> None:
        """The model wrote `seg` (ending at its stop, or at max_tokens): append it, then what follows."""
        if not seg.tokens or len(seg.tokens) != len(seg.logprobs):
            raise ValueError(f"row {self.index}: a segment needs >= 1 token and one log-prob per token")
        n = min(len(seg.tokens), max(0, self._room()))
        self.ids += seg.tokens[:n]
        self.roles += [int(self.sample_role)] * n
        self.logps += [float(x) for x in seg.logprobs[:n]]
        marker = seg.stop if n == len(seg.tokens) else None
        seg_len = len(self.ids) - self.seg_start
        cut = marker is None and seg_len >= self.cfg.max_new_tokens
        if cut and self.cfg.on_max_new_tokens == "end_episode":
            self._finish("max_new_tokens")
        elif self.phase == "act" and (marker is not None or cut):
            self.cut_turns += int(cut)
            self._end_policy_turn(marker)
        elif self.phase == "tool" and (marker is not None or cut):
            self.cut_turns += int(cut)
            self._end_rehearsed_response(marker)
        if not self.done and self._room() <= 0:
            self._finish("max_episode_tokens")

    # -- policy turns ------------------------------------------------------------------------
    def _begin_act(self) -> None:
        """A policy turn starts (the sequence ends with the assistant-turn opening)."""
        self._new_segment("act")
        self.turn_context = None
        self.awaiting_turn = self.s.has_policy

    def request(self) -> TurnRequest:
        return TurnRequest(row=self.index, task=self.p.task, messages=self.p.messages + self.traj.messages,
                           tools=list(self.tools), input_ids=list(self.ids), roles=list(self.roles),
                           turn=self.turns, seed=self.p.seed)

    def apply_turn(self, turn: Turn | None) -> None:
        """The policy's answer for this turn: None = the model samples it; else forced parts."""
        self.awaiting_turn = False
        if turn is None:
            return
        if not isinstance(turn, Turn):
            raise TypeError(f"policy returned {type(turn).__name__}; expected Turn or None")
        if turn.info:
            self.policy_log.append({"turn": self.turns, **turn.info})
        if turn.context:
            self.turn_context = turn.context
            if not self.force(self.tmpl.encode(turn.context), Role.CONTEXT):
                return
            self.seg_start = len(self.ids)   # the context is never parsed for calls
        if turn.text is not None:
            marker = self.tmpl.assistant_end_markers[0]
            if self.force(self.tmpl.encode(turn.text + marker), Role.ACT):
                self._end_policy_turn(marker)

    # -- turn transitions --------------------------------------------------------------------
    def _end_policy_turn(self, marker: str | None) -> None:
        """The agent's turn ended at `marker` (None: cut by max_new_tokens, closed as written)."""
        text = self._segment_text()
        cut = text.rfind(marker) if marker else -1
        turn = text[:cut] if cut >= 0 and marker != TOOL_CALL_CLOSE else text
        env = self.env
        graded_only = env is not None and env.grades_calls_only
        # Graded-call tasks (judged on the raw text by the benchmark's checker) and envs that judge
        # calls themselves: syntax only. Otherwise the name and the arguments' schema too.
        syntax_only = env is not None and (graded_only or env.validates_calls)
        parsed = parse_tool_calls(turn, None if syntax_only else self.tools)
        self.turns += 1
        self.turn_steps += 1
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.has_calls else turn,
                               "raw_text": turn}
        if self.turn_context is not None:
            msg["context"] = self.turn_context
        if marker is None:
            msg["cut"] = "max_new_tokens"
        ok_calls = [c for c in parsed.calls if c.ok]
        if ok_calls:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c.call.name,
                                                                  "arguments": c.call.arguments}}
                                 for c in ok_calls]
        self.traj.messages.append(msg)
        if graded_only:
            self.traj.final_answer = turn.strip()
            self._finish("graded")
            return
        if not parsed.has_calls:
            self.traj.final_answer = turn.strip()
            self._after_reply(msg, marker)
            return
        self.queue = []
        for c, mode in route_calls(parsed.calls, env, self.cfg.mode, self.cfg.hybrid_p, self.rng):
            if mode == "error":
                self.malformed[c.error_kind] += 1
                if self.cfg.on_malformed == "end_episode":
                    self.call_log.append({"name": None, "mode": "malformed", "error_kind": c.error_kind})
                    self._finish("malformed")
                    return
            self.queue.append((c, mode))
        end_marker = marker if marker != TOOL_CALL_CLOSE else None
        if self.force(self.tmpl.remainder("assistant_to_tool", end_marker)):
            self._next_call()

    def _after_reply(self, msg: dict, marker: str | None) -> None:
        """A text reply ended the agent's turn: the environment's next user turn, or the end."""
        env = self.env
        if env is None or env.finished:
            self._finish("final_answer")
            return
        try:
            user = env.next_user_message(msg)
        except Exception as e:  # an unreachable user simulator: the episode could not run
            self.error = f"next_user_message: {type(e).__name__}: {e}"
            self._finish("env_error")
            return
        if user is None:
            self._finish("final_answer")
            return
        if not isinstance(user, dict) or user.get("role") not in ("user", "system") \
                or not isinstance(user.get("content"), str):
            self.error = f"next_user_message returned {user!r}; expected a user message dict"
            self._finish("env_error")
            return
        self.traj.messages.append(user)
        self.user_turns += 1
        self.turn_steps = 0
        tools = env.tools
        if tools is not None and list(tools) != self.tools:
            self.tools = list(tools)
            self.tools_changed.append(self.user_turns)
        end_marker = marker if marker != TOOL_CALL_CLOSE else None
        if self.force(self.tmpl.continuation([user], self.tools, end_marker)):
            self._begin_act()

    def _next_call(self) -> None:
        """Handle queued calls until one needs the model (or the tool turn closes)."""
        while self.queue and not self.done:
            pc, mode = self.queue[0]
            if mode == "rehearse":
                if self.s.simulated:
                    self.waiting_sim = pc  # the decode loop runs the simulator
                else:
                    self._new_segment("tool")
                return
            self.queue.pop(0)
            if mode == "error":
                content = malformed_response(pc)
                self.call_log.append({"name": None, "mode": "error", "error_kind": pc.error_kind})
            else:
                content = self._execute(pc)
                self.call_log.append({"name": pc.call.name, "mode": "real", "error_kind": None})
            self.traj.messages.append({"role": "tool", "content": content, "rehearsed": False})
            # OBSERVED is a real environment's response: the world model's supervised target
            # (w_observed). The malformed-call error is the engine's text, so it is CONTEXT: as
            # OBSERVED, a CE on it would train the model on the errors of its own broken turns
            # (arm H's collapse, docs/learning.md).
            role = Role.CONTEXT if mode == "error" else Role.OBSERVED
            if not self.force(self.tmpl.encode(content), role):
                return
            self._close_tool_response(None)

    def _execute(self, pc: ParsedCall) -> str:
        return execute_call(self.env, pc.call, self.traj, self.malformed, self.s.count_env_error)

    def _end_rehearsed_response(self, marker: str | None) -> None:
        pc, _ = self.queue.pop(0)
        content = self.tmpl.tool_content_from_generated(self._segment_text(), marker)
        self._record_rehearsal(pc, content)
        self._close_tool_response(marker)

    def _record_rehearsal(self, pc: ParsedCall, content: str) -> None:
        entry = {"name": pc.call.name, "mode": "rehearse", "error_kind": None}
        if self.cfg.measure_fidelity and self.env is not None:
            real = self._execute(pc)
            s = score_pair(pc.call.name, content, real)
            label = getattr(self.env, "fidelity_by_label", None)   # the builtin suite labels fields
            if callable(label):
                lab = label(self.traj.messages, pc.call, content, real)
                s.predictable, s.hidden = lab["predictable"], lab["hidden"]
            self.fidelity.append(s)
            entry.update(measured=True, exact=s.exact, field_f1=s.field_f1)
        self.call_log.append(entry)
        self.traj.messages.append({"role": "tool", "content": content, "rehearsed": True})

    def _close_tool_response(self, marker: str | None) -> None:
        if self.queue:
            if self.force(self.tmpl.remainder("tool_to_tool", marker)):
                self._next_call()
            return
        if self.env is not None and self.env.finished:
            self._finish("finished")
            return
        if self.turn_steps >= self.cfg.max_turns:
            self._finish("max_turns")
            return
        if self.force(self.tmpl.remainder("tool_to_assistant", marker)):
            self._begin_act()

    def on_simulated(self, tokens: list[int], logps: list[float], text: str) -> None:
        """A separate simulator's response tokens, copied in as REHEARSE."""
        pc = self.waiting_sim
        self.waiting_sim = None
        self.queue.pop(0)
        room = self._room()
        self.ids += tokens[:room]
        self.roles += [int(Role.REHEARSE)] * len(tokens[:room])
        self.logps += logps[:room]
        if len(tokens) > room:
            self._finish("max_episode_tokens")
            return
        self._record_rehearsal(pc, text.strip())
        self._close_tool_response(None)
