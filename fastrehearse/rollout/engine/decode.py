"""The decode loop: rows -> segment requests on a backend session -> finished segments -> rows.

Every live row always has one segment in flight, so the batch never waits for its slowest turn:
when a row's segment ends, the row appends what follows (scaffolding, real responses, user turns),
the policy is asked about the rows that start a turn (one batched call), a separate simulator's
responses are written, finished rows leave the session, and the rows that need the model again
get their next segment before the backend's next step.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from fastrehearse.rollout.backends.segments import Sampling, SegmentBackend, SegmentSession
from fastrehearse.rollout.engine.policy import Policy
from fastrehearse.rollout.engine.row import Row


def resolve_turns(policy: Policy | None, rows: list[Row], stats: Counter) -> None:
    """Ask the policy, in one batched call, who writes the turn of every row starting one; a
    forced turn may run the row up to its next turn (real calls, user turns): repeat."""
    if policy is None:
        return
    while True:
        waiting = [r for r in rows if r.awaiting_turn and not r.done]
        if not waiting:
            return
        turns = policy.begin_turns([r.request() for r in waiting])
        if len(turns) != len(waiting):
            raise ValueError(f"policy.begin_turns returned {len(turns)} turns for {len(waiting)} requests")
        stats["policy_calls"] += 1
        for r, t in zip(waiting, turns):
            stats["forced_turns"] += int(t is not None and t.text is not None)
            r.apply_turn(t)


def decode(rows: list[Row], backend: SegmentBackend, sampling: Sampling, stats: Counter, *,
           policy: Policy | None = None,
           simulate: Callable[[list[Row]], None] | None = None) -> None:
    """Run `rows` (keys: their .index, unique) until every one is done. `simulate` writes the
    responses of rows waiting for a separate simulator (simulator.py)."""
    session: SegmentSession | None = None
    in_flight: set[int] = set()
    by_key = {r.index: r for r in rows}
    live = [r for r in rows if not r.done]
    try:
        while True:
            # Between two backend steps: settle every row that does not need the model.
            while True:
                sim = [r for r in live if r.waiting_sim is not None and not r.done]
                if sim:
                    if simulate is None:
                        raise ValueError("a row waits for a separate simulator but none was given")
                    simulate(sim)
                resolve_turns(policy, live, stats)
                if not any(r.waiting_sim is not None and not r.done for r in live):
                    break
            requests = []
            for r in live:
                if r.index not in in_flight and r.needs_segment:
                    req = r.segment_request()    # None: no room left, the row just finished
                    if req is not None:
                        requests.append(req)
            finished = [r.index for r in live if r.done]
            if finished:
                live = [r for r in live if not r.done]
                if session is not None:
                    session.drop(finished)
            if requests:
                if session is None:
                    session = backend.session(sampling, stats)
                session.add(requests)
                in_flight.update(q.key for q in requests)
            if not in_flight:
                return
            for key, seg in session.step():
                in_flight.discard(key)
                stats["segments"] += 1
                by_key[key].on_segment(seg)
    finally:
        if session is not None:
            session.close()
