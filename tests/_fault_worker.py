"""torchrun worker for tests/test_train_failures.py: `fastrehearse train` with one fault planted
on one rank. FR_FAULT="PHASE:RANK:KIND": PHASE update (AdamW.step), rollout (the rollout call) or
checkpoint (Checkpointer.save); KIND raise (RuntimeError) or hang (sleeps, alive, holding nobody's
lock). Every rank writes its pid to FR_PID_DIR/rank{R}.pid first (the launcher-death test)."""
import os
import sys
import time
from pathlib import Path

RANK = int(os.environ.get("RANK", "0"))


def plant(where: str, rank: int, kind: str) -> None:
    if rank != RANK:
        return

    def fault(*a, **k):
        if kind == "hang":
            time.sleep(3600)
        raise RuntimeError(f"injected fault in {where} on rank {RANK}")

    if where == "update":
        import torch
        torch.optim.AdamW.step = fault
    elif where == "rollout":
        import fastrehearse.train.loop as loop
        loop.rollout = fault
    elif where == "checkpoint":
        from fastrehearse.train.checkpoint import Checkpointer
        Checkpointer.save = fault
    else:
        raise ValueError(where)


if __name__ == "__main__":
    if os.environ.get("FR_PID_DIR"):
        (Path(os.environ["FR_PID_DIR"]) / f"rank{RANK}.pid").write_text(str(os.getpid()))
    if os.environ.get("FR_FAULT"):
        w, r, k = os.environ["FR_FAULT"].split(":")
        plant(w, int(r), k)
    from fastrehearse.cli import train_main
    from fastrehearse.train.parallelize import exit_worker
    sys.exit(exit_worker(train_main(sys.argv[1:], prog="fastrehearse train")))
