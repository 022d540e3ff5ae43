"""Collectives that are right on every backend: the trainer's full SFT + RL step under torchrun
with the compute device simulated as an accelerator (tests/_placement.py) and strict collectives:
no host tensor reaches a collective, and with a 1-rank group every collective still runs (as on
one GPU). A counter kept on the host, or a collective skipped at world size 1, fails it."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _placement import ACCEL, HOST, SimulatedAccelerator  # noqa: E402
from _torchrun import torchrun  # noqa: E402

from fastrehearse.train.parallelize import (  # noqa: E402
    CollectiveDeviceError,
    DistInfo,
    all_reduce_sum,
    sum_over_ranks,
)


def _run(nproc: int, tmp_path: Path) -> dict:
    out = tmp_path / f"w{nproc}.pt"
    p = torchrun(nproc, "_collectives_worker.py", out, tmp_path / f"run{nproc}")
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    return torch.load(out)


@pytest.mark.parametrize("nproc", [1, 2])
def test_full_step_collectives_on_the_compute_device(nproc, tmp_path):
    res = _run(nproc, tmp_path)
    assert res["world_size"] == nproc and res["sharded"]
    # every collective of the step really ran, also in a 1-rank group (one GPU runs a node's code)
    assert res["calls"].get("all_reduce", 0) >= 6, res["calls"]
    assert res["calls"].get("all_gather_object", 0) >= 2, res["calls"]
    sft, rl = res["rows"]
    assert sft["stage"] == "sft" and rl["stage"] == "rl" and "skipped" not in sft
    assert rl["train_tokens"] > 0 and res["stop"] is False


def test_simulator_tracks_host_tensors():
    with SimulatedAccelerator() as sim:
        dev = sim.device_of
        host = torch.tensor([1.0])                       # no device: the host on CUDA too
        acc = torch.zeros(3, device=ACCEL)
        assert dev(host) == HOST and dev(acc) == ACCEL
        assert dev(host * 2) == HOST                     # host op stays on the host
        assert dev(acc + host) == ACCEL                  # a host scalar joins a device tensor
        moved = host.to(ACCEL)
        assert dev(moved) == ACCEL and dev(host) == HOST and sim.is_host(host)
        back = acc.cpu()
        assert dev(back) == HOST and dev(acc) == ACCEL
        assert dev(acc.to(torch.float64)) == ACCEL and dev(host.double()) == HOST


def test_strict_mode_refuses_host_tensors(monkeypatch):
    monkeypatch.setenv("FASTREHEARSE_STRICT_COLLECTIVES", "1")
    import torch.distributed as dist

    from fastrehearse.train import parallelize
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: calls.append(t))
    info = DistInfo(0, 2, 0, ACCEL, "gloo")
    sim = SimulatedAccelerator()
    monkeypatch.setattr(parallelize, "_device_of", sim.device_of)
    with sim:
        with pytest.raises(CollectiveDeviceError, match=r"on cpu from .*test_train_collectives.py.*compute device is cpu:0"):
            all_reduce_sum(torch.tensor([1.0], dtype=torch.float64), info)
        assert calls == []
        out = sum_over_ranks([1.0, 2.0], info)           # host numbers: the helper places them
        assert sim.device_of(calls[0]) == ACCEL and sim.device_of(out) == HOST and out.tolist() == [1.0, 2.0]
    monkeypatch.delenv("FASTREHEARSE_STRICT_COLLECTIVES")
    with sim, pytest.warns(UserWarning, match="moved it"):
        all_reduce_sum(torch.tensor([1.0]), info)          # outside tests: moved, with a warning
        assert sim.device_of(calls[-1]) == ACCEL
