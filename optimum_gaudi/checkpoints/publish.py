"""Writing a checkpoint so that it appears complete or not at all.

The trainer writes ``checkpoint-N`` inside a staging directory beside it (``OUTPUT_DIR/.staging-checkpoint-N/
checkpoint-N``): every rank writes its part there (the main process alone under DDP, every rank under DeepSpeed
or FSDP). After a barrier the saving process lists every file with its size in ``checkpoint_manifest.json``,
fsyncs the files and directories, and renames the directory to ``OUTPUT_DIR/checkpoint-N``: one atomic rename on
one file system. A kill at any moment leaves no ``checkpoint-N`` or a complete one; staging leftovers are never
resumed from, and are removed when the next run starts and by the next save. With ``--async_save`` the
publish waits, off the training path, for the shards DCP writes in the background (:class:`BackgroundWrites`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .complete import (
    MANIFEST_NAME,
    STAGING_NAME,
    STAGING_PREFIX,
    TRAINER_STATE_NAME,
    checkpoint_problem,
    list_checkpoints,
)
from .disk import disk_full_is_user_error

logger = logging.getLogger(__name__)


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path) -> None:
    """List every file and its size, and make all of it durable: files, then the manifest, then directories."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    for path in files:
        _fsync(path)
    listed = {str(p.relative_to(directory)): p.stat().st_size for p in files}
    manifest = directory / MANIFEST_NAME
    with manifest.open("w", encoding="utf-8") as f:
        json.dump({"files": listed}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({p.parent for p in files} | {directory}, key=lambda p: len(p.parts), reverse=True):
        _fsync(sub)


def remove_staging_leftovers(run_dir: str | os.PathLike) -> None:
    """Staging directories of saves that never finished (the process was killed): ours only, by their names."""
    directory = Path(run_dir)
    if directory.is_dir():
        for leftover in directory.iterdir():
            if STAGING_NAME.match(leftover.name) and leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)


