"""The eval loop: many episodes at once against real environments, scored by each benchmark's checker.

A pool of up to `batch_size` live episodes advances one policy turn at a time: the policy acts on
every live episode in one batched call, real tool calls go to each episode's own environment, and
an episode that ends is scored, written to the result store (so a crash loses at most the live
pool) and replaced by the next task. The same loop runs `--policy gold` (ground-truth replay, which
validates the harness and the checkers) and model policies (with or without test-time rehearsal).

Episode end: the assistant answers without a tool call (and the environment has no further user
turn), or `max_steps` policy turns were taken within one user turn (the episode is then cut short,
as BFCL force-terminates an entry at its step limit). Environments that feed user turns one at a time (BFCL
multi-turn) expose `next_user_message() -> dict | None`; the harness asks for it when the policy
ends a turn, so every turn runs in the real environment state left by the previous one.
"""
from __future__ import annotations

import inspect
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from fastrehearse.envs.base import Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.eval.results import ItemResult, ResultStore


@dataclass
class EpisodeState:
    """One live episode: its task, its real environment and everything said so far."""
    task: Task
    category: str
    env: ToolEnv
    tools: list[dict]
    messages: list[dict]                  # full context (initial messages + trajectory)
    traj: Trajectory = field(default_factory=Trajectory)
    steps: int = 0                        # policy turns taken (all user turns)
    turn_steps: int = 0                   # policy turns since the last user turn
    done: bool = False
    gen_tokens: int = 0
    rehearsal_tokens: int = 0
    prompt_tokens: int = 0
    malformed: int = 0
    fidelity: list[dict[str, float]] = field(default_factory=list)
    scratch: dict[str, Any] = field(default_factory=dict)   # per-policy state (gold cursor, notes)
    t0: float = field(default_factory=time.perf_counter)

    def add(self, msg: dict) -> None:
        self.messages.append(msg)
        self.traj.messages.append(msg)


class Policy(Protocol):
    name: str

    def act(self, states: list[EpisodeState]) -> list[dict]:
        """One assistant message per state (OpenAI shape; "tool_calls" when it calls tools).
        A tool call the policy could not parse appears as {"malformed": "<why>"} in "tool_calls"."""
        ...


# Optional policy method: predict_responses(states, calls) -> list[list[str]]: the model's own
# (rehearsed) response to each call, used to measure world-model fidelity against the real one.


@dataclass
class HarnessConfig:
    batch_size: int = 8
    max_steps: int = 12                    # policy turns per user turn (BFCL's per-turn step limit)
    measure_fidelity: bool = False         # rehearse each real call too ("both" mode) and compare
    on_malformed: str = "error_message"    # "error_message" (tool turn says why) | "end_episode"
    keep_transcripts: bool = True          # what the agent said and saw, clipped, in items.jsonl
    deadline: float | None = None          # time.perf_counter() after which no new item starts
                                           # (live ones finish; a rerun resumes the rest)


def call_from_message(tc: dict) -> ToolCall:
    fn = tc["function"]
    return ToolCall(name=fn["name"], arguments=dict(fn.get("arguments") or {}),
                    raw=tc.get("raw", ""))


