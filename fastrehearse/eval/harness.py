"""The eval loop: every item runs as one episode of the rollout engine, scored by its benchmark.

Evaluation drives no episode itself: `fastrehearse.rollout.RolloutEngine` (the same driver that
training uses) runs each item against its real environment -- tool calls, malformed-call feedback,
user turns (scripted BFCL turns, a tau2 user simulator), tools that change mid-task, the agent's stop
tool, single-turn tasks graded on the calls -- and the environment scores the trajectory. What the
agent writes comes from the engine's token source (`fastrehearse.rollout.engine.policy`): the model itself
(greedy or sampled), the gold record (`--policy gold`), or test-time rehearsal
(fastrehearse.eval.rehearsal).

Items run in chunks of `batch_size` episodes decoded together; each finished chunk is written to
the result store before the next starts (a crash loses at most one chunk, a rerun resumes).

An item that could not run -- its environment failed to start, its user simulator was unreachable,
the engine or the policy raised, the checker raised, or its prompt alone exceeds the token budget
-- is recorded as an error (score None), never as a score; a rerun retries it.

Per-item seeds depend only on (seed, task id), so a result does not depend on the batch
size, the item order or which other items ran: the trainer's held-out number and `fastrehearse
eval` give the same per-item numbers for the same checkpoint and seed.
"""
from __future__ import annotations

import hashlib
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from fastrehearse.envs.base import Task, ToolEnv, Trajectory
from fastrehearse.eval.results import ItemResult, ResultStore
from fastrehearse.kernels.roles import Role


@dataclass
class HarnessConfig:
    batch_size: int = 8                    # episodes decoded together
    keep_transcripts: bool = True          # what the agent said and saw, clipped, in items.jsonl
    deadline: float | None = None          # time.perf_counter() after which no new chunk starts
                                           # (a rerun resumes the rest)


def item_seed(seed: int, item_id: str) -> int:
    """A row seed from (seed, task id) only: results never depend on batching, order or the name
    the category was asked by (the trainer's split name, the CLI's category string)."""
    h = hashlib.sha256(f"{seed}\x00{item_id}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def run_items(
    items: list[tuple[str, Task]],
    make_env: Callable[[str], ToolEnv],
    engine,
    policy,
    store: ResultStore,
    cfg: HarnessConfig,
    *,
    seed: int = 0,
    on_item: Callable[[ItemResult], None] | None = None,
) -> list[ItemResult]:
    """Run every (category, task) not yet scored in `store` through `engine` with token source
    `policy`; returns this call's results (errors included)."""
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    queue = [(c, t) for c, t in items if not store.done(c, t.id)]
    finished: list[ItemResult] = []

    def record(r: ItemResult) -> None:
        store.add(r)
        finished.append(r)
        if on_item is not None:
            on_item(r)

    for start in range(0, len(queue), cfg.batch_size):
        if cfg.deadline is not None and time.perf_counter() > cfg.deadline:
            break
        t0 = time.perf_counter()
        live: list[tuple[str, Task, Any]] = []     # (category, task, engine Prompt)
        for cat, task in queue[start:start + cfg.batch_size]:
            env = None
            try:
                env = make_env(cat)
                live.append((cat, task, engine.prompt_for(task, env, item_seed(seed, task.id))))
            except Exception as e:   # the environment could not start: an error, not a score
                _close(env)
                record(_error_item(cat, task, "reset: " + _err(e), t0))
        if not live:
            continue
        try:
            result = engine.generate([p for _, _, p in live], policy=policy)
        except Exception as e:   # the engine or the policy crashed: these items could not run
            for cat, task, p in live:
                record(_error_item(cat, task, "episode: " + _err(e), t0))
            continue
        finally:
            for _, _, p in live:
                _close(p.env)
        wall = time.perf_counter() - t0
        for (cat, task, p), ep, traj in zip(live, result.episodes, result.trajectories):
            record(item_from_episode(cat, task, p, ep, traj, wall / len(live), cfg.keep_transcripts,
                                     engine.template.tokenizer))
    return finished


