"""Sharded checkpoints with torch.distributed.checkpoint (DCP), crash-safe.

Layout under run_dir/checkpoints/:
    step_00000012.tmp/     being written (ignored by --resume; removed by the next save)
    step_00000012/         complete: DCP shards (model + optimizer), trainer.pt (step, scheduler,
                           data cursor, ...), rng_rank{R}.pt per rank, and COMPLETE (json)

Each rank writes its own shards into the .tmp directory; after a barrier, rank 0 writes COMPLETE,
fsyncs it and renames the directory. A kill -9 at any moment leaves either a complete checkpoint or
a .tmp directory that is never picked (rename is atomic on POSIX filesystems). Multi-node runs
need run_dir on a filesystem every node sees (as torchtitan assumes).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from .parallelize import DistInfo, barrier, broadcast_object

_NAME = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    def __init__(self, run_dir: str | Path, info: DistInfo, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.info = info
        self.keep = keep

    # -- discovery ---------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        out = [p for p in self.root.iterdir()
               if p.is_dir() and _NAME.match(p.name) and (p / "COMPLETE").is_file()]
        return sorted(out, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    # -- save / load -------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, trainer_state: dict) -> Path:
        """Collective: every rank calls it. `trainer_state` (rank 0's) must be picklable."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():        # left by a run killed mid-write
                shutil.rmtree(tmp)
            if final.exists():      # re-saving the same step (e.g. SIGTERM right after a save)
                shutil.rmtree(final)
        barrier(self.info)
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                 no_dist=not self.info.sharded)
        torch.save(rng_state(), tmp / f"rng_rank{self.info.rank}.pt")
        if self.info.is_main:
            torch.save(trainer_state, tmp / "trainer.pt")
        barrier(self.info)
        if self.info.is_main:
            meta = {"step": step, "world_size": self.info.world_size, "time": time.time(),
                    "seconds": round(time.perf_counter() - t0, 3)}
            with open(tmp / "COMPLETE", "w") as f:
                json.dump(meta, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        barrier(self.info)
        return final

    def load(self, path: Path, model, optimizer) -> dict:
        """Collective. Restores model, optimizer and this rank's RNG; returns the trainer state."""
        path = Path(path)
        if not (path / "COMPLETE").is_file():
            raise ValueError(f"checkpoint {str(path)!r} is not complete (no COMPLETE marker)")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), no_dist=not self.info.sharded)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        rng = path / f"rng_rank{self.info.rank}.pt"
        if rng.is_file():   # absent when resuming on more ranks than were saved
            set_rng_state(torch.load(rng, weights_only=False))
        return torch.load(path / "trainer.pt", weights_only=False)

    def resolve_resume(self) -> Path | None:
        """Rank 0 picks the latest complete checkpoint and tells the others (same choice)."""
        latest = self.latest() if self.info.is_main else None
        latest = broadcast_object(str(latest) if latest else None, self.info)
        return Path(latest) if latest else None


def full_model_state_dict(model) -> dict:
    """Unsharded model state dict on CPU (collective; every rank gets it, fine for export)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
