"""Checkpoints that survive a crash, and an output directory that never mixes two runs.

- ``complete``: what a checkpoint is and when it is complete (manifest, weights, trainer state);
- ``fit``: whether a checkpoint holds the weights of this model (names and shapes, from headers);
- ``publish``: staging, manifest, fsync, the atomic rename, rotation (``--save_total_limit``);
- ``sharded``: FSDP's ``torch.distributed.checkpoint`` folders (every rank's shards, resharded on load);
- ``resume``: which checkpoint a run resumes from (``true``, a path, a job ``--max_restarts`` restarted);
- ``output_dir``: an ``--output_dir`` that holds another run is refused, and one a failed run touched restored;
- ``disk``: a full disk, told as one line;
- ``finite``: weights holding a NaN or inf are never published, and never resumed from with ``true``.

What other modules, the examples and user scripts import is re-exported here.
"""

from .complete import (
    MANIFEST_NAME,
    STAGING_PREFIX,
    TRAINER_STATE_NAME,
    CheckpointError,
    checkpoint_problem,
    checkpoint_step,
    latest_complete_checkpoint,
    list_checkpoints,
    model_saved_again,
    safetensors_shapes,
)
from .disk import MIN_FREE_BYTES, DiskFullError, disk_full, disk_full_is_user_error, free_bytes
from .finite import FINITE_MARKER, first_nonfinite, saved_nonfinite
from .fit import check_weights_fit, saved_weights
from .output_dir import OutputDirGuard, check_output_dir, remove_previous_checkpoints
from .publish import (
    BackgroundWrites,
    publish,
    remove_staging_leftovers,
    rotate_checkpoints,
    staged_checkpoint,
    write_manifest,
)
from .resume import (
    LAST_UNSAFE_WEIGHTS_ONLY_TORCH,
    RESTART_COUNT_ENV,
    check_resume_before_data,
    check_sharded_resume,
    resolve_resume,
    restart_count,
    resume_arg,
    tidy_before_resuming,
    warn_if_pickles_are_unsafe_here,
)
from .sharded import save_sharded_async

__all__ = [
    "FINITE_MARKER",
    "LAST_UNSAFE_WEIGHTS_ONLY_TORCH",
    "MANIFEST_NAME",
    "MIN_FREE_BYTES",
    "RESTART_COUNT_ENV",
    "STAGING_PREFIX",
    "TRAINER_STATE_NAME",
    "BackgroundWrites",
    "CheckpointError",
    "DiskFullError",
    "OutputDirGuard",
    "check_output_dir",
    "check_resume_before_data",
    "check_sharded_resume",
    "check_weights_fit",
    "checkpoint_problem",
    "checkpoint_step",
    "disk_full",
    "disk_full_is_user_error",
    "first_nonfinite",
    "free_bytes",
    "latest_complete_checkpoint",
    "list_checkpoints",
    "model_saved_again",
    "publish",
    "remove_previous_checkpoints",
    "remove_staging_leftovers",
    "resolve_resume",
    "restart_count",
    "resume_arg",
    "rotate_checkpoints",
    "safetensors_shapes",
    "saved_nonfinite",
    "save_sharded_async",
    "saved_weights",
    "staged_checkpoint",
    "tidy_before_resuming",
    "warn_if_pickles_are_unsafe_here",
    "write_manifest",
]
