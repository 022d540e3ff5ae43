"""Worker for tests/test_train_collectives.py: a full SFT step, a full RL step (rollout, gather,
advantages, update, generation-weight sync) and the stop vote of the real trainer under torchrun,
with the compute device simulated as an accelerator (tests/_placement.py) and strict collectives.

Rank 0 saves {"world_size", "sharded", "calls": {collective: count}, "rows"} to argv[1].
"""
import dataclasses
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _placement import ACCEL, SimulatedAccelerator  # noqa: E402

from fastrehearse.train import loop, parallelize  # noqa: E402
from fastrehearse.train.build import setup  # noqa: E402
from fastrehearse.train.config import load_config  # noqa: E402
from fastrehearse.train.parallelize import destroy_distributed, exit_worker, init_distributed  # noqa: E402

CALLS: Counter = Counter()


def _checked(name, sim, device):
    """torch.distributed.<name>, counted; a tensor argument must be where the compute device is (as
    NCCL demands), judged by where it would live on CUDA -- whatever helper called it."""
    real = getattr(dist, name)

    def wrapper(*a, **k):
        CALLS[name] += 1
        for t in list(a) + list(k.values()):
            if isinstance(t, torch.Tensor) and sim.device_of(t) != device:
                raise AssertionError(f"dist.{name} got a tensor on {sim.device_of(t)}, the compute "
                                     f"device is {device}")
        return real(*a, **k)
    return wrapper


def main(out_path: str, run_dir: str) -> None:
    os.environ["FASTREHEARSE_STRICT_COLLECTIVES"] = "1"
    cfg = load_config("configs/smoke.yaml", [f"run_dir={run_dir}", "eval.num_tasks=0", "log.progress=false",
                                             "rollout.tasks_per_step=2", "rollout.group_size=2",
                                             "rollout.max_new_tokens=8", "rollout.max_episode_tokens=512",
                                             "max_tokens=512"])
    info = dataclasses.replace(init_distributed("cpu"), device=ACCEL)
    rows = []
    sim = SimulatedAccelerator()
    parallelize._device_of = sim.device_of     # the strict check sees where tensors would be on CUDA
    # (dist.broadcast is left alone: torch's own set_model_state_dict places by param.device, which
    # the simulator cannot see through; the trainer itself never calls it)
    for name in ("all_reduce", "all_gather_object", "broadcast_object_list"):
        setattr(dist, name, _checked(name, sim, ACCEL))
    with sim:
        run = setup(cfg, info)
        rows.append(loop.sft_step(run))
        rows.append(loop.rl_step(run))
        stop = loop._agree_to_stop(run)
    if info.rank == 0:
        torch.save({"world_size": info.world_size, "sharded": info.sharded, "calls": dict(CALLS),
                    "rows": rows, "stop": stop}, out_path)
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_worker(0)   # a torchrun worker skips interpreter finalization; outside torchrun a no-op
