"""Sharded checkpoints with torch.distributed.checkpoint (DCP), crash-safe.

Layout under run_dir/checkpoints/:
    step_00000012.tmp/     being written (ignored by --resume; removed by the next save)
    step_00000012/         complete: DCP shards (model + optimizer), trainer.pt (step, scheduler,
                           data cursor, ...), rng_rank{R}.pt per rank, and COMPLETE (json)

Each rank writes its own shards into the .tmp directory; after a barrier, rank 0 writes COMPLETE,
fsyncs it and renames the directory. A kill -9 at any moment leaves either a complete checkpoint or
a .tmp directory that is never picked (rename is atomic on POSIX filesystems). Multi-node runs
need run_dir on a filesystem every node sees (as torchtitan assumes).

Integrity: the weights are checked finite before anything is written (a checkpoint of NaN weights
is never marked COMPLETE); a failed write (a full disk included) removes the .tmp directory and
keeps every complete checkpoint; rotation never deletes the checkpoint just written. On resume a
checkpoint that fails to load is renamed step_XXXXXXXX.unloadable (kept for inspection, never
picked again) and the previous complete one is used.
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from fastrehearse.dtensor import local_shard

from .errors import DiskFullError, TrainingError, is_disk_full
from .parallelize import DistInfo, all_gather_object, barrier, broadcast_object

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


def numerics(info: DistInfo) -> dict:
    """What decides the summation order of every fp32 sum, so whether a resumed run can repeat an
    uninterrupted one bit for bit: torch's version, the CPU instruction set its kernels dispatch
    to (ATEN_CPU_CAPABILITY), its thread count, the accelerator's name, the world size. Correct
    under any of them; identical only under the same ones (docs/training.md, "Checkpoints, resume, export")."""
    dev = info.device
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "world_size": info.world_size,
            "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type)}


def numerics_note(saved: dict | None, now: dict) -> str | None:
    """One line when a checkpoint was written under other numerics than this run's (None if the
    same, or if the checkpoint predates the record)."""
    if not saved:
        return None
    diff = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if not diff:
        return None
    return ("note: this checkpoint was written under other numerics (" + ", ".join(diff) + "); the "
            "run continues correctly, but its losses will not repeat an uninterrupted run's bit for "
            "bit (that needs the same torch, instruction set, thread count, device and world size)")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def nonfinite_keys(state_dict: dict, limit: int = 3) -> list[str]:
    """Names of (this rank's shards of) floating tensors holding NaN or inf."""
    bad = []
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(local_shard(v)).all()):
            bad.append(k)
            if len(bad) >= limit:
                break
    return bad


