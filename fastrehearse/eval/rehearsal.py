"""Test-time rehearsal: think with the world model before committing a real call.

Before each committed turn the agent runs up to N *private* rehearsals of its next step(s): it
drafts a turn as the policy, then plays the environment itself and writes the response each drafted
call would produce (the same world model training shaped), optionally for `horizon` steps. The
rehearsals are condensed into a short note placed in context (a system turn just before the
committed turn), and the agent then commits one real turn, which the harness executes.

  parallel:   N independent sampled drafts (temperature > 0), one batch of B*N generations.
  sequential: draft k sees drafts 1..k-1 (their calls and predicted responses) and revises.

What is committed (`commit`):
  note:   the rehearsals are condensed into a note in context and the agent decodes its committed turn
          after reading it (the paper's form; a model never trained with notes may copy the note).
  select: no note. The agent decodes its usual greedy turn, rehearses that turn's calls too, and
          commits whichever candidate (greedy first, then the drafts) the world model judges best:
          a malformed call or an unknown tool name is a sure failure (score -2), a call whose
          predicted response is an error is a likely one (-1), anything else 0. Ties go to the
          greedy turn, so `select` changes a turn only when rehearsal foresees a failure of the
          greedy one and a draft without it. Model-predictive, best-of-(N+1) under the world model.

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
COMMITS = ("note", "select")
NOTE_HEAD = ("Private rehearsal (simulated by you, nothing was executed). Use it to choose your next "
             "real step; the real tools may answer differently.")


@dataclass
class Draft:
    steps: list[tuple[dict, list[str]]]   # (drafted assistant message, predicted responses per call)


class RehearsalPolicy:
    def __init__(self, base: ModelPolicy, budget: int, mode: str = "parallel", horizon: int = 1,
                 note_chars: int = 240, commit: str = "note"):
        if budget < 0:
            raise ValueError(f"rehearsal budget must be >= 0, got {budget}")
        if mode not in MODES:
            raise ValueError(f"rehearsal mode must be one of {MODES}, got {mode!r}")
        if commit not in COMMITS:
            raise ValueError(f"rehearsal commit must be one of {COMMITS}, got {commit!r}")
        if horizon < 1:
            raise ValueError(f"rehearsal horizon must be >= 1, got {horizon}")
        self.base = base
        self.budget = budget
        self.mode = mode
        self.horizon = horizon
        self.note_chars = note_chars
        self.commit = commit
        self.name = f"{base.name}+rehearse{budget}{mode[0]}" + ("-select" if commit == "select" else "")
        self.selected_drafts = 0      # select: committed turns taken from a draft instead of greedy

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
        if self.commit == "select":
            return self._select(states, drafts)
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
                good = _good_calls(msg)
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

    def _select(self, states: list[EpisodeState], drafts: list[list[Draft]]) -> list[dict]:
        """Commit the best of {greedy turn, first step of each draft} as judged by the world model."""
        greedy = self.base.act(states)             # what N = 0 would commit (committed tokens)
        calls = [[call_from_message(tc) for tc in _good_calls(m)] for m in greedy]
        with_calls = [k for k, c in enumerate(calls) if c]
        preds, ptoks, gtoks = self.base.rehearse_calls(
            [states[k].tools for k in with_calls],
            [list(states[k].messages) + [_strip(greedy[k])] for k in with_calls],
            [calls[k] for k in with_calls], keys=[episode_key(states[k]) for k in with_calls])
        greedy_preds = {k: p for k, p in zip(with_calls, preds)}
        for k, p, g in zip(with_calls, ptoks, gtoks):
            states[k].prompt_tokens += p
            states[k].rehearsal_tokens += g
        out = []
        for k, st in enumerate(states):
            names = _tool_names(st.tools)
            best, best_score = greedy[k], judge(greedy[k], greedy_preds.get(k, []), names)
            for d in drafts[k]:
                msg, pr = d.steps[0]
                sc = judge(msg, pr, names)
                if sc > best_score:
                    best, best_score = msg, sc
            if best is not greedy[k]:
                self.selected_drafts += 1
            st.scratch["rehearsal_select"] = {"score": best_score, "from_draft": best is not greedy[k]}
            out.append(best)
        return out

    def _note(self, drafts: list[Draft], revise: bool) -> str:
        lines = [NOTE_HEAD]
        for d_i, d in enumerate(drafts, 1):
            parts = []
            for msg, preds in d.steps:
                good = _good_calls(msg)
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


def looks_like_error(response: str) -> bool:
    """A (predicted) tool response that reports failure: text starting with "Error" (BFCL, tau2) or
    a JSON object with an error key at the top (builtin: {"error": ...})."""
    s = response.strip()
    if s[:5].lower() == "error":
        return True
    try:
        obj = json.loads(s)
    except (json.JSONDecodeError, ValueError):
        return False
    return isinstance(obj, dict) and any("error" in str(k).lower() for k in obj)


def judge(msg: dict, predicted: list[str], tool_names: set[str] | None) -> int:
    """World-model judgement of one candidate turn: -2 a sure failure (malformed call, or a call to a
    tool that does not exist), -1 a predicted error response, 0 otherwise (including a final answer:
    rehearsal cannot tell a right answer from a wrong one, so it does not prefer calling)."""
    tcs = msg.get("tool_calls") or []
    if any("malformed" in tc for tc in tcs):
        return -2
    if tool_names and any(tc["function"]["name"] not in tool_names for tc in tcs):
        return -2
    if any(looks_like_error(p) for p in predicted):
        return -1
    return 0


def _tool_names(tools: list[dict]) -> set[str]:
    """Names of the episode's tools (OpenAI {"type": "function", "function": {...}} or bare schemas)."""
    out = set()
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(f, dict) and f.get("name"):
            out.add(str(f["name"]))
    return out


def _good_calls(msg: dict) -> list[dict]:
    return [tc for tc in msg.get("tool_calls") or [] if "malformed" not in tc]


def _strip(msg: dict) -> dict:
    out = dict(msg)
    if "tool_calls" in out:
        out["tool_calls"] = _good_calls(out)
        if not out["tool_calls"]:
            out.pop("tool_calls")
    return out


def _call_str(tc: dict) -> str:
    fn = tc["function"]
    return f"{fn['name']}({json.dumps(fn.get('arguments') or {}, sort_keys=True)})"


def _clip(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."
