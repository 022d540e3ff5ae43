"""A failure on one rank stops every rank in bounded time and is named on rank 0.

Three pieces, none of them a collective (a collective after a failure could pair with a peer's
unrelated one, or wait forever for a rank that is gone):

- Reports through the rendezvous store. Each rank writes its current phase (`phase("update")`)
  and, when it fails, one line: the time, the phase and the error. A rank whose own error is a
  broken or timed-out collective reads the others' reports; if a peer failed first it raises
  `PeerFailed("rank 1 failed in update: RuntimeError: ...")`, which rank 0 prints, and a peer that
  left no report is named as stopped without one (killed, or ended by its watchdog).
- A watchdog per rank (faulthandler's C timer: it fires even while Python is blocked in a kernel or
  a C call): if no collective completes and no phase starts for `dist.timeout_s` plus a grace,
  the rank dumps every thread's stack to stderr and exits. A collective's own timeout fires only on
  the ranks that wait in it; this ends the rank that keeps them waiting.
- A launcher monitor: a torchrun worker whose launcher is gone (SIGKILLed by a scheduler after its
  grace period) exits instead of living on as an orphan holding its GPU.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from .errors import TrainingError

_KEY = "fastrehearse/"
_state: dict = {"phase": "setup", "timeout": None, "armed_at": 0.0, "rank": 0, "world": 1}


class PeerFailed(TrainingError):
    """This rank stopped because another rank failed first (the message names it)."""


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: reports are best effort
        return None


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}: {msg[:300]}"


def watchdog_s(timeout_s: float) -> float:
    """The watchdog fires this long after the last progress: the collective timeout plus a grace
    (30 s to 2 min) for the work between the last mark and a collective the rank then waits in,
    so a waiting rank's own collective timeout fires first and reports."""
    return timeout_s + max(30.0, min(120.0, timeout_s / 2))


def start(rank: int, world: int, timeout_s: float | None, torchrun: bool) -> None:
    """Arm the watchdog (with peers: world > 1) and, under torchrun, the launcher monitor; neither
    without a process group. Alone there is nobody to keep waiting, and a long phase (an eval on
    the CPU) is no hang."""
    _state.update(phase="setup", rank=rank, world=world, timeout=None, armed_at=0.0)
    _state.pop("failed_in", None)
    if _store() is None:
        return
    if timeout_s and world > 1:
        _state["timeout"] = timeout_s
        progress(force=True)
    if torchrun:
        parent = os.getppid()

        def monitor():
            while True:
                time.sleep(2.0)
                if os.getppid() != parent:
                    print(f"[rank {rank}] the launcher (pid {parent}) is gone; exiting",
                          file=sys.stderr, flush=True)
                    os._exit(1)
        threading.Thread(target=monitor, name="fastrehearse-launcher-monitor", daemon=True).start()


def stop() -> None:
    if _state["timeout"]:
        faulthandler.cancel_dump_traceback_later()
    _state["timeout"] = None


def progress(force: bool = False) -> None:
    """Something completed (a collective, a phase change): push the watchdog back. Re-armed at
    most once a second (each re-arm restarts faulthandler's timer thread)."""
    t = _state["timeout"]
    now = time.monotonic()
    if t and (force or now - _state["armed_at"] > 1.0):
        faulthandler.dump_traceback_later(watchdog_s(t), exit=True)
        _state["armed_at"] = now


@contextmanager
def phase(name: str):
    """Mark this rank's phase (rollout, update, eval, checkpoint, export) for failure reports."""
    prev = _state["phase"]
    _state["phase"] = name
    store = _store()
    if store is not None:
        try:
            store.set(f"{_KEY}phase/{_state['rank']}", name)
        except Exception:  # noqa: BLE001
            pass
    progress(force=True)
    try:
        yield
    except BaseException:
        _state.setdefault("failed_in", name)     # the innermost phase the error left
        raise
    finally:
        _state["phase"] = prev


def _where() -> str:
    return _state.get("failed_in") or _state["phase"]


def report(e: BaseException) -> None:
    """Write this rank's failure (time, phase, whether it is its own error, one line) where every
    rank can read it."""
    store = _store()
    if store is None or isinstance(e, PeerFailed):
        return
    try:
        store.set(f"{_KEY}failed/{_state['rank']}",
                  f"{time.time():.3f}|{_where()}|{int(_is_origin(e))}|{_one_line(e)}")
    except Exception:  # noqa: BLE001 - the store may be gone with its host
        pass


def _read(store, key: str) -> str | None:
    try:
        if store.check([key]):
            return store.get(key).decode()
    except Exception:  # noqa: BLE001
        return None
    return None


def peer_failure(own: BaseException, wait_s: float = 10.0) -> str | None:
    """After this rank failed with `own`, a broken or timed-out collective: the line naming the
    rank that failed first with an error of its own (earliest report; clocks of different nodes
    only order reports roughly), or the ranks that stopped without any report. None when `own`
    is this rank's own error (it is the origin: it exits at once, which is how its peers notice)
    or nothing is known. Peers get `wait_s` to write their reports."""
    store = _store()
    if store is None or _state["world"] <= 1 or _is_origin(own):
        return None
    me = _state["rank"]
    deadline = time.monotonic() + wait_s
    while True:
        reports = {r: _read(store, f"{_KEY}failed/{r}") for r in range(_state["world"]) if r != me}
        got = {r: v.split("|", 3) for r, v in reports.items() if v}
        origins = {r: v for r, v in got.items() if v[2] == "1"}
        if origins or len(got) == len(reports) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if origins:
        r, (_, where, _, msg) = min(origins.items(), key=lambda kv: float(kv[1][0]))
        return f"rank {r} failed in {where}: {msg}"
    silent = sorted(set(reports) - set(got))
    if silent:
        where = {r: _read(store, f"{_KEY}phase/{r}") or "?" for r in silent}
        names = ", ".join(f"rank {r} (in {where[r]})" for r in silent)
        return (f"{names} stopped without a report -- killed, or ended by its watchdog after "
                f"dist.timeout_s with no progress (its log has the stack); rank {me} then failed "
                f"in {_where()}: {_one_line(own)}")
    return None


def _is_origin(e: BaseException) -> bool:
    """An error of this rank's own making, not a broken or timed-out collective: those are
    torch.distributed.DistError (NCCL, the store) or gloo's RuntimeErrors, which name their gloo
    source file ("[.../gloo/transport/tcp/pair.cc:537] Read error ... Connection reset by peer").
    Judged by type and origin, not by words such as "timeout" an own error may contain."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return False
    return not (type(e) is RuntimeError and "gloo/" in str(e))