def _one_line(e: BaseException) -> str:
    """The informative line of an error (DCP wraps the cause's traceback: its last line)."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    return (lines[-1] if lines else type(e).__name__)[:240]


class Checkpointer:
    def __init__(self, run_dir: str | Path, info: DistInfo, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.info = info
        self.keep = keep
        self.pinned: Path | None = None    # never rotated away (eval.every's best checkpoint)

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
    def save(self, step: int, model, optimizer, trainer_state: dict, config_text: str | None = None) -> Path:
        """Collective: every rank calls it. `trainer_state` (rank 0's) must be picklable;
        `config_text` (the run's config.yaml) is stored beside it for resume checks.

        Raises TrainingError (weights not finite) or DiskFullError (nothing marked COMPLETE, the
        .tmp directory removed, earlier checkpoints untouched)."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        bad = all_gather_object(nonfinite_keys(model_sd), self.info)
        if any(bad):
            names = sorted({k for b in bad for k in b})[:3]
            raise TrainingError(f"weights are not finite at step {step} ({', '.join(names)}); checkpoint "
                                f"not written, last complete one kept: {self.latest()}")
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():        # left by a run killed mid-write
                shutil.rmtree(tmp)
        barrier(self.info)
        t0 = time.perf_counter()
        err = None
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                     no_dist=not self.info.sharded)
            torch.save(rng_state(), tmp / f"rng_rank{self.info.rank}.pt")
            if self.info.is_main:
                torch.save(trainer_state, tmp / "trainer.pt")
                if config_text is not None:
                    (tmp / "config.yaml").write_text(config_text)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - (a BaseException) every
            err = e                                   # rank must learn about any rank's failure
        errs = all_gather_object(None if err is None else (repr(err), is_disk_full(err, tmp)), self.info)
        if any(errs):
            if self.info.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            keeping = f"last complete checkpoint kept: {self.latest()}"
            if any(e and e[1] for e in errs):
                raise DiskFullError(f"no space left on device at {tmp}; {keeping}") from None
            if err is not None:
                raise err
            raise TrainingError(f"checkpoint {tmp} failed on another rank: "
                                f"{next(e[0] for e in errs if e)}; {keeping}")
        barrier(self.info)
        if self.info.is_main:
            meta = {"step": step, "world_size": self.info.world_size, "time": time.time(),
                    "seconds": round(time.perf_counter() - t0, 3), "numerics": numerics(self.info)}
            try:
                with open(tmp / "COMPLETE", "w") as f:
                    json.dump(meta, f)
                    f.flush()
                    os.fsync(f.fileno())
                _fsync_dir(tmp)
                if final.exists():      # re-saving the same step (e.g. SIGTERM right after a save)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(self.root)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                if is_disk_full(e, tmp):
                    raise DiskFullError(f"no space left on device at {tmp}; last complete checkpoint "
                                        f"kept: {self.latest()}") from None
                raise
            self._rotate(final)
        barrier(self.info)
        return final

    def _rotate(self, newest: Path) -> None:
        """Keep `newest` (the checkpoint just written) and the keep-1 highest older ones. Later steps
        (left by a run this one resumed before) are not rotation's to delete."""
        n = int(_NAME.match(newest.name).group(1))
        older = [p for p in self.complete() if int(_NAME.match(p.name).group(1)) < n]
        for old in older[:max(0, len(older) - (self.keep - 1))]:
            if self.pinned is None or old.resolve() != self.pinned.resolve():
                shutil.rmtree(old, ignore_errors=True)

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

    def numerics_note(self, path: Path) -> str | None:
        """numerics_note for the checkpoint at `path` against this process (rank 0's view)."""
        try:
            saved = json.loads((Path(path) / "COMPLETE").read_text()).get("numerics")
        except (OSError, ValueError, AttributeError):
            return None
        return numerics_note(saved, numerics(self.info))

    def resolve_resume(self) -> Path | None:
        """Rank 0 picks the latest complete checkpoint and tells the others (same choice)."""
        latest = self.latest() if self.info.is_main else None
        latest = broadcast_object(str(latest) if latest else None, self.info)
        return Path(latest) if latest else None

    def load_latest(self, model, optimizer, log=print) -> tuple[Path | None, dict | None]:
        """Collective. Load the newest complete checkpoint that loads (finite weights included),
        newest first; each one that fails is reported through `log` and renamed
        step_XXXXXXXX.unloadable. Returns (path, trainer state), or (None, None) if there is none."""
        while True:
            path = self.resolve_resume()
            if path is None:
                return None, None
            err = None
            try:
                state = self.load(path, model, optimizer)
                bad = nonfinite_keys(get_state_dict(model, optimizer)[0])
                if bad:
                    raise ValueError(f"non-finite weights ({', '.join(bad)})")
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - any load failure:
                err = _one_line(e)                           # fall back to an older one
            errs = [e for e in all_gather_object(err, self.info) if e]
            if not errs:
                return path, state
            if self.info.is_main:
                dest = path.with_name(path.name + ".unloadable")
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(path, dest)
                log(f"--resume: checkpoint {path} failed to load ({errs[0]}); moved to {dest.name}, "
                    f"trying the previous complete checkpoint")
            barrier(self.info)

def full_model_state_dict(model) -> dict:
    """Unsharded model state dict on CPU (collective; every rank gets it, fine for export)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
