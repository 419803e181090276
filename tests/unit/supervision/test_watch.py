"""The progress watchdog on the training loop's events (supervision/watch.py): what one train() starts it ends, and two
trainers in one process keep their own watchdogs and share the collective count without ending each other's.
The watchdog's decisions: tests/unit/supervision/test_watchdog_and_sigterm_agreement.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import TrainerControl, TrainerState

from optimum_gaudi.supervision import collective_count
from optimum_gaudi.supervision.watch import ProgressWatch


def arguments(tmp_path) -> SimpleNamespace:
    return SimpleNamespace(process_index=0, world_size=1, output_dir=str(tmp_path), hang_timeout=None,
                           hang_long_timeout=1800.0)  # fmt: skip


def ddp_module() -> torch.nn.parallel.DistributedDataParallel:
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))


def hooked(model) -> bool:
    return any(hook is collective_count._count_and_reduce for hook, _ in model._comm_hooks)


def running(watch: ProgressWatch) -> bool:
    return watch.watchdog is not None and watch.watchdog._thread.is_alive()


def test_a_training_loop_begun_again_ends_its_first_watchdog_and_counts_the_new_ddp_module(
    group_without_a_count, tmp_path
):
    """transformers runs its training loop again, without on_train_end, after an out-of-memory error under
    --auto_find_batch_size, with the model wrapped anew: before, the first loop's watchdog went on watching a step
    that never ended, and the new DDP module trained without the counting hook (the count was still running)."""
    args, state, control = arguments(tmp_path), TrainerState(), TrainerControl()
    wrapped = [ddp_module()]
    watch = ProgressWatch(wrapped_model=lambda: wrapped[0])
    watch.on_train_begin(args, state, control)
    first = watch.watchdog
    wrapped[0] = ddp_module()  # the loop begun again wraps the model again
    watch.on_train_begin(args, state, control)
    first._thread.join(timeout=10)
    assert not first._thread.is_alive() and running(watch) and hooked(wrapped[0])
    watch.on_train_end(args, state, control)
    assert collective_count.active() is None and not running(watch)


def test_two_trainers_in_one_process_keep_their_own_watchdog_and_the_count_until_the_last_ends(
    group_without_a_count, tmp_path
):
    """The second trainer's train() inside the first's: its end leaves the first's watchdog and count running."""
    original = dist.all_reduce
    args, state, control = arguments(tmp_path), TrainerState(), TrainerControl()
    models = ddp_module(), ddp_module()
    outer, inner = (ProgressWatch(wrapped_model=lambda model=model: model) for model in models)
    outer.on_train_begin(args, state, control)
    count = collective_count.active()
    inner.on_train_begin(args, state, control)
    assert collective_count.active() is count and all(hooked(model) for model in models)
    inner.on_train_end(args, state, control)
    assert running(outer) and collective_count.active() is count and dist.all_reduce is not original
    outer.on_train_end(args, state, control)
    assert collective_count.active() is None and dist.all_reduce is original
    outer.stop()  # the trainer's own stop after on_train_end: nothing more to end
    assert collective_count.active() is None
    later = ProgressWatch(wrapped_model=lambda: models[0])  # a third trainer, after both: a count of its own
    later.on_train_begin(args, state, control)
    assert collective_count.active() is not count and collective_count.active().counts == {}
    later.on_train_end(args, state, control)
