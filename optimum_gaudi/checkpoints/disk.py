"""A full disk, told as one line: free space where a path lives, and failures caused by ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError, exception_chain

MIN_FREE_BYTES = 1 << 20  # less than this free where --output_dir lives: the disk is full


def disk_full(path: str | os.PathLike, exc: BaseException | None = None) -> bool:
    """Whether a failure is the disk being full: ENOSPC somewhere in the chain, or almost no space left.

    torch.save reports a full disk as an opaque RuntimeError, hence the look at the free space."""
    for cause in exception_chain(exc):
        if getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(cause):
            return True
    return free_bytes(path) < MIN_FREE_BYTES


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    try:
        return shutil.disk_usage(_nearest_existing(Path(path))).free
    except OSError:
        return 1 << 62  # unknown: not full


class DiskFullError(UserError, OSError):
    """Saving failed because the disk is full."""


@contextlib.contextmanager
def disk_full_is_user_error(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn a failure while writing ``what`` under ``path`` into one line when the disk is full."""
    try:
        yield
    except Exception as e:
        if isinstance(e, UserError) or not disk_full(path, e):
            raise
        raise DiskFullError(
            f"no space left on the device of {path} while saving {what} ({free_bytes(path) // 1024} KiB free); "
            "free some space or choose another --output_dir, then resume with --resume_from_checkpoint true."
        ) from e
