"""Which checkpoint a run resumes from, checked before any data is read or any step taken."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerState

from ..errors import quiet_logger
from .complete import (
    TRAINER_STATE_NAME,
    CheckpointError,
    checkpoint_problem,
    checkpoint_step,
    latest_complete_checkpoint,
    list_checkpoints,
    model_saved_again,
)
from .finite import newest_finite
from .fit import check_weights_fit
from .publish import remove_staging_leftovers, rotate_checkpoints
from .sharded import sharded_resume_problem

logger = logging.getLogger(__name__)


def resume_arg(value: str | bool | None) -> str | bool | None:
    """``--resume_from_checkpoint true`` (or ``last``) means the newest checkpoint in --output_dir."""
    if isinstance(value, str) and value.strip().lower() in {"true", "last"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"false", "none", ""}:
        return None
    return value


# Set by torchrun's elastic agent in each worker: how many times the job was restarted after a rank died.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times ``optimum-gaudi launch --max_restarts`` has restarted this job (0: the first attempt)."""
    try:
        return max(int(os.environ.get(RESTART_COUNT_ENV, "0")), 0)
    except ValueError:
        return 0


def check_resume_before_data(args: Any, model: Any = None) -> None:
    """The resume problems an example finds before it reads or tokenizes any data (CheckpointError, one line):
    the checkpoint must exist and be complete, and (given the model) hold the same weights. The trainer checks
    again when training starts, for scripts that do not call this; the warnings are left to that check."""
    if not getattr(args, "do_train", True):
        return
    with quiet_logger(__name__):  # the trainer's own check warns later
        checkpoint = resolve_resume(getattr(args, "resume_from_checkpoint", None), args.output_dir)
    if checkpoint is not None and model is not None:
        check_weights_fit(model, checkpoint)


def resolve_resume(resume: str | bool | None, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint directory to resume from, checked complete; raise CheckpointError with the reason.

    In a job restarted after a rank died, the newest complete checkpoint in ``output_dir`` (the job's own
    progress) wins over the command line's choice, which only held for the first attempt."""
    resume = resume_arg(resume)
    restarts = restart_count()
    if restarts:
        found = newest_finite_checkpoint(output_dir)
        if found is not None:
            logger.warning("Restart %d of this job: resuming from %s.", restarts, found)
            return str(found)
    if resume is None or resume is False:
        return None
    if resume is True:
        found = newest_finite_checkpoint(output_dir)
        if found is None:
            holds = list_checkpoints(output_dir)
            what = f"only incomplete checkpoints ({', '.join(p.name for p in holds)})" if holds else "no checkpoint"
            raise CheckpointError(
                f"No valid checkpoint found in output directory ({output_dir}): --resume_from_checkpoint true, but "
                f"--output_dir {output_dir} holds {what}; drop --resume_from_checkpoint to start a new run."
            )
        _say_model_saved_again(found)
        return str(found)
    problem = checkpoint_problem(resume)
    if problem:
        raise CheckpointError(
            f"Can't find a valid checkpoint at {resume}: --resume_from_checkpoint {resume} {problem}; pass a complete "
            "checkpoint-N directory, or 'true' for the newest one in --output_dir."
        )
    _say_model_saved_again(resume)
    return str(resume)


def newest_finite_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint whose weights are finite; newer ones holding a NaN or inf (an older run's:
    this one never publishes them) are skipped with one warning."""
    newest = latest_complete_checkpoint(output_dir)
    if newest is None:
        return None
    older = [p for p in reversed(list_checkpoints(output_dir)) if checkpoint_step(p) < checkpoint_step(newest)]
    found, skipped = newest_finite([newest, *(p for p in older if checkpoint_problem(p) is None)])
    if skipped:
        where = f"resuming from {found.name}" if found is not None else "no older complete checkpoint is finite"
        logger.warning("Skipping %s; %s.", "; ".join(skipped), where)
    return found


def check_sharded_resume(checkpoint: str | os.PathLike, fsdp_plugin: Any) -> None:
    """CheckpointError (one line) when this run cannot load the checkpoint's FSDP sharded weights: ``fsdp_plugin``
    is the run's (None without FSDP). transformers would fail later, after the model was wrapped, with a file
    not found or a page of traceback."""
    problem = sharded_resume_problem(checkpoint, fsdp_plugin)
    if problem:
        raise CheckpointError(f"--resume_from_checkpoint {checkpoint} {problem}.")


def _say_model_saved_again(checkpoint: str | os.PathLike) -> None:
    changed = model_saved_again(checkpoint)
    if changed:
        logger.warning(
            "%s: its model was saved again after the checkpoint was written (%s differ from its manifest); "
            "the weights there are complete: resuming from them.",
            Path(checkpoint).name,
            ", ".join(changed),
        )


def tidy_before_resuming(run_dir: str | os.PathLike, limit: int | None, resumed: str | None) -> None:
    """What a kill right after a publish leaves (its staging directory; with ``--save_total_limit``, one checkpoint
    too many, as rotation follows the publish) tidied when the next run starts, not at its first save. Checkpoints
    are rotated only when the run resumes (they are its own); the one it resumes from, the best one its state
    names and the newest complete one are kept."""
    remove_staging_leftovers(run_dir)
    if resumed is None:
        return
    try:
        best = TrainerState.load_from_json(os.path.join(resumed, TRAINER_STATE_NAME)).best_model_checkpoint
    except (OSError, ValueError):
        best = None
    rotate_checkpoints(run_dir, limit, keep={resumed, best})


# weights_only's unpickler itself could be bypassed up to this torch release (CVE-2026-24747; docs/security.md)
LAST_UNSAFE_WEIGHTS_ONLY_TORCH = (2, 9, 1)
_PICKLED_STATE = ("optimizer.pt", "scheduler.pt", "scaler.pt", "pytorch_model.bin")


def warn_if_pickles_are_unsafe_here(checkpoint: str | os.PathLike) -> None:
    """One warning when this checkpoint's pickles will be loaded by a torch whose ``weights_only`` loader is known
    to be bypassable: a checkpoint from someone else could run code here."""
    import torch

    release = tuple(int(part) for part in re.findall(r"\d+", torch.__version__.split("+")[0])[:3])
    if release > LAST_UNSAFE_WEIGHTS_ONLY_TORCH:
        return
    directory = Path(checkpoint)
    pickles = sorted(p.name for p in directory.iterdir() if p.name in _PICKLED_STATE or p.name.startswith("rng_state"))
    if pickles:
        logger.warning(
            "Resuming from %s loads pickles (%s) with torch %s, whose weights_only loader can be bypassed "
            "(CVE-2026-24747, fixed after torch 2.9.1): resume only from checkpoints you trust, or upgrade torch.",
            directory,
            ", ".join(pickles),
            torch.__version__,
        )
