"""Stragglers: at each logging step of a multi-process run, the slowest and the fastest rank's step time and which
ranks they are, in the logs and ``trainer_state.json``; a rank persistently slower than the median named once.

In synchronous training every rank's wall-clock step is the slowest rank's (the others wait for it in the
gradient reduction), so the time compared is each rank's step outside ``backward``, where DDP makes the fast
ranks wait: fetching the batch, the forward passes, the optimizer step. A slow card, host or data loader shows
there. On an accelerator these are the host's times (its kernels run asynchronously), which still catch a slow
host or data loader.

Measured with a few clock reads per step; the ranks' figures meet in one small gather over the host group at
logging steps only.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

PERSISTENT_INTERVALS = 3  # logging intervals in a row a rank must be slow to be named


class Stragglers(TrainerCallback):
    """Installed by GaudiTrainer around each ``train()`` of a multi-process run."""

    def __init__(self, threshold: float, host_group: Callable[[], Any]) -> None:
        self.threshold = threshold
        self._host_group = host_group  # the run's gloo group of every rank (ParallelLayout.host_group), on first use
        self._seconds = 0.0  # this logging interval's time outside backward, summed over its steps
        self._steps = 0
        self._step_seconds = 0.0
        self._last_end: float | None = None
        self._optimizer_began: float | None = None
        self._slow_in_a_row: dict[int, int] = {}
        self.named: set[int] = set()

    def forward_seconds(self, seconds: float) -> None:
        self._step_seconds += seconds

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.monotonic()
        if self._last_end is not None:  # the batch fetch (a step after a log, save or evaluation: not counted)
            self._step_seconds += now - self._last_end

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_began = time.monotonic()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._optimizer_began is not None:
            self._step_seconds += time.monotonic() - self._optimizer_began
            self._optimizer_began = None

    def on_step_end(self, args, state, control, **kwargs):
        self._seconds += self._step_seconds
        self._steps += 1
        self._step_seconds = 0.0
        interrupted = control.should_log or control.should_save or control.should_evaluate
        self._last_end = None if interrupted else time.monotonic()

    def log_keys(self, is_main: bool) -> dict[str, float | int]:
        """At a logging step, on every rank (a collective): the slowest and fastest rank of the interval."""
        mine = torch.tensor([self._seconds / max(self._steps, 1)], dtype=torch.float64)
        self._seconds, self._steps = 0.0, 0
        times = [torch.zeros(1, dtype=torch.float64) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(times, mine, group=self._host_group())
        seconds = [float(t) for t in times]
        slowest = max(range(len(seconds)), key=seconds.__getitem__)
        fastest = min(range(len(seconds)), key=seconds.__getitem__)
        if is_main and self.threshold > 0:
            self._name_persistent(seconds)
        return {
            "slowest_rank": slowest,
            "slowest_rank_step_time": round(seconds[slowest], 4),
            "fastest_rank": fastest,
            "fastest_rank_step_time": round(seconds[fastest], 4),
        }

    def _name_persistent(self, seconds: list[float]) -> None:
        median = statistics.median(seconds)
        for rank, value in enumerate(seconds):
            slow = median > 0 and value > (1 + self.threshold) * median
            self._slow_in_a_row[rank] = self._slow_in_a_row.get(rank, 0) + 1 if slow else 0
            if self._slow_in_a_row[rank] >= PERSISTENT_INTERVALS and rank not in self.named:
                self.named.add(rank)
                logger.warning(
                    "Rank %d has been slower than the median rank for %d logging intervals in a row: %.3g s vs %.3g s "
                    "a step outside backward (+%.0f%%). Every rank waits for it each step: look at its card, host or "
                    "data loading.",
                    rank,
                    PERSISTENT_INTERVALS,
                    value,
                    median,
                    100 * (value / median - 1),
                )
