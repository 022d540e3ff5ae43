"""Cleans up after an owner process that died without stopping its MCP servers.

The MCP suite (client.py) starts tool servers as child processes. When the process that owns them
is killed by a signal it cannot catch (SIGKILL, the OOM killer), no code of it runs: the servers are
re-parented to init and live on, and the owner's scratch folder stays. `client.py` therefore starts
this watchdog beside its servers:

    python -I watchdog.py OWNER_PID SCRATCH_DIR [PRE_EXISTING_CHILD_PID ...]
    stdin lines:  "engine PID ..."  the servers' processes, sent whenever the set of live servers
                                    changes
                  "stop"            the owner stopped them: clean up what is left, exit

Every POLL_S it checks the owner (gone or a zombie = dead) and records the recorded processes'
trees (descendants started later are caught too). Before the first list arrives, it records every
child the owner started since the watchdog was launched (except the watchdog) and their
descendants. When the owner is dead (or on "stop") it sends SIGTERM to every recorded process still
running, SIGKILL to those alive after GRACE_S, removes SCRATCH_DIR and exits.

Why a watchdog and not PR_SET_PDEATHSIG: the death signal fires when the *thread* that forked the
child exits, not the process (the servers are started from the client's event-loop thread), and it
cannot remove the scratch folder. A separate process covers every way the owner can die. Why polling
the pid and not waiting for EOF on the pipe: a child forked by the owner inherits the pipe's write
end, so EOF would only come once that child is gone. psutil's process identity includes the start
time, so a reused pid is never mistaken for the owner or a server.

(The vLLM backend needs no watchdog: it runs its engine inside the trainer's process, so nothing of
vLLM can be orphaned.)

Run by file path with `python -I` (no script-directory import path, no package import): stdlib and
psutil only, a few MB, started in its own session so a signal sent to the owner's process group does
not take it down with the owner.
"""
from __future__ import annotations

import os
import select
import shutil
import sys
import time

import psutil

POLL_S = 0.25
GRACE_S = 3.0


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tree(roots) -> list[psutil.Process]:
    out = []
    for r in roots:
        try:
            out += [r, *r.children(recursive=True)]
        except psutil.Error:      # gone since: its recorded descendants stay recorded
            pass
    return out


def cleanup(procs, export_dir: str) -> int:
    """SIGTERM, GRACE_S, SIGKILL for every process of `procs` still running; remove `export_dir`.
    Returns how many processes were still running."""
    live = [p for p in procs if _alive(p)]
    for p in live:
        try:
            p.terminate()
        except psutil.Error:
            pass
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in live):
        time.sleep(0.05)
    for p in live:
        if _alive(p):
            try:
                p.kill()
            except psutil.Error:
                pass
    shutil.rmtree(export_dir, ignore_errors=True)
    return len(live)


def watch(owner_pid: int, export_dir: str, pre_existing: set[int], inp: int = 0) -> str:
    """The loop; returns why it ended ("owner died" or "stopped")."""
    me = os.getpid()
    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:     # died before we looked: nothing recorded; the folder still goes
        cleanup([], export_dir)
        return "owner died"
    roots: list[psutil.Process] | None = None
    recorded: dict[tuple[int, float], psutil.Process] = {}
    buf, eof = b"", False

    def record():
        if roots is None:
            try:
                kids = [c for c in owner.children() if c.pid != me and c.pid not in pre_existing]
            except psutil.Error:
                return
            procs = _tree(kids)
        else:
            procs = _tree(roots)
        for p in procs:
            try:
                recorded.setdefault((p.pid, p.create_time()), p)
            except psutil.Error:
                pass

    while True:
        if not _alive(owner):
            cleanup(recorded.values(), export_dir)
            return "owner died"
        if eof:
            time.sleep(POLL_S)
        elif select.select([inp], [], [], POLL_S)[0]:
            chunk = os.read(inp, 4096)
            eof = not chunk          # writers gone; the owner may still be alive (see the docstring)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd, *args = line.decode().split() or [""]
                if cmd == "engine":
                    roots = []
                    for a in args:
                        try:
                            roots.append(psutil.Process(int(a)))
                        except psutil.NoSuchProcess:
                            pass
                    recorded.clear()
                elif cmd == "stop":
                    record()
                    cleanup(recorded.values(), export_dir)
                    return "stopped"
        record()


def main(argv: list[str]) -> int:
    owner, export_dir, *pre = argv
    why = watch(int(owner), export_dir, {int(p) for p in pre})
    if why == "owner died":
        try:   # the owner's stderr may be gone with it: the cleanup above does not depend on this line
            print(f"fastrehearse watchdog: owner process {owner} died; stopped the processes it had "
                  f"started (vLLM engine or MCP servers) and removed {export_dir}", file=sys.stderr, flush=True)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