def run_items(
    items: list[tuple[str, Task]],
    make_env: Callable[[str], ToolEnv],
    policy: Policy,
    store: ResultStore,
    cfg: HarnessConfig,
    max_steps_for: Callable[[str], int] | None = None,
    on_item: Callable[[ItemResult], None] | None = None,
) -> list[ItemResult]:
    """Run every (category, task) not already in `store`; returns the results of this call."""
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.on_malformed not in ("error_message", "end_episode"):
        raise ValueError(f"on_malformed must be 'error_message' or 'end_episode', got {cfg.on_malformed!r}")
    queue = [(c, t) for c, t in items if not store.done(c, t.id)]
    queue.reverse()                          # pop() from the end keeps the given order
    live: list[EpisodeState] = []
    finished: list[ItemResult] = []

    def start_next() -> None:
        while queue and len(live) < cfg.batch_size:
            if cfg.deadline is not None and time.perf_counter() > cfg.deadline:
                return
            cat, task = queue.pop()
            env = make_env(cat)
            try:
                res = env.reset(task)
            except Exception as e:   # a broken task must not stop the run: it scores 0, noted
                env.close()
                finish(EpisodeState(task, cat, env, [], []), error=_err(e))
                continue
            live.append(EpisodeState(task, cat, env, list(res.tools), list(res.messages)))

    def finish(st: EpisodeState, error: str | None = None) -> None:
        score = 0.0
        if error is None:
            try:
                score = float(st.env.score(st.task, st.traj))
            except Exception as e:
                error = "score: " + _err(e)
        try:
            st.env.close()
        except Exception:
            pass
        fid = None
        if st.fidelity:
            n = len(st.fidelity)
            fid = {k: sum(f[k] for f in st.fidelity) / n for k in st.fidelity[0]}
            fid["calls"] = float(n)
        extra: dict = {"transcript": _transcript(st.traj.messages)} if cfg.keep_transcripts else {}
        drift_stats = getattr(st.env, "drift_stats", None)     # a DriftEnv-wrapped environment
        if callable(drift_stats):
            extra["drift"] = drift_stats()
        r = ItemResult(
            id=st.task.id, category=st.category, score=score, steps=st.steps,
            real_calls=len(st.traj.real_calls), gen_tokens=st.gen_tokens,
            rehearsal_tokens=st.rehearsal_tokens, prompt_tokens=st.prompt_tokens,
            malformed=st.malformed, error=error, time_s=time.perf_counter() - st.t0, fidelity=fid,
            extra=extra)
        store.add(r)
        finished.append(r)
        if on_item is not None:
            on_item(r)

    start_next()
    while live:
        try:
            replies = policy.act(live)
        except Exception as e:
            # A policy crash fails the live episodes (recorded), never the whole run.
            for st in live:
                finish(st, error="policy: " + _err(e))
            live.clear()
            start_next()
            continue
        pending: list[tuple[EpisodeState, list[ToolCall]]] = []
        for st, msg in zip(live, replies):
            st.steps += 1
            st.turn_steps += 1
            good, bad = [], []
            for tc in msg.get("tool_calls") or []:
                (bad if "malformed" in tc else good).append(tc)
            clean = dict(msg)
            if msg.get("tool_calls"):
                clean["tool_calls"] = good
            if not clean.get("tool_calls"):
                clean.pop("tool_calls", None)
            st.add(clean)
            st.malformed += len(bad)
            if getattr(st.env, "grades_calls_only", False):
                st.done = True        # BFCL single-turn: the one turn is graded, nothing runs
                continue
            if bad and cfg.on_malformed == "end_episode":
                st.done = True
                continue
            calls = [call_from_message(tc) for tc in good]
            if calls:
                pending.append((st, calls))
            for tc in bad:
                st.add({"role": "tool", "content": f"Error: malformed tool call ({tc['malformed']})"})
            if not calls and not bad:
                st.traj.final_answer = msg.get("content") or ""
                user = _next_user_message(st.env, clean)
                if user is not None:
                    st.add(user)
                    st.turn_steps = 0
                    tools = getattr(st.env, "tools", None)   # BFCL miss_func adds tools mid-task
                    if isinstance(tools, list) and all(isinstance(t, dict) for t in tools):
                        st.tools = list(tools)
                else:
                    st.done = True
        # World-model fidelity ("both" mode): the model rehearses every call before it runs for real.
        predicted: dict[int, list[str]] = {}
        if cfg.measure_fidelity and pending and hasattr(policy, "predict_responses"):
            preds = policy.predict_responses([s for s, _ in pending], [c for _, c in pending])
            predicted = {id(s): p for (s, _), p in zip(pending, preds)}
        for st, calls in pending:
            for i, call in enumerate(calls):
                res = _safe_execute(st.env, call)
                st.traj.real_calls.append(call)
                st.add({"role": "tool", "name": call.name, "content": res.content})
                if id(st) in predicted:
                    st.fidelity.append(compare_responses(call.name, predicted[id(st)][i], res.content))
        for st, _ in pending:
            if getattr(st.env, "finished", False) is True:   # tau2: the agent called its stop tool
                st.done = True
        for st in list(live):
            limit = max_steps_for(st.category) if max_steps_for else cfg.max_steps
            if st.done or st.turn_steps >= limit:
                live.remove(st)
                finish(st)
        start_next()
    return finished


def _transcript(messages: list[dict], clip: int = 400) -> list[dict]:
    out = []
    for m in messages:
        d = {"role": m.get("role")}
        text = m.get("raw_text") if m.get("role") == "assistant" and "raw_text" in m else m.get("content")
        if isinstance(text, str):
            d["content"] = text if len(text) <= clip else text[:clip] + f"...[{len(text) - clip} chars]"
        if m.get("tool_calls") and "raw_text" not in m:
            d["tool_calls"] = [tc.get("function", tc) for tc in m["tool_calls"]]
        out.append(d)
    return out


def _next_user_message(env: ToolEnv, assistant_message: dict) -> dict | None:
    """The environment's next user turn, if it feeds them one at a time (BFCL multi-turn: no
    argument; tau2 conversational: the agent's reply, which its user simulator answers)."""
    nxt = getattr(env, "next_user_message", None)
    if not callable(nxt):
        return None
    try:
        takes_reply = bool(inspect.signature(nxt).parameters)
    except (TypeError, ValueError):
        takes_reply = False
    return nxt(assistant_message) if takes_reply else nxt()


def _safe_execute(env: ToolEnv, call: ToolCall) -> ToolResult:
    try:
        return env.execute(call)
    except Exception as e:   # the contract says execute never raises; a bug there scores, not crashes
        return ToolResult(content=f"Error: {type(e).__name__}: {e}", ok=False, error_kind="env_error")


def _err(e: BaseException) -> str:
    tb = traceback.format_exception_only(type(e), e)[-1].strip()
    return tb[:500]


def compare_responses(tool: str, rehearsed: str, real: str) -> dict[str, float]:
    """Exact match and JSON field-level F1 of a rehearsed vs a real response, with the rollout's
    fidelity helper, so eval and training metrics mean the same thing."""
    from fastrehearse.rollout.fidelity import score_pair

    s = score_pair(tool, rehearsed, real)
    return {"exact": float(s.exact), "field_f1": float(s.field_f1)}
