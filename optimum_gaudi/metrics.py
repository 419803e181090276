"""Throughput that leaves out the warm-up steps (graph compilation, allocator growth), and memory logs.

transformers measures throughput from the start of ``train()``; on an accelerator the first steps compile
graphs and can take minutes, so that number says little about the steady state people size jobs by.
"""

from __future__ import annotations

import logging
import time

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class ThroughputCallback(TrainerCallback):
    """Clocks training from the end of the ``warmup_steps``-th optimizer step of this ``train()`` call."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.tokens = 0  # input tokens seen by this process since the clock started
        self._first_step: int | None = None
        self._clock_step: int | None = None
        self._clock_time: float | None = None
        self._last_log: tuple[int, float, int] = (0, 0.0, 0)
        self.eval_begin()

    def on_train_begin(self, args, state, control, **kwargs):
        self._first_step = state.global_step
        self._clock_step = self._clock_time = None
        if self.warmup_steps == 0:
            self._start(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._clock_time is None and state.global_step - self._first_step >= self.warmup_steps:
            self._start(state.global_step)

    def _start(self, step: int) -> None:
        self._clock_step, self._clock_time, self.tokens = step, time.time(), 0
        self._last_log = (step, self._clock_time, 0)

    def interval(self, global_step: int, total_batch_size: int, world_size: int) -> dict[str, float]:
        """Throughput since the previous training log (nothing during warm-up), so it can be plotted."""
        if self._clock_time is None or global_step <= self._last_log[0]:
            return {}
        step, then, tokens = self._last_log
        now = time.time()
        self._last_log = (global_step, now, self.tokens)
        rates = {"interval_samples_per_second": round((global_step - step) * total_batch_size / (now - then), 3)}
        if self.tokens > tokens:
            rates["interval_tokens_per_second"] = round((self.tokens - tokens) * world_size / (now - then), 3)
        return rates

    def count_tokens(self, inputs: dict) -> None:
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if ids is not None and self._clock_time is not None and hasattr(ids, "numel"):
            self.tokens += ids.numel()

    def rewrite(self, metrics: dict, global_step: int, total_batch_size: int, world_size: int) -> None:
        """Replace the final train speed metrics by their post-warm-up values, in place."""
        if self._clock_time is None or global_step <= self._clock_step:
            logger.warning(
                "--throughput_warmup_steps %d covers every step of this run: throughput includes warm-up.",
                self.warmup_steps,
            )
            metrics["train_throughput_steps"] = global_step - (self._first_step or 0)
            return
        steps = global_step - self._clock_step
        runtime = time.time() - self._clock_time
        metrics["train_samples_per_second"] = round(steps * total_batch_size / runtime, 3)
        metrics["train_steps_per_second"] = round(steps / runtime, 3)
        if self.tokens:
            metrics["train_tokens_per_second"] = round(self.tokens * world_size / runtime, 3)
        metrics["train_throughput_steps"] = steps
        metrics["train_throughput_warmup_steps"] = self._clock_step - self._first_step

    # ---- evaluation: the first `warmup_steps` batches of each evaluation compile graphs too ------------

    def eval_begin(self) -> None:
        self._eval_batches, self._eval_samples, self._eval_clock = 0, 0, None

    def eval_batch(self, samples: int) -> None:
        self._eval_batches += 1
        if self._eval_clock is not None:
            self._eval_samples += samples
        elif self._eval_batches == self.warmup_steps:
            self._eval_clock = time.time()

    def rewrite_eval(self, metrics: dict, prefix: str) -> None:
        """Replace an evaluation's speed metrics by their values after its first `warmup_steps` batches."""
        if self.warmup_steps == 0 or self._eval_clock is None or not self._eval_samples:
            return  # nothing to leave out, or too few batches to leave any out: keep transformers' numbers
        runtime = time.time() - self._eval_clock
        batches = self._eval_batches - self.warmup_steps
        metrics[f"{prefix}_samples_per_second"] = round(self._eval_samples / runtime, 3)
        metrics[f"{prefix}_steps_per_second"] = round(batches / runtime, 3)
        metrics[f"{prefix}_throughput_steps"] = batches
