"""Run supervision as one object: preemption (SIGTERM), the non-finite guard, the progress watchdog and the
straggler figures, installed by ``train()`` for its duration and idle outside it.

The trainer tells it what it sees (a batch's inputs, a loss, a gradient norm, a forward's time, a save) and asks
it for its log keys; it never asks which of the four is on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from .nonfinite import NonFiniteGuard
from .preemption import Preemption
from .stragglers import Stragglers
from .watch import ProgressWatch, watchdog_wanted


class RunSupervision:
    """The four supervisors of one trainer's run; each is None outside ``installed()`` (and the watchdog and the
    straggler figures in a one-process run)."""

    def __init__(self) -> None:
        self.preemption: Preemption | None = None
        self.guard: NonFiniteGuard | None = None  # non-finite steps stopped or skipped
        self.watch: ProgressWatch | None = None  # multi-process: the progress watchdog
        self.stragglers: Stragglers | None = None  # multi-process: each rank's step times

    @contextlib.contextmanager
    def installed(self, trainer: Any) -> Iterator[Preemption]:
        """The supervisors made for this run and added to ``trainer``'s callbacks (in this order: the watchdog
        sees the save SIGTERM asks for); all taken off after. The caller installs SIGTERM's handler
        (``preemption.installed()``) where the loop runs."""
        args = trainer.args
        several = args.world_size > 1 and torch.distributed.is_initialized()
        self.preemption = Preemption()
        self.guard = NonFiniteGuard(trainer)
        if several and watchdog_wanted(args):
            self.watch = ProgressWatch(trainer.gaudi_device, lambda: trainer.model_wrapped)
        if several:
            self.stragglers = Stragglers(args.straggler_threshold, trainer._layout.host_group)
        installed = [c for c in (self.preemption, self.guard, self.watch, self.stragglers) if c is not None]
        for callback in installed:
            trainer.add_callback(callback)
        try:
            yield self.preemption
        finally:
            if self.watch is not None:
                self.watch.stop()
            for callback in installed:
                trainer.remove_callback(callback)
            self.preemption = self.guard = self.watch = self.stragglers = None

    def note_inputs(self, inputs: Any) -> None:
        """Before the forward: new shapes compile in it (or at its next sync), which the watchdog allows for."""
        if self.watch is not None:
            self.watch.note_inputs(inputs)

    def note_loss(self, loss: torch.Tensor) -> None:
        if self.guard is not None:
            self.guard.note_loss(loss)

    def note_grad_norm(self, norm: Any) -> None:
        """Checked before the optimizer step (supervision/nonfinite.py)."""
        if self.guard is not None:
            self.guard.note_grad_norm(norm)

    def paused(self, what: str) -> contextlib.AbstractContextManager:
        """A window with a limit of its own (a save): the watchdog's step limit does not apply inside it."""
        return self.watch.paused(what) if self.watch is not None else contextlib.nullcontext()

    def time_forward(self, stack: contextlib.ExitStack) -> None:
        """The forward about to run inside ``stack`` timed for the straggler figures (where they are counted)."""
        if self.stragglers is not None:
            began, stragglers = time.monotonic(), self.stragglers
            stack.callback(lambda: stragglers.forward_seconds(time.monotonic() - began))

    def log_keys(self, is_main: bool) -> dict[str, float | int]:
        """The straggler figures (a gather on every rank of a multi-process run) and the guard's counts."""
        keys: dict[str, float | int] = {}
        if self.stragglers is not None:
            keys.update(self.stragglers.log_keys(is_main))
        if self.guard is not None:
            keys.update(self.guard.log_keys())
        return keys
