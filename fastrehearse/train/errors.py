"""The trainer's errors, and the one place a full disk is recognised.

ConfigError (fastrehearse.train.config) is a user mistake found before work starts (exit code 2).
TrainingError is a run that cannot go on (exit code 1); DiskFullError is one of those, raised
wherever the trainer writes (checkpoints, metrics, export, summary) so the user reads "no space left
on device at PATH" instead of a torch serializer message such as "unexpected pos 704 vs 598".
"""
from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path

# torch's zip writer reports a short write as "unexpected pos N vs M" / "file write failed"
# without the errno; a nearly empty filesystem at that moment is the only cause seen.
_SHORT_WRITE = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")
_NEARLY_FULL_BYTES = 4 << 20


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. too many consecutive non-finite steps, a full disk)."""


class DiskFullError(TrainingError):
    """A write failed because the filesystem holding PATH is full."""


def _free_bytes(path: Path) -> int | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def is_disk_full(exc: BaseException, path: str | Path) -> bool:
    """True when `exc` (or anything in its cause chain) is ENOSPC / EDQUOT, or a torch short write
    while the filesystem holding `path` has less than 4 MiB free."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if any(s in text for s in _SHORT_WRITE):
            free = _free_bytes(Path(path))
            if free is not None and free < _NEARLY_FULL_BYTES:
                return True
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def disk_full_guard(path: str | Path, keeping: str = ""):
    """Turn a full-disk failure of the writes inside the block into DiskFullError(PATH)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - only re-labelled when it is a full disk
        if is_disk_full(e, path):
            raise DiskFullError(f"no space left on device at {path}" + (f"; {keeping}" if keeping else "")) from None
        raise
