"""The run directory and the resume policy: what a run leaves in run_dir, when a run_dir may be
reused (--resume / --overwrite), which settings a resumed run may change (RESUME_MAY_CHANGE,
`resume_changes`), and config.yaml."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .state import Run
from .checkpoint import Checkpointer
from .config import (
    ConfigError,
    TrainConfig,
    dump_config,
    move_renamed,
    read_config_dict,
    to_dict,
)
from .errors import disk_full_guard
from .parallelize import DistInfo, broadcast_object

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "export", "summary.json")
RUN_OUTPUTS = RUN_FILES + ("curves.png", "summary.md", "tb", "export.tmp")

# Keys (or sections, ending in ".") a resumed run may change: they take effect from the resumed
# step and are announced. Everything else (model, shapes, seed, data, rollout, loss, SFT layout)
# must match the checkpoint's config, or the resumed run would not be the run it claims to be.
RESUME_MAY_CHANGE = ("steps", "run_dir", "device", "max_tokens", "max_consecutive_skips",
                     "model.activation_checkpointing", "model.kernel_backend", "optim.", "sft.lr", "sft.warmup_steps",
                     "checkpoint.", "log.", "eval.", "dist.")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix + k).endswith("env.options"):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_changes(old: dict, new: dict) -> tuple[list, list]:
    """(allowed, forbidden) lists of (key, old value, new value) between two config dicts. The old
    one's renamed keys are read at their new paths (config.RENAMED_KEYS), as loading reads them; a
    key the old config lacks (added to the code since) counts as unchanged."""
    a, b = flatten(move_renamed(old)), flatten(move_renamed(new))
    allowed, forbidden = [], []
    for k in sorted(b):
        if k not in a or a[k] == b[k]:
            continue
        if k == "algo.loss.temperature" and a[k] is None:   # configs written before it was resolved
            continue
        ok = any(k == p or (p.endswith(".") and k.startswith(p)) for p in RESUME_MAY_CHANGE)
        (allowed if ok else forbidden).append((k, a[k], b[k]))
    return allowed, forbidden


def prepare_run_dir(cfg: TrainConfig, info: DistInfo, *, resume: bool, overwrite: bool) -> list[str]:
    """Checks on run_dir before anything is written or loaded (rank 0 decides, every rank agrees).

    Without --resume, a run_dir holding a run is refused unless --overwrite (which removes that
    run's outputs). With --resume, the config is compared with the latest checkpoint's: a changed
    key outside RESUME_MAY_CHANGE is refused naming it; allowed changes are announced.
    Returns the messages to print."""
    err, notes = None, []
    if info.is_main:
        try:
            notes = _check_run_dir(cfg, resume, overwrite)
        except ConfigError as e:
            err = str(e)
    err, notes = broadcast_object((err, notes), info)
    if err:
        raise ConfigError(err)
    return notes


def _check_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> list[str]:
    run_dir = Path(cfg.run_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: pick one")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir '{run_dir}' exists and is not a directory")
    found = [n for n in RUN_FILES if (run_dir / n).exists()
             and not ((run_dir / n).is_dir() and not any((run_dir / n).iterdir()))]
    if not resume:
        if found and not overwrite:
            raise ConfigError(f"run_dir '{run_dir}' already holds a run ({', '.join(found)}); pass "
                              f"--resume to continue it, --overwrite to replace it, or set another run_dir")
        if found:
            for n in RUN_OUTPUTS:
                q = run_dir / n
                if q.is_dir():
                    shutil.rmtree(q)
                elif q.exists():
                    q.unlink()
            return [f"--overwrite: removed the previous run's {', '.join(found)} from {run_dir}"]
        return []
    latest = Checkpointer(run_dir, DistInfo(0, 1, 0, torch.device("cpu"), None)).latest()
    if latest is None:
        return []
    old = read_config_dict(latest / "config.yaml") or read_config_dict(run_dir / "config.yaml")
    if old is None:
        return [f"--resume: no saved config to compare with in {latest} or {run_dir}; settings not checked"]
    allowed, forbidden = resume_changes(old, to_dict(cfg))
    if forbidden:
        changes = "; ".join(f"'{k}' {a!r} -> {b!r}" for k, a, b in forbidden)
        raise ConfigError(f"--resume cannot change {changes}: {latest.name} was trained with the old "
                          f"value(s). Resume with them, or start a new run_dir (docs/training.md lists "
                          f"what may change on resume)")
    step = int(latest.name.split("_")[1])
    return [f"--resume: '{k}' changed {a!r} -> {b!r} (takes effect from step {step})"
            for k, a, b in allowed]


def write_run_config(run: Run, resumed_at: int | None) -> None:
    """run_dir/config.yaml, written once the run has started (a resume: once the checkpoint loaded).
    A previous config.yaml that differs is kept as config.until_step_XXXXXXXX.yaml."""
    if not run.info.is_main:
        return
    run_dir = Path(run.cfg.run_dir)
    path = run_dir / "config.yaml"
    with disk_full_guard(path):
        if path.exists() and path.read_text() != run.config_text:
            kept = run_dir / f"config.until_step_{resumed_at or 0:08d}.yaml"
            os.replace(path, kept)
            run.logger.write(f"config.yaml changed; the previous one is kept as {kept.name}")
        dump_config(run.cfg, path)

