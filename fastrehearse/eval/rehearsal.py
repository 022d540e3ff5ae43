"""Test-time rehearsal: think with the world model before committing a real call.

Before each committed turn the agent runs up to N *private* rehearsals of its next step(s): it
drafts a turn as the policy, then plays the environment itself and writes the response each drafted
call would produce (the same world model training shaped), optionally for `horizon` steps. The
rehearsals are condensed into a short note placed in context (a system turn just before the
committed turn), and the agent then commits one real turn, which the harness executes.

  parallel:   N independent sampled drafts (temperature > 0), one batch of B*N generations.
  sequential: draft k sees drafts 1..k-1 (their calls and predicted responses) and revises.

Private rehearsals never reach the environment: this class holds no environment at all (the tests
count `env.execute` calls to prove it). The note is rebuilt every turn and not kept in the
trajectory, so context grows only by the committed turns.

Cost: rehearsal tokens (drafts + predicted responses) are counted apart from committed tokens, so
the report can set accuracy against token cost per budget N.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from fastrehearse.envs.base import ToolCall
from fastrehearse.eval.harness import EpisodeState, call_from_message
from fastrehearse.eval.policies import ModelPolicy, episode_key, parse_turn

MODES = ("parallel", "sequential")
NOTE_HEAD = ("Private rehearsal (simulated by you, nothing was executed). Use it to choose your next "
             "real step; the real tools may answer differently.")


@dataclass
class Draft:
    steps: list[tuple[dict, list[str]]]   # (drafted assistant message, predicted responses per call)


class RehearsalPolicy:
    def __init__(self, base: ModelPolicy, budget: int, mode: str = "parallel", horizon: int = 1,
                 note_chars: int = 240):
        if budget < 0:
            raise ValueError(f"rehearsal budget must be >= 0, got {budget}")
        if mode not in MODES:
            raise ValueError(f"rehearsal mode must be one of {MODES}, got {mode!r}")
        if horizon < 1:
            raise ValueError(f"rehearsal horizon must be >= 1, got {horizon}")
        self.base = base
        self.budget = budget
        self.mode = mode
        self.horizon = horizon
        self.note_chars = note_chars
        self.name = f"{base.name}+rehearse{budget}{mode[0]}"

    # the harness measures fidelity through the same world model
    def predict_responses(self, states, calls):
        return self.base.predict_responses(states, calls)

    def act(self, states: list[EpisodeState]) -> list[dict]:
        if self.budget == 0 or not states:
            return self.base.act(states)
        drafts: list[list[Draft]] = [[] for _ in states]
        if self.mode == "parallel":
            slots = [(k, None) for k in range(len(states)) for _ in range(self.budget)]
            for (k, _), d in zip(slots, self._rehearse(states, [k for k, _ in slots], [None] * len(slots))):
                drafts[k].append(d)
        else:
            for r in range(self.budget):
                notes = [self._note(drafts[k], revise=True) if drafts[k] else None
                         for k in range(len(states))]
                for k, d in enumerate(self._rehearse(states, list(range(len(states))), notes)):
                    drafts[k].append(d)
        notes = [self._note(ds, revise=False) for ds in drafts]
        for st, note in zip(states, notes):
            st.scratch["rehearsal_note"] = note       # kept for inspection / logging only
        return self.base.act(states, notes=notes)

    def _rehearse(self, states: list[EpisodeState], which: list[int], notes: list[str | None]) -> list[Draft]:
        """One private rollout of `horizon` steps per entry of `which` (an index into states), batched."""
        base = self.base
        ctx = []
        for k, note in zip(which, notes):
            msgs = list(states[k].messages)
            if note:
                msgs.append({"role": "system", "content": note})
            ctx.append(msgs)
        drafts = [Draft(steps=[]) for _ in which]
        live = list(range(len(which)))
        for _ in range(self.horizon):
            if not live:
                break
            prompts = [base.prompt_ids(states[which[i]].tools, ctx[i]) for i in live]
            outs = base.generate(prompts, base.gen.max_new_tokens, base.gen.rehearsal_temperature,
                                 keys=[episode_key(states[which[i]]) for i in live])
            calls: list[list[ToolCall]] = []
            msgs = []
            for i, p, (n, text) in zip(live, prompts, outs):
                st = states[which[i]]
                st.prompt_tokens += len(p)
                st.rehearsal_tokens += n
                msg = parse_turn(text)
                good = [tc for tc in msg.get("tool_calls") or [] if "malformed" not in tc]
                msgs.append(msg)
                calls.append([call_from_message(tc) for tc in good])
            with_calls = [j for j, c in enumerate(calls) if c]
            preds, ptoks, gtoks = base.rehearse_calls(
                [states[which[live[j]]].tools for j in with_calls],
                [ctx[live[j]] + [_strip(msgs[j])] for j in with_calls],
                [calls[j] for j in with_calls],
                keys=[episode_key(states[which[live[j]]]) for j in with_calls])
            pred_of = {j: p for j, p in zip(with_calls, preds)}
            for j, p, g in zip(with_calls, ptoks, gtoks):
                st = states[which[live[j]]]
                st.prompt_tokens += p
                st.rehearsal_tokens += g
            nxt = []
            for j, i in enumerate(live):
                pr = pred_of.get(j, [])
                drafts[i].steps.append((msgs[j], pr))
                if pr:   # continue this private rollout from the predicted world
                    ctx[i] = ctx[i] + [_strip(msgs[j])] + [
                        {"role": "tool", "name": c.name, "content": r} for c, r in zip(calls[j], pr)]
                    nxt.append(i)
            live = nxt
        return drafts

    def _note(self, drafts: list[Draft], revise: bool) -> str:
        lines = [NOTE_HEAD]
        for d_i, d in enumerate(drafts, 1):
            parts = []
            for msg, preds in d.steps:
                good = [tc for tc in msg.get("tool_calls") or [] if "malformed" not in tc]
                bad = len(msg.get("tool_calls") or []) - len(good)
                for tc, pr in zip(good, preds):
                    parts.append(f"{_call_str(tc)} -> predicted: {_clip(pr, self.note_chars)}")
                if bad:
                    parts.append(f"{bad} malformed tool call(s)")
                if not good and not bad:
                    parts.append(f"final answer: {_clip(msg.get('content') or '', self.note_chars)}")
            lines.append(f"Rehearsal {d_i}: " + " ; then ".join(parts or ["(empty)"]))
        if revise:
            lines.append("Draft the next step again, fixing any problem these predictions reveal.")
        return "\n".join(lines)


def _strip(msg: dict) -> dict:
    out = dict(msg)
    if "tool_calls" in out:
        out["tool_calls"] = [tc for tc in out["tool_calls"] if "malformed" not in tc]
        if not out["tool_calls"]:
            out.pop("tool_calls")
    return out


def _call_str(tc: dict) -> str:
    fn = tc["function"]
    return f"{fn['name']}({json.dumps(fn.get('arguments') or {}, sort_keys=True)})"


def _clip(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."