def item_from_episode(cat: str, task: Task, prompt, ep, traj: Trajectory, time_s: float,
                      keep_transcript: bool = True, tokenizer=None) -> ItemResult:
    """One engine episode -> one ItemResult (an error when the episode could not run)."""
    meta = ep.metadata
    steps = int(meta.get("turns", 0))
    messages = list(traj.messages)
    cut = _cut_turn(ep, tokenizer) if meta.get("stop_reason") == "max_new_tokens" else None
    if cut is not None:
        # An engine run with on_max_new_tokens="end_episode" ends the episode at an agent turn cut
        # by max_new_tokens and keeps no message for it (the default, "end_turn", closes the turn as
        # written): the transcript shows what the model wrote, and the cut turn counts as a step.
        steps += 1
        messages.append({"role": "assistant", "content": cut, "cut": "max_new_tokens"})
    roles = ep.roles
    n0 = len(prompt.input_ids)
    act = sum(1 for r, lp in zip(roles[n0:], (ep.rollout_logprobs or [])[n0:])
              if r == int(Role.ACT) and lp == lp)           # sampled (not forced) agent tokens
    rehearse = sum(1 for r in roles[n0:] if r == int(Role.REHEARSE))
    private = sum(int(i.get("rehearsal_tokens", 0)) for i in meta.get("policy", []) if isinstance(i, dict))
    error = meta.get("error") or (("score: " + meta["score_error"]) if meta.get("score_error") else None)
    if error is None and meta.get("stop_reason") == "max_episode_tokens" and meta.get("turns", 0) == 0:
        error = (f"prompt: {n0} tokens leave no room for a turn under max_episode_tokens "
                 "(raise --max-episode-tokens)")
    extra: dict[str, Any] = {"stop_reason": meta.get("stop_reason")}
    if keep_transcript:
        extra["transcript"] = _transcript(messages)
    if meta.get("drift"):
        extra["drift"] = meta["drift"]
    sel = [i for i in meta.get("policy", []) if isinstance(i, dict) and "from_draft" in i]
    if sel:
        extra["rehearsal_select"] = {"turns": len(sel), "from_draft": sum(bool(i["from_draft"]) for i in sel)}
    calls = meta.get("calls", [])
    return ItemResult(
        id=task.id, category=cat, score=None if error else float(ep.reward),
        steps=steps,
        real_calls=len(traj.real_calls),
        gen_tokens=act,
        rehearsal_tokens=rehearse + private,
        prompt_tokens=n0,
        malformed=sum(1 for c in calls if c.get("mode") in ("error", "malformed")),
        error=error, time_s=time_s, fidelity=_fidelity(meta.get("fidelity") or []), extra=extra)


def _cut_turn(ep, tokenizer) -> str | None:
    """The text of the agent turn the episode ended in, when it ended mid-turn (trailing ACT tokens)."""
    if tokenizer is None or not ep.roles or ep.roles[-1] != int(Role.ACT):
        return None
    i = len(ep.roles)
    while i > 0 and ep.roles[i - 1] == int(Role.ACT):
        i -= 1
    return tokenizer.decode(ep.input_ids[i:])


def _fidelity(scores: list[dict]) -> dict[str, float] | None:
    if not scores:
        return None
    n = len(scores)
    out = {"exact": sum(float(s["exact"]) for s in scores) / n,
           "field_f1": sum(float(s["field_f1"]) for s in scores) / n, "calls": float(n)}
    for k in ("predictable", "hidden"):   # fields labelled by the env (builtin: envs/builtin/rules.py)
        v = [float(s[k]) for s in scores if s.get(k) is not None]
        if v:
            out[k] = sum(v) / len(v)
    return out


def _error_item(cat: str, task: Task, error: str, t0: float) -> ItemResult:
    return ItemResult(id=task.id, category=cat, score=None, error=error, time_s=time.perf_counter() - t0)


def _close(env) -> None:
    if env is None:
        return
    try:
        env.close()
    except Exception:
        pass


def _transcript(messages: list[dict], clip: int = 400) -> list[dict]:
    out = []
    for m in messages:
        d = {"role": m.get("role")}
        text = m.get("content")
        if m.get("role") == "assistant" and isinstance(m.get("raw_text"), str):
            text = m["raw_text"]
        if isinstance(text, str):
            d["content"] = text if len(text) <= clip else text[:clip] + f"...[{len(text) - clip} chars]"
        if m.get("tool_calls") and "raw_text" not in m:
            d["tool_calls"] = [tc.get("function", tc) for tc in m["tool_calls"]]
        if m.get("cut"):
            d["cut"] = m["cut"]
        if m.get("context"):
            d["context"] = m["context"][:clip]
        out.append(d)
    return out


def _err(e: BaseException) -> str:
    return traceback.format_exception_only(type(e), e)[-1].strip()[:500]
