"""FSDP2 on gloo with real torchrun processes: the trainer's update gives the same losses and
gradients at world size 1 and 2, and a two-node launch on loopback runs (and agrees too)."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "_train_dist_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(procs, timeout=600):
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:     # the launcher and its workers (a SIGKILLed launcher orphans them)
                os.killpg(q.pid, signal.SIGKILL)
            raise AssertionError(f"a launcher was still running after {timeout} s (ranks hung?)")
        assert p.returncode == 0, out[-4000:]


def _popen(cmd):
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("w1") / "w1.pt"
    _check([_popen([sys.executable, WORKER, str(out)])])
    return torch.load(out)


def _compare(a, b):
    assert b["world_size"] == 2 and a["world_size"] == 1
    assert len(a["losses"]) == len(b["losses"]) == 3            # SFT, RL token-mean, RL seq-mean
    for la, lb in zip(a["losses"], b["losses"]):
        assert abs(la - lb) <= 1e-5 * max(1.0, abs(la)), (la, lb)
    for ga, gb in zip(a["grads"], b["grads"]):
        assert sorted(ga) == sorted(gb) and len(ga) > 10
        assert any(g.abs().max() > 1e-3 for g in ga.values())  # real gradients, not all zero
        for k in ga:
            assert torch.allclose(ga[k], gb[k], atol=1e-5, rtol=1e-5), (k, (ga[k] - gb[k]).abs().max())
    for k in a["params_after"]:
        assert torch.allclose(a["params_after"][k], b["params_after"][k], atol=1e-5, rtol=0), k


def test_two_processes_match_one(single, tmp_path):
    out = tmp_path / "w2.pt"
    _check([_popen(TORCHRUN + ["--nproc_per_node=2", "--master_addr=127.0.0.1",
                               f"--master_port={_free_port()}", WORKER, str(out)])])
    _compare(single, torch.load(out))


def test_reuse_of_rollout_logprobs_is_decided_by_all_ranks(tmp_path):
    """One non-finite rollout log-prob on one rank only (the episode is packed there): every rank
    recomputes the old log-probs together, so world size 2 gives the world-size-1 update (the
    same 1e-5 tolerances as above: sums split across ranks) and ends. Were that rank alone to run
    a policy forward while the other went on to the loss, FSDP would pair all-gathers of
    different layers, then hang."""
    flag = "--nan-rollout-logprob=4"
    one, two = tmp_path / "w1.pt", tmp_path / "w2.pt"
    _check([_popen([sys.executable, WORKER, str(one), flag])])
    _check([_popen(TORCHRUN + ["--nproc_per_node=2", "--master_addr=127.0.0.1",
                               f"--master_port={_free_port()}", WORKER, str(two), flag])],
           timeout=240)
    _compare(torch.load(one), torch.load(two))


def test_two_nodes_on_loopback(single, tmp_path):
    out = tmp_path / "n2.pt"
    port = _free_port()
    procs = []
    for r in (0, 1):
        procs.append(_popen(TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={r}",
                                        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                        "--rdzv-id=fastrehearse-test", WORKER, str(out)]))
        # Both launchers run on this machine, so both qualify as the c10d store host; starting
        # node 0 first lets it bind the store before node 1 looks for it (as on real clusters,
        # where the launcher on the rendezvous host is usually up first). Under heavy load a
        # simultaneous start failed once here.
        if r == 0:
            time.sleep(3)
    _check(procs)
    _compare(single, torch.load(out))


_EXIT_PROBE = """
import atexit, sys, threading, time
from pathlib import Path
from fastrehearse.train.parallelize import exit_worker
d = Path(sys.argv[1])
class Finalized:                      # a module global: only interpreter finalization deletes it
    def __del__(self):
        print("finalized", flush=True)
keep = Finalized()
atexit.register(lambda: (d / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), (d / "thread").write_text("joined"))).start()
sys.stdout.write("buffered ")          # no newline, no flush: must still come out
sys.exit(exit_worker(3) + 100)         # a torchrun worker never gets past exit_worker
"""


@pytest.mark.parametrize("torchrun", [True, False])
def test_exit_worker_skips_finalization_only_under_torchrun(torchrun, tmp_path):
    """A finished torchrun worker leaves without interpreter finalization (where torch's threads have
    crashed ranks whose work was saved), yet keeps its exit code, joins its threads, runs its atexit
    handlers and flushes stdout. Outside torchrun the code comes back and Python exits as usual."""
    env = {k: v for k, v in ENV.items() if k not in ("TORCHELASTIC_RUN_ID", "GROUP_RANK")}
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "probe"
    p = subprocess.run([sys.executable, "-c", _EXIT_PROBE, str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == (3 if torchrun else 103), p.stderr[-2000:]
    assert p.stdout == ("buffered " if torchrun else "buffered finalized\n")
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"


_STUCK_PEER = """
import sys, time
import torch.distributed as dist
from fastrehearse.train.parallelize import init_distributed
info = init_distributed("cpu", timeout_s=float(sys.argv[1]))
if info.rank == 1:
    time.sleep(300)           # alive but stuck: never reaches the collective