def publish(staged: Path, final: Path) -> None:
    """Rename the staged checkpoint into place. One that exists already (the same step saved again) is moved
    aside first: a kill between the two renames leaves the previous complete checkpoint to resume from."""
    old = final.parent / f"{STAGING_PREFIX}replaced-{final.name}"
    if final.exists():
        os.replace(final, old)
    os.replace(staged, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def rotate_checkpoints(run_dir: str | os.PathLike, limit: int | None, keep: set[str | None]) -> None:
    """Keep at most ``limit`` checkpoints: delete incomplete ones first, then the oldest; never ``keep`` nor the
    newest complete one."""
    if not limit or limit <= 0:
        return
    checkpoints = list_checkpoints(run_dir)
    if len(checkpoints) <= limit:
        return
    complete = [p for p in checkpoints if checkpoint_problem(p) is None]
    protected = {str(Path(k).resolve()) for k in keep if k} | ({str(complete[-1].resolve())} if complete else set())
    incomplete = [p for p in checkpoints if p not in complete]
    remaining = len(checkpoints)
    for candidate in incomplete + complete:
        if remaining <= limit:
            break
        if str(candidate.resolve()) not in protected:
            logger.info("Deleting %s (--save_total_limit %d).", candidate, limit)
            shutil.rmtree(candidate, ignore_errors=True)
            remaining -= 1


def _publish_checkpoint(staged: Path, run_dir: Path, limit: int | None, best: str | None) -> None:
    """Manifest, atomic rename into ``run_dir``, then ``save_total_limit`` (never deleting ``best``)."""
    final = run_dir / staged.name
    write_manifest(staged)
    publish(staged, final)
    rotate_checkpoints(run_dir, limit, keep={str(final), best})


class BackgroundWrites:
    """Checkpoint files still being written in the background (``--async_save``: DCP's ``async_save`` futures),
    and what follows once they are written: the checkpoint they belong to is published. ``poll`` publishes it
    when every write is done, without waiting; ``wait`` waits for them (before the next save, at the end)."""

    def __init__(self) -> None:
        self._futures: list[Future] = []
        self._then: Callable[[list[Future]], None] | None = None

    @property
    def pending(self) -> bool:
        return bool(self._futures)

    def add(self, futures: list[Future]) -> None:
        self._futures.extend(futures)

    def then(self, action: Callable[[list[Future]], None]) -> None:
        self._then = action

    def poll(self) -> None:
        if self._futures and all(f.done() for f in self._futures):
            self.wait()

    def wait(self) -> None:
        futures, then = self._futures, self._then
        self._futures, self._then = [], None
        if then is not None:
            then(futures)
        else:
            for future in futures:
                future.result()


def _name_earlier_best(run_dir: Path, state: Any, args: Any) -> None:
    """Trainer._save_checkpoint names the best checkpoint when ``checkpoint-{best_global_step}`` exists where it
    saves; it saves into the staging root, where only this step's checkpoint is. A best checkpoint saved
    earlier (its step saved before the evaluation that made it the best) is looked for in ``run_dir`` here,
    under the same conditions, so that rotation keeps it and the end of training loads it."""
    step = getattr(state, "best_global_step", None)
    if not step or step == state.global_step or args.save_strategy == "no":
        return
    earlier = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    if earlier.exists():
        state.best_model_checkpoint = str(earlier)


@contextlib.contextmanager
def staged_checkpoint(
    run_dir: str | os.PathLike,
    state: Any,
    args: Any,
    barrier: Callable[[], None],
    writes: BackgroundWrites | None = None,
) -> Iterator[Path]:
    """Yield the staging root to write ``checkpoint-{state.global_step}`` into, as if it were ``run_dir``; when
    the body is done publish the checkpoint atomically, then apply ``args.save_total_limit``.

    Every rank enters and leaves together (``barrier``, e.g. ``accelerator.wait_for_everyone``); the process with
    ``args.should_save`` (the main one, or each node's with save_on_each_node) publishes. A failure removes the
    staging directory; a full disk is reported as one line (DiskFullError). When the body left files being
    written in the background (``writes`` pending), the publish waits for them: ``writes.poll()`` or
    ``writes.wait()`` does it once they are written (DCP's coordinator, rank 0, finishes after every rank wrote).
    """
    run_dir = Path(run_dir)
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging_root = run_dir / f"{STAGING_PREFIX}{name}"
    saver = bool(args.should_save)
    if saver:
        remove_staging_leftovers(run_dir)
    barrier()
    _name_earlier_best(run_dir, state, args)
    deferred = False
    try:
        with disk_full_is_user_error(run_dir, name):
            yield staging_root
            best = state.best_model_checkpoint
            if best is not None and Path(best).parent == staging_root:
                # transformers found the best checkpoint where it wrote this one: name its final place
                state.best_model_checkpoint = str(run_dir / Path(best).name)
                if saver and (staging_root / name / TRAINER_STATE_NAME).is_file():
                    state.save_to_json(str(staging_root / name / TRAINER_STATE_NAME))
            barrier()
            staged = staging_root / name if saver and (staging_root / name).is_dir() else None
            finish = functools.partial(
                _finish_publish, staged, run_dir, args.save_total_limit, state.best_model_checkpoint, staging_root
            )
            if writes is not None and writes.pending:
                writes.then(finish)
                deferred = True
            else:
                finish([])
    finally:
        if saver and not deferred:
            shutil.rmtree(staging_root, ignore_errors=True)
    barrier()


def _finish_publish(
    staged: Path | None, run_dir: Path, limit: int | None, best: str | None, staging_root: Path, written: list[Future]
) -> None:
    """Once ``written`` (background writes) are done: publish ``staged`` (the saving process; None on the others)."""
    try:
        with disk_full_is_user_error(run_dir, staging_root.name.removeprefix(STAGING_PREFIX)):
            for future in written:
                future.result()
            if staged is not None:
                _publish_checkpoint(staged, run_dir, limit, best)
    finally:
        if staged is not None:
            shutil.rmtree(staging_root, ignore_errors=True)
