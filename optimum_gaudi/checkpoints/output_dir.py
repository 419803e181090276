"""An output directory that never mixes two runs, and is left as it was when a run fails before training."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..errors import UserError
from .complete import TRAINER_STATE_NAME, WEIGHT_FILES, _span, list_checkpoints
from .disk import MIN_FREE_BYTES, _nearest_existing
from .publish import remove_staging_leftovers
from .resume import restart_count, resume_arg

logger = logging.getLogger(__name__)


def check_output_dir(args: Any) -> None:
    """Before anything is written: ``--output_dir`` must be a writable directory with room, and must not hold
    another run's checkpoints or trained model (a run with --save_strategy no leaves no checkpoint) unless the
    user says to resume them or to overwrite them.

    ``args`` is the training arguments (``output_dir``, ``do_train``, ``resume_from_checkpoint``,
    ``overwrite_output_dir``); with ``--overwrite_output_dir`` GaudiTrainer.train deletes the old checkpoints.
    """
    out = Path(args.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {out} is a file, not a directory; choose another --output_dir.")
    existing = _nearest_existing(out)
    if not existing.is_dir():
        raise UserError(f"--output_dir {out}: {existing} is a file, not a directory; choose another --output_dir.")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".optimum-gaudi-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"--output_dir {out} is not writable ({e.strerror or e} in {existing}); choose another --output_dir."
        ) from None
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"--output_dir {out}: the disk is full ({free // 1024} KiB free); free some space or choose another."
        )
    if not getattr(args, "do_train", True) or resume_arg(getattr(args, "resume_from_checkpoint", None)) is not None:
        return
    if restart_count():  # a job restarted after a rank died: these checkpoints are its own, it resumes them
        return
    if getattr(args, "overwrite_output_dir", False):
        return
    previous = list_checkpoints(out)
    if previous:
        raise UserError(
            f"--output_dir {out} already holds checkpoints of a run ({_span(previous)}): add "
            "--resume_from_checkpoint true to continue it, or --overwrite_output_dir to start over (its checkpoints "
            "are deleted)."
        )
    model = [name for name in (TRAINER_STATE_NAME, *WEIGHT_FILES) if (out / name).is_file()]
    if model:
        raise UserError(
            f"--output_dir {out} already holds a trained model ({', '.join(model)}): choose another --output_dir, "
            "or add --overwrite_output_dir to replace it."
        )


def remove_previous_checkpoints(output_dir: str | os.PathLike) -> None:
    """--overwrite_output_dir: the previous run's checkpoints go when the new run starts training, so that a later
    resume cannot pick one of them (and a typo found before training deletes nothing)."""
    previous = list_checkpoints(output_dir)
    if previous:
        logger.warning("--overwrite_output_dir: deleting %d checkpoint(s) of the previous run.", len(previous))
    for path in previous:
        shutil.rmtree(path)
    remove_staging_leftovers(output_dir)


class OutputDirGuard(TrainerCallback):
    """Leaves ``--output_dir`` as it was when a run fails before training begins, so a bad input never leaves a
    half-filled directory behind. Use it as a context manager around building the trainer and training, and
    add it to the trainer's callbacks: from ``on_train_begin`` on, what is written is the run's own (complete
    checkpoints, logs) and is kept; a directory the run made and left empty (its first save failed, a full
    disk) still goes."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.output_dir = Path(output_dir).expanduser()
        self.enabled = enabled
        self._restores = enabled  # the process that saves restores the directory; the others leave it
        self._before: set[str] | None = None
        self._existed = False

    def __enter__(self) -> OutputDirGuard:
        self._existed = self.output_dir.is_dir()
        self._before = set(os.listdir(self.output_dir)) if self._existed else set()
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        self.enabled = False

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or not self._restores or not self.output_dir.is_dir():
            return
        if self.enabled:
            for name in set(os.listdir(self.output_dir)) - (self._before or set()):
                path = self.output_dir / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if not self._existed:
            with contextlib.suppress(OSError):
                self.output_dir.rmdir()  # only if empty: nothing of the run is lost