t0 = time.monotonic()
try:
    dist.barrier()
except Exception as e:        # the process group's timeout, not torch's 30-minute default
    print(f"rank 0 gave up after {time.monotonic() - t0:.0f} s: {type(e).__name__}", flush=True)
    raise SystemExit(3)
"""


def test_dist_timeout_bounds_a_wait_for_a_stuck_rank(tmp_path):
    """dist.timeout_s reaches the process group: with rank 1 alive but stuck, rank 0's collective
    raises after the timeout and the launcher ends non-zero (torchrun then stops rank 1), instead
    of waiting out gloo's 30-minute default."""
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_PEER)
    t0 = time.monotonic()
    p = _popen(TORCHRUN + ["--nproc_per_node=2", "--master_addr=127.0.0.1",
                           f"--master_port={_free_port()}", str(script), "8"])
    try:
        out, _ = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError("the launcher was still waiting after 150 s: no timeout reached gloo")
    assert p.returncode != 0 and "rank 0 gave up after" in out, out[-3000:]
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("env,refused", [
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "head-node"}, True),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "head-node",
      "GLOO_SOCKET_IFNAME": "eth0"}, False),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "head-node",
      "NCCL_SOCKET_IFNAME": "ib0"}, False),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}, False),  # loopback test
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "head-node"}, False),  # one node
])
def test_multinode_launch_on_a_loopback_hostname_is_refused(env, refused):
    """Spanning nodes while this host's name resolves to 127.0.1.1 (stock Ubuntu) and no socket
    interface is named: gloo would bind to loopback and the first collective would hang. Refused in
    one line naming the variables; the loopback launch, one node and a named interface pass."""
    from fastrehearse.train.parallelize import NetworkConfigError, check_multinode_network
    kw = dict(env=env, resolve=lambda host: "127.0.1.1", hostname="node7")
    if not refused:
        check_multinode_network(**kw)
        return
    with pytest.raises(NetworkConfigError) as e:
        check_multinode_network(**kw)
    msg = str(e.value)
    assert "\n" not in msg and "GLOO_SOCKET_IFNAME" in msg and "NCCL_SOCKET_IFNAME" in msg
    assert "'node7' resolves to 127.0.1.1" in msg
    # a hostname that resolves to a routable address passes
    check_multinode_network(env=env, resolve=lambda host: "192.0.2.7", hostname="node7")


def test_watchdog_stays_off_without_peers(monkeypatch):
    """No process group (make demo, a CPU learning run) or a group of one: nobody waits on this
    rank, so a long phase (an eval on the CPU) must not be ended by the watchdog."""
    import torch.distributed as dist
    from fastrehearse.train import failures
    armed = []
    monkeypatch.setattr(failures.faulthandler, "dump_traceback_later",
                        lambda *a, **k: armed.append(a))
    failures.start(0, 1, 1800.0, torchrun=False)           # no process group
    with failures.phase("eval"):
        failures.progress(force=True)
    assert armed == [] and failures._state["timeout"] is None
    monkeypatch.setattr(failures, "_store", lambda: object())   # a group, but of one rank
    failures.start(0, 1, 1800.0, torchrun=False)
    assert armed == [] and failures._state["timeout"] is None
    failures.start(0, 2, 1800.0, torchrun=False)            # peers: armed
    assert len(armed) == 1 and armed[0][0] == failures.watchdog_s(1800.0)
    monkeypatch.setattr(failures.faulthandler, "cancel_dump_traceback_later", lambda: None)
    failures.stop()
    assert dist.is_initialized() is False


def test_failure_origin_is_judged_by_type_not_wording():
    """A rank's own error that mentions a timeout (a tool call) is its own, so it is reported as
    the origin; gloo's RuntimeErrors (they name their gloo source file) and torch.distributed's
    DistError are broken collectives, the symptom of a peer's failure."""
    import torch.distributed as dist
    from fastrehearse.train.failures import _is_origin
    assert _is_origin(TimeoutError("tool call timed out after 30 s"))
    assert _is_origin(RuntimeError("connection to the tool server timed out"))
    assert not _is_origin(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
                                       "Read error [127.0.0.1]:10120: Connection reset by peer"))
    assert not _is_origin(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/"
                                       "unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    assert not _is_origin(dist.DistBackendError("NCCL communicator was aborted"))
