"""Generic helpers over any Suite: read tool calls out of chat messages, and replay a message list
(e.g. a task's gold trajectory) through a fresh environment and score it.

`replay_gold(suite, task)` validates a harness end to end: every gold tool call is executed for real,
the tool messages are regenerated from the real responses, and the suite's own scorer grades the
result. The eval's `--policy gold` and the builtin/BFCL/tau2 tests use it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastrehearse.envs.base import Suite, Task, ToolCall, ToolResult, Trajectory


def parse_tool_call(tc: Any) -> ToolCall:
    """One OpenAI-shaped tool call ({"function": {"name", "arguments"}} or {"name", "arguments"}) ->
    ToolCall. Never raises: malformed parts are passed through (a non-dict `arguments`, a name of
    "") so the environment reports them as a bad call, which is an episode outcome."""
    fn = tc.get("function", tc) if isinstance(tc, dict) else {}
    fn = fn if isinstance(fn, dict) else {}
    name = fn.get("name", "")
    args = fn.get("arguments", {})
    raw = args if isinstance(args, str) else ""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # stays a string: the env answers bad_arguments
    return ToolCall(name=name if isinstance(name, str) else str(name), arguments=args, raw=raw)


def tool_calls_of(messages: list[dict]) -> list[ToolCall]:
    """Every tool call the assistant made in `messages`, in order (parallel calls in turn order)."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            for tc in m.get("tool_calls") or []:
                out.append(parse_tool_call(tc))
    return out


def final_answer_of(trajectory: Trajectory) -> str:
    """`trajectory.final_answer` when set, else the content of the last assistant message if that
    message makes no tool call (an episode that ends on a tool call has no answer: "")."""
    if trajectory.final_answer is not None:
        return trajectory.final_answer
    for m in reversed(trajectory.messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            if m.get("tool_calls"):
                return ""
            content = m.get("content")
            return content if isinstance(content, str) else ""
    return ""


@dataclass
class Exchange:
    """One well-formed tool call and the response the episode showed for it."""
    name: str
    arguments: Any
    content: str | None          # None: the episode ended before the response (a cut rehearsal)
    rehearsed: bool | None       # True: the model wrote it; False: executed for real; None: unknown


def exchanges_of(messages: list[dict]) -> list[Exchange]:
    """Every well-formed call of the assistant messages, in order, paired with the tool message
    that answered it (rehearsed or real). Malformed calls also get a tool message (the engine's
    error response) but no Exchange: an assistant message's `raw_text` is re-split into all its
    call blocks (syntax only, as the engine splits them), so the tool messages line up with the
    blocks; without `raw_text` (gold and hand-written trajectories) they line up with `tool_calls`."""
    from fastrehearse.rollout.text.toolcall import parse_tool_calls   # lazy: envs do not need rollout
    out: list[Exchange] = []
    slots: list[Exchange | None] = []    # this turn's call blocks waiting for their tool message
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role == "tool":
            if slots:
                ex = slots.pop(0)
                if ex is not None:
                    ex.content = m.get("content") if isinstance(m.get("content"), str) else ""
                    ex.rehearsed = m.get("rehearsed")
            continue
        slots = []
        if role != "assistant":
            continue
        ok = [parse_tool_call(tc) for tc in m.get("tool_calls") or []]
        raw = m.get("raw_text")
        blocks = parse_tool_calls(raw).calls if isinstance(raw, str) else None
        if blocks is None or len(blocks) == len(ok):
            slots = [Exchange(c.name, c.arguments, None, None) for c in ok]
        else:   # some blocks were malformed: the good calls are the blocks equal to them, in order
            slots = _align(blocks, ok, exact=True) or _align(blocks, ok, exact=False) or \
                [Exchange(c.name, c.arguments, None, None) for c in ok]
        out += [ex for ex in slots if ex is not None]
    return out


def _align(blocks, ok: list[ToolCall], exact: bool) -> list[Exchange | None] | None:
    """Blocks -> slots (an Exchange where a block is the next good call), or None if not all fit."""
    slots, queue = [], list(ok)
    for b in blocks:
        if queue and b.ok and b.call.name == queue[0].name and (not exact or b.call.arguments == queue[0].arguments):
            c = queue.pop(0)
            slots.append(Exchange(c.name, c.arguments, None, None))
        else:
            slots.append(None)
    return None if queue else slots


@dataclass
class ReplayResult:
    score: float
    trajectory: Trajectory                       # messages with tool responses regenerated for real
    results: list[ToolResult] = field(default_factory=list)
    # Indices (into `results`) where the input carried a tool message whose content differs from the
    # real response: for gold trajectories these should be empty (the harness reproduces the data).
    mismatches: list[int] = field(default_factory=list)


def replay(suite: Suite, task: Task, messages: list[dict]) -> ReplayResult:
    """Execute the assistant tool calls in `messages` through a fresh env, in order, and score.

    Tool messages of the input are replaced by the real responses (and compared with them). Later
    user turns are taken from `env.next_user_message(reply)` at the same position (BFCL's turn
    protocol), or kept when it returns None. Other messages are kept as they are."""
    env = suite.make_env()
    try:
        env.reset(task)
        out: list[dict] = []
        results: list[ToolResult] = []
        calls: list[ToolCall] = []
        mismatches: list[int] = []
        pending: list[int] = []          # indices of results still waiting for an input tool message
        for m in messages:
            role = m.get("role")
            if role == "tool":
                if pending:
                    i = pending.pop(0)
                    if m.get("content") != results[i].content:
                        mismatches.append(i)
                continue
            pending = []
            if role == "user":
                # Multi-turn envs (BFCL) hand out later user turns themselves and may change state
                # when they do (miss_func adds tools): take the turn from the env (protocol:
                # next_user_message(reply)), not the record; an env without one keeps the record's.
                reply = next((x for x in reversed(out) if x.get("role") == "assistant"), None)
                nxt = env.next_user_message(reply)
                m = nxt if nxt is not None else m
            out.append(m)
            if role == "assistant" and m.get("tool_calls"):
                for tc in m["tool_calls"]:
                    call = parse_tool_call(tc)
                    res = env.execute(call)
                    calls.append(call)
                    results.append(res)
                    pending.append(len(results) - 1)
                    out.append({"role": "tool", "name": call.name, "content": res.content})
        traj = Trajectory(messages=out, real_calls=calls)
        traj.final_answer = final_answer_of(traj)
        return ReplayResult(score=float(env.score(task, traj)), trajectory=traj, results=results,
                            mismatches=mismatches)
    finally:
        env.close()


def replay_gold(suite: Suite, task: Task) -> ReplayResult:
    if task.gold is None:
        raise ValueError(f"task {task.id!r} has no gold trajectory (task.gold is None)")
    return replay(suite, task, task.gold)
