"""A failure on one rank of a multi-node job stops every node in bounded time and rank 0 says
where. Two torchrun launchers on loopback (1 rank each), `fastrehearse train` on the
smoke preset with one fault planted on one rank (tests/_fault_worker.py): a rank raising in the
rollout, the optimizer step or the checkpoint; a rank hanging (rank 1, and rank 0, whose launcher
hosts the rendezvous store) with dist.timeout_s=20; a launcher SIGKILLed under its workers."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "_fault_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT_S = 20      # dist.timeout_s in the hang tests; the watchdog fires 30 s later

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, fault=None, steps=3, extra=(), env_extra=None):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    if fault:
        env["FR_FAULT"] = fault
    args = ["--config", "configs/smoke.yaml", "--set", f"run_dir={tmp_path / 'run'}",
            "--set", "eval.num_tasks=0", "--set", "checkpoint.export=false",
            "--set", f"steps={steps}", "--set", "checkpoint.every=1",
            "--set", f"dist.timeout_s={TIMEOUT_S}", *extra]
    procs = []
    for r in (0, 1):
        procs.append(subprocess.Popen(
            TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={r}", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fr-failures", WORKER, *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True))
        if r == 0:
            time.sleep(3)    # node 0 binds the store first (see test_train_distributed)
    return procs


def _wait(procs, limit):
    t0, outs = time.monotonic(), []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, limit - (time.monotonic() - t0)))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"launchers still running after {limit} s")
    return time.monotonic() - t0, outs, [p.returncode for p in procs]


@pytest.mark.parametrize("where", ["rollout", "update", "checkpoint"])
def test_a_rank_raising_stops_both_nodes_and_rank_0_names_it(tmp_path, where):
    dt, (out0, out1), rcs = _wait(_launch(tmp_path, f"{where}:1:raise"), 240)
    assert rcs[0] != 0 and rcs[1] != 0, (out0[-2000:], out1[-2000:])
    assert f"rank 1 failed in {where}: RuntimeError: injected fault in {where} on rank 1" in out0, \
        out0[-3000:]
    assert f"injected fault in {where}" in out1                 # the rank's own traceback
    if where == "checkpoint":   # the last complete checkpoint is kept (the failing save left none)
        assert not list((tmp_path / "run" / "checkpoints").glob("step_*[0-9]"))


@pytest.mark.parametrize("rank", [1, 0])
def test_a_hanging_rank_stops_both_nodes_in_bounded_time(tmp_path, rank):
    dt, (out0, out1), rcs = _wait(_launch(tmp_path, f"update:{rank}:hang"), TIMEOUT_S + 150)
    assert rcs[0] != 0 and rcs[1] != 0
    # the waiting rank names the silent one; the stuck rank's watchdog dumped its stack
    waiting, stuck = (out0, out1) if rank == 1 else (out1, out0)
    assert f"rank {rank} (in update) stopped without a report" in waiting, waiting[-3000:]
    assert "Timeout (" in stuck and "fault" in stuck, stuck[-3000:]
    assert dt < TIMEOUT_S + 120, dt


def test_workers_exit_when_their_launcher_is_killed(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    procs = _launch(tmp_path, steps=200, env_extra={"FR_PID_DIR": str(pids)})
    try:
        t0 = time.monotonic()
        while len(list(pids.glob("*.pid"))) < 2 or not (tmp_path / "run" / "metrics.jsonl").exists():
            assert time.monotonic() - t0 < 180, "training did not start"
            time.sleep(0.5)
        workers = [int(p.read_text()) for p in pids.glob("*.pid")]
        for p in procs:
            p.send_signal(signal.SIGKILL)          # launchers only, as a scheduler's kill -9
            p.wait()
        t0 = time.monotonic()
        alive = workers
        while alive and time.monotonic() - t0 < 30:
            time.sleep(0.5)
            alive = [w for w in workers if _alive(w)]
        assert not alive, f"workers {alive} outlived their launchers by 30 s"
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"
