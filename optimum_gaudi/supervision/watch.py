"""The progress watchdog (supervision/watchdog.py) on the training loop's events: on by default in multi-process
runs (``--hang_timeout``; 0 turns it off). The first step, saves, evaluations and torch.compile's compilations may
take long without being a stall: each is watched with a limit of its own (``--hang_long_timeout`` or twice the
longest of its kind measured, :meth:`Watchdog.window_limit`). Where
the device compiles outside torch.compile's callbacks (a Gaudi: its first steps, new input shapes), those steps
are too, in every process the job starts (a restarted one compiles again)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from . import collective_count
from .agreement import default_store
from .watchdog import Watchdog

logger = logging.getLogger(__name__)

_serial = itertools.count()  # one set of store keys per train() in this process (the same order on every rank)


def watchdog_wanted(args: Any) -> bool:
    return args.world_size > 1 and args.hang_timeout != 0


class ProgressWatch(TrainerCallback):
    """Installed by GaudiTrainer around each ``train()`` of a multi-process run."""

    def __init__(self, device: Any = None, wrapped_model: Callable[[], Any] | None = None) -> None:
        self.watchdog: Watchdog | None = None
        self._counting = False  # this watch's share of the collective count (supervision/collective_count.py)
        self._wrapped_model = wrapped_model  # the DDP module, once accelerate made it: its reductions are counted
        self._compiling = False
        self._compiling_first_steps = getattr(device, "compiling_first_steps", 0)
        self._compiles_new_shapes = getattr(device, "compiles_new_shapes", False)
        self._steps_begun = 0  # in this process: a restarted one compiles again
        self._shapes: set[tuple] = set()
        self._new_shapes_steps = 0  # steps still to watch as compiling for new shapes (this one and the next)

    def on_train_begin(self, args, state, control, **kwargs):
        # transformers begins its training loop again, without ending it, after an out-of-memory error under
        # --auto_find_batch_size: the first loop's watchdog would go on watching a step that never ends
        self.stop()
        store = default_store()
        if store is None:
            return
        self.watchdog = Watchdog(
            store,
            args.process_index,
            args.world_size,
            args.output_dir,
            args.hang_timeout,
            serial=next(_serial),
            long_floor=args.hang_long_timeout,
        )
        self.watchdog.start()
        # where the backend numbers no collectives (HCCL), the project counts them: the verdict tells ranks apart
        model = self._wrapped_model() if self._wrapped_model is not None else None
        self._counting = collective_count.start(model) is not None
        _pause_during_compilation(self)
        if args.process_index == 0:
            limit = "derived from the run's step, save and evaluation times, at least 60 s"
            if args.hang_timeout is not None:
                limit = f"{args.hang_timeout:g} s"
            logger.info("Progress watchdog on (--hang_timeout: %s; 0 turns it off).", limit)
            if "TORCHELASTIC_RUN_ID" not in os.environ:  # DeepSpeed's launcher, mpirun: no elastic agent
                logger.warning(
                    "This job was not started by torchrun: a stalled rank ends it with the watchdog's report, but "
                    "nothing restarts it (optimum-gaudi launch --max_restarts needs torchrun's elastic agent)."
                )

    def on_step_begin(self, args, state, control, **kwargs):
        if self.watchdog is None:
            return
        self.watchdog.step_begin(state.global_step + 1)
        self._steps_begun += 1
        after_new_shapes, self._new_shapes_steps = self._new_shapes_steps > 0, max(0, self._new_shapes_steps - 1)
        if self._steps_begun <= self._compiling_first_steps:
            self.watchdog.compiling(f"step {self._steps_begun} of this process (its graphs compile)")
        elif after_new_shapes:
            self.watchdog.compiling("the step after new input shapes (their graphs compile at its first sync)")

    def note_inputs(self, inputs: Any) -> None:
        """A micro-batch's inputs: shapes not seen before make this step and the next compiling steps."""
        if self.watchdog is None or not self._compiles_new_shapes:
            return
        shapes = _shapes(inputs)
        if shapes not in self._shapes:
            self._shapes.add(shapes)
            self.watchdog.compiling("new input shapes (their graphs compile)")
            self._new_shapes_steps = 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.watchdog is None:
            return
        self.watchdog.step_end(state.global_step)
        if control.should_save or control.should_evaluate:  # until the next step begins: saves, evaluations, logs
            self.watchdog.pause("an evaluation" if control.should_evaluate else "a save")

    def on_train_end(self, args, state, control, **kwargs):
        self.stop()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self._counting:
            self._counting = False
            collective_count.stop()
        _stop_pausing_during_compilation(self)

    @contextlib.contextmanager
    def paused(self, what: str) -> Iterator[None]:
        if self.watchdog is None:
            yield
            return
        with self.watchdog.paused(what):
            yield

    # torch.compile's callbacks (run on the thread that compiles)
    def compilation_started(self, *args: Any) -> None:
        if self.watchdog is not None and self.watchdog._paused is None:
            self._compiling = True
            self.watchdog.pause("a compilation")

    def compilation_ended(self, *args: Any) -> None:
        if self.watchdog is not None and self._compiling:
            self._compiling = False
            self.watchdog.resume()


def _shapes(inputs: Any) -> tuple:
    """The shapes (and dtypes) of a batch's tensors, by key."""
    items = (
        inputs.items() if isinstance(inputs, dict) else enumerate(inputs if isinstance(inputs, list | tuple) else [])
    )
    return tuple((key, tuple(value.shape), str(value.dtype)) for key, value in items if isinstance(value, torch.Tensor))


def _compile_callbacks() -> Any:
    if "torch._dynamo" not in sys.modules:  # nothing compiles in this process: not worth importing it for
        return None
    with contextlib.suppress(Exception):
        return torch._dynamo.callback.callback_handler
    return None


def _pause_during_compilation(watch: ProgressWatch) -> None:
    handler = _compile_callbacks()
    if handler is not None:
        handler.register_start_callback(watch.compilation_started)
        handler.register_end_callback(watch.compilation_ended)


def _stop_pausing_during_compilation(watch: ProgressWatch) -> None:
    handler = _compile_callbacks()
    if handler is None:
        return
    with contextlib.suppress(ValueError):
        handler.remove_start_callback(watch.compilation_started)
    with contextlib.suppress(ValueError):
        handler.remove_end_callback(watch.compilation_ended)
