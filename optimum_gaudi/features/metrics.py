"""Throughput that leaves out the warm-up steps (graph compilation, allocator growth), over the whole run.

transformers measures throughput from the start of ``train()``; on an accelerator the first steps compile
graphs and can take minutes, so that number says little about the steady state people size jobs by. The
meter counts the samples and tokens really fed to the model (never padding rows), and its totals travel
in checkpoints so a resumed run reports the whole run.

Keys that measure time or memory differ from run to run by nature; :func:`is_measurement_key` names them,
so comparisons (a resumed run against an uninterrupted one) can leave exactly those out.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_TIME_SUFFIXES = ("_runtime", "_per_second")
# our memory logs, transformers' memory tracker (train_mem_cpu_alloc_delta), and what a speed covered (a
# resumed run warms up again, so train_throughput_steps counts fewer steps than an uninterrupted run's)
_MEASUREMENT_MARKERS = (" (GB)", "_mem_", "_throughput_")


def is_measurement_key(key: str) -> bool:
    """True for a logged key that measures time or memory (differs between identical runs)."""
    return key.endswith(_TIME_SUFFIXES) or any(marker in key for marker in _MEASUREMENT_MARKERS)


class Throughput:
    """Clocks training from the end of the ``warmup_steps``-th optimizer step of each ``train()`` call.

    A resumed run starts with the totals saved in its checkpoint (see :meth:`totals`) and warms up again,
    since it compiles its graphs again.
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self._leaving_out = False  # inside left_out(True): an inner block is already timed
        self.samples = self.tokens = 0  # real rows and input tokens seen by this process since the clock started
        self._carried: dict[str, float] = {}
        self._begin: tuple[float, int, int] = (0.0, 0, 0)  # time, samples, tokens of this train() call, unclocked
        self._first_step: int | None = None
        self._clock_step: int | None = None
        self._clock_time: float | None = None
        self._last_log: tuple[int, float, int, int] = (0, 0.0, 0, 0)
        self._excluded = self._excluded_at_log = 0.0  # seconds the clock leaves out (--adjust_throughput)
        self.eval_begin()

    def train_begin(self, global_step: int, carried: dict[str, float] | None = None) -> None:
        self._carried = dict(carried or {})
        self._first_step = global_step
        self._begin = (time.time(), 0, 0)
        self._clock_step = self._clock_time = None
        if self.warmup_steps == 0:
            self._start(global_step)

    def step_end(self, global_step: int) -> None:
        if self._clock_time is None and global_step - self._first_step >= self.warmup_steps:
            self._start(global_step)

    def _start(self, step: int) -> None:
        self._clock_step, self._clock_time, self.samples, self.tokens = step, time.time(), 0, 0
        self._last_log = (step, self._clock_time, 0, 0)
        self._excluded = self._excluded_at_log = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` out of the clocked time (``--adjust_throughput``: evaluating, logging and saving
        during training, as optimum-habana leaves them out)."""
        if self._clock_time is not None:
            self._excluded += seconds

    @contextlib.contextmanager
    def left_out(self, active: bool) -> Iterator[None]:
        """Where ``active`` (``--adjust_throughput`` during training), the time spent inside is left out of the
        throughput (once, where such blocks nest: an evaluation inside a log)."""
        if not active or self._leaving_out:
            yield
            return
        self._leaving_out, start = True, time.perf_counter()
        try:
            yield
        finally:
            self._leaving_out = False
            self.exclude(time.perf_counter() - start)

    def count_batch(self, inputs: Any, rows: int | None) -> None:
        """Count a batch as fed to the training step, before any padding."""
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        tokens = ids.numel() if ids is not None and hasattr(ids, "numel") else 0
        begin_time, begin_samples, begin_tokens = self._begin
        self._begin = (begin_time, begin_samples + (rows or 0), begin_tokens + tokens)
        if self._clock_time is not None:
            self.samples += rows or 0
            self.tokens += tokens

    def totals(self, global_step: int) -> dict[str, float]:
        """Clocked steps, warm-up steps, samples, tokens (this process) and seconds of the run so far."""
        segment = {"steps": 0, "warmup_steps": global_step - (self._first_step or 0), "samples": 0, "tokens": 0}
        segment["seconds"] = 0.0
        if self._clock_time is not None:
            segment.update(steps=global_step - self._clock_step, samples=self.samples, tokens=self.tokens)
            segment["warmup_steps"] = self._clock_step - self._first_step
            segment["seconds"] = time.time() - self._clock_time - self._excluded
        return {key: self._carried.get(key, 0) + value for key, value in segment.items()}

    def interval(self, global_step: int, world_size: int) -> dict[str, float]:
        """Throughput since the previous training log (nothing during warm-up), so it can be plotted."""
        if self._clock_time is None or global_step <= self._last_log[0]:
            return {}
        step, then, samples, tokens = self._last_log
        now = time.time()
        seconds = max(now - then - (self._excluded - self._excluded_at_log), 1e-9)
        self._last_log, self._excluded_at_log = (global_step, now, self.samples, self.tokens), self._excluded
        rates = {"interval_samples_per_second": round((self.samples - samples) * world_size / seconds, 3)}
        if self.tokens > tokens:
            rates["interval_tokens_per_second"] = round((self.tokens - tokens) * world_size / seconds, 3)
        return rates

    def rewrite(self, metrics: dict, global_step: int, world_size: int) -> None:
        """Replace the final train speed metrics by their post-warm-up values over the whole run, in place."""
        totals = self.totals(global_step)
        if not totals["steps"]:
            logger.warning(
                "--throughput_warmup_steps %d covers every step of this run: throughput includes warm-up.",
                self.warmup_steps,
            )
            begin_time, samples, tokens = self._begin
            totals = {"steps": global_step - self._first_step, "warmup_steps": 0, "samples": samples}
            totals.update(tokens=tokens, seconds=time.time() - begin_time)
        metrics["train_throughput_steps"] = totals["steps"]
        metrics["train_throughput_warmup_steps"] = totals["warmup_steps"]
        seconds = max(totals["seconds"], 1e-9)
        metrics["train_samples_per_second"] = round(totals["samples"] * world_size / seconds, 3)
        metrics["train_steps_per_second"] = round(totals["steps"] / seconds, 3)
        if totals["tokens"]:
            metrics["train_tokens_per_second"] = round(totals["tokens"] * world_size / seconds, 3)

    # ---- evaluation: the first `warmup_steps` batches of each evaluation compile graphs too ------------

    def eval_begin(self) -> None:
        self._eval_batches, self._eval_samples, self._eval_clock = 0, 0, None

    def eval_batch(self, samples: int) -> None:
        self._eval_batches += 1
        if self._eval_clock is not None:
            self._eval_samples += samples
        elif self._eval_batches == self.warmup_steps:
            self._eval_clock = time.time()

    def rewrite_eval(self, metrics: dict, prefix: str, world_size: int) -> None:
        """Replace an evaluation's speed metrics by their values after its first `warmup_steps` batches; samples
        of every process, as transformers counts them."""
        if self.warmup_steps == 0 or self._eval_clock is None or not self._eval_samples:
            return  # nothing to leave out, or too few batches to leave any out: keep transformers' numbers
        runtime = time.time() - self._eval_clock
        batches = self._eval_batches - self.warmup_steps
        metrics[f"{prefix}_samples_per_second"] = round(self._eval_samples * world_size / runtime, 3)
        metrics[f"{prefix}_steps_per_second"] = round(batches / runtime, 3)
        metrics[f"{prefix}_throughput_steps"] = batches
