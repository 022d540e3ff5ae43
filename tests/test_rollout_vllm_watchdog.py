"""The vLLM instance's watchdog (fastrehearse/rollout/vllm_watchdog.py), on real processes without
vLLM: an owner process starts the watchdog the way VLLMBackend does, then a process tree shaped
like vLLM's (an "engine" child that starts its own "worker" child, both ignoring SIGTERM like a
stuck engine would, so the SIGKILL fallback is exercised too), and is SIGKILLed.
The same with the real vLLM engine: tests/test_rollout_vllm.py::test_owner_killed_leaves_no_engine.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[1]

OWNER = textwrap.dedent("""
    import json, multiprocessing as mp, os, signal, sys, time
    from pathlib import Path
    from fastrehearse.rollout.vllm_backend import _Watchdog

    def worker():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)

    def engine():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        w = mp.get_context("fork").Process(target=worker); w.start()
        time.sleep(600)

    if __name__ == "__main__":
        d = Path(sys.argv[1]); d.mkdir(); (d / "model.safetensors").write_bytes(b"x" * 1000)
        wd = _Watchdog(d)
        e = mp.get_context("fork").Process(target=engine); e.start()
        while len(psutil_children := __import__("psutil").Process(e.pid).children()) < 1:
            time.sleep(0.05)
        if sys.argv[2] == "started":
            wd.engine_started()
        tree = [e.pid] + [c.pid for c in psutil_children]
        print(json.dumps({"tree": tree, "watchdog": wd.proc.pid}), flush=True)
        if sys.argv[2] == "stop":
            wd.stop(); print("stopped", flush=True)
        time.sleep(600)
""")


def _start_owner(tmp_path, phase):
    d = Path(tempfile.mkdtemp(prefix="fastrehearse-vllm-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    d.rmdir()
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(d), phase], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    info = json.loads(p.stdout.readline())
    return p, d, info


def _gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [x for x in pids if psutil.pid_exists(x) and psutil.Process(x).status() != psutil.STATUS_ZOMBIE]
        if not left:
            return []
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("phase", ["started", "starting"])
def test_owner_sigkilled_engine_tree_and_folder_removed(tmp_path, phase):
    """started: the owner told the watchdog its engine processes; starting: killed during the
    start-up, before it could (every child started since the watchdog is the engine's)."""
    p, d, info = _start_owner(tmp_path, phase)
    try:
        assert d.is_dir() and len(info["tree"]) == 2
        time.sleep(0.6)                       # at least one watchdog poll has recorded the tree
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        # SIGTERM is ignored by both: the watchdog's SIGKILL after GRACE_S (3 s) ends them
        assert _gone(info["tree"] + [info["watchdog"]], timeout=15) == []
        assert not d.exists()
    finally:
        for x in info["tree"]:
            try:
                os.kill(x, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_stop_cleans_up_and_exits(tmp_path):
    """The owner's close(): the watchdog stops what is left of the engine, removes the folder and
    exits; the owner lives on."""
    p, d, info = _start_owner(tmp_path, "stop")
    try:
        assert p.stdout.readline().strip() == "stopped"
        assert _gone(info["tree"] + [info["watchdog"]], timeout=1) == []
        assert not d.exists() and p.poll() is None
    finally:
        p.kill()
        p.wait()
