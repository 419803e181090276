"""torch.profiler wiring: one Chrome trace per rank for a window of optimizer steps, and named user regions.

Steps outside the window pay nothing: the profiler is created when the first profiled step begins and
dropped when the last one ends. Each rank writes ``profile_rank{N}.pt.trace.json`` (Chrome trace format),
which opens in chrome://tracing, https://ui.perfetto.dev and TensorBoard's profiler plugin (which finds
traces by the ``.pt.trace.json`` ending).

Mark your own regions, from a model's forward or a callback, so they show up by name in the trace::

    from optimum_gaudi.profiling import profile

    with profile("tokenize_on_the_fly"):
        ...

``profile`` costs one flag check when no profiler is running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["EvaluationProfiler", "GaudiProfilerCallback", "current_activities", "profile", "trace_path"]


@contextlib.contextmanager
def profile(name: str) -> Iterator[None]:
    """Time a region under ``name`` in the profiler trace; a no-op while no profiler is recording.

    Works as a context manager (``with profile("x"):``) and as a decorator (``@profile("x")``).
    """
    if not torch.autograd._profiler_enabled():
        yield
        return
    with torch.profiler.record_function(name):
        yield


def current_activities(activities: Sequence[Any] | None) -> list[Any]:
    """The activities as members of the enum torch.profiler has *now*.

    Habana's bridge replaces ``torch.profiler.ProfilerActivity`` when it loads and its profiler maps members of
    any other enum to nothing, so members bound before it loaded (an import, a default argument) would record
    an empty trace. Members are matched by name; None means CPU.
    """
    current = torch.profiler.ProfilerActivity
    names = [a.name for a in activities] if activities is not None else ["CPU"]
    return [getattr(current, name) for name in names if hasattr(current, name)]


def trace_path(output_dir: str | os.PathLike, rank: int, loop: str | None = None) -> Path:
    """Where a rank's trace goes: ``profile_rank{N}`` for training, ``profile_{loop}_rank{N}`` for an
    evaluation or prediction loop (``eval``, ``test``, ``prediction``)."""
    stem = f"profile_{loop}_rank{rank}" if loop else f"profile_rank{rank}"
    return Path(output_dir) / f"{stem}.pt.trace.json"


def _trace_settings(args: Any) -> dict[str, Any]:
    """What the training and the evaluation profiler both take from the arguments: what to record, where."""
    return dict(
        record_shapes=args.profiling_record_shapes,
        with_stack=args.profiling_with_stack,
        output_dir=Path(args.output_dir),
        rank=args.process_index,
        activities=args.gaudi_device.profiler_activities(),
    )


class GaudiProfilerCallback(TrainerCallback):
    """Profile optimizer steps ``warmup_steps + 1`` to ``warmup_steps + active_steps`` (1-based) with torch.profiler.

    The trace's ``ProfilerStep#0`` is optimizer step ``warmup_steps + 1``; the trace metadata says so
    (``optimum_gaudi_first_step``). If training stops inside the window, what was recorded is still written.
    """

    def __init__(
        self,
        warmup_steps: int = 0,
        active_steps: int = 1,
        record_shapes: bool = False,
        with_stack: bool = False,
        output_dir: str | os.PathLike = "profiling",
        rank: int = 0,
        activities: Sequence[ProfilerActivity] | None = None,
    ) -> None:
        if warmup_steps < 0 or active_steps < 1:
            raise ValueError(
                f"profiling needs warmup_steps >= 0 and active_steps >= 1, got {warmup_steps} and {active_steps}."
            )
        self.warmup_steps = warmup_steps
        self.active_steps = active_steps
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.output_dir = Path(output_dir)
        self.rank = rank
        self.activities = list(activities) if activities is not None else None  # None: CPU
        self.profiler: torch.profiler.profile | None = None
        self.trace_file: Path | None = None  # set once a trace has been written
        self._running: contextlib.ExitStack | None = None
        self._first_step = 0

    @classmethod
    def from_training_args(cls, args: Any) -> GaudiProfilerCallback | None:
        """The callback ``--profiling_*`` flags ask for (None when ``--profiling_steps`` is 0).

        Traces go to ``output_dir``; the device says which profiler activities it has.
        """
        if not args.profiling_steps:
            return None
        return cls(
            warmup_steps=args.profiling_warmup_steps,
            active_steps=args.profiling_steps,
            **_trace_settings(args),
        )

    @property
    def last_step(self) -> int:
        return self.warmup_steps + self.active_steps

    # ---- callback events ----------------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):
        # state.global_step counts finished optimizer steps, so the step beginning now is global_step + 1.
        # Resuming from a checkpoint inside the window profiles the rest of it.
        if self.profiler is None and self.warmup_steps <= state.global_step < self.last_step:
            self._start(first_step=state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None:
            return
        if state.global_step >= self.last_step:
            self._stop()
        else:
            self.profiler.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            logger.warning(
                "Training ended at step %d, inside the profiling window (steps %d-%d): writing the partial trace.",
                state.global_step,
                self._first_step,
                self.last_step,
            )
            self._stop()
        elif self.trace_file is None and state.global_step <= self.warmup_steps:
            logger.warning(
                "No profiler trace written: training ended at step %d, before the profiling window (steps %d-%d).",
                state.global_step,
                self.warmup_steps + 1,
                self.last_step,
            )

    # ---- profiler life cycle ------------------------------------------------------------------------

    def _start(self, first_step: int) -> None:
        active = self.last_step - first_step + 1
        with warnings.catch_warnings():
            # No profiler warm-up on purpose: the steps before the window must not pay for a started profiler.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=0, active=active, repeat=1)
        profiler = torch.profiler.profile(
            activities=current_activities(self.activities),
            schedule=schedule,
            on_trace_ready=self._export,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
        )
        self._first_step = first_step
        self._running = contextlib.ExitStack()
        self.profiler = self._running.enter_context(profiler)
        for key, value in {"optimum_gaudi_first_step": first_step, "optimum_gaudi_rank": self.rank}.items():
            profiler.add_metadata_json(key, json.dumps(value))

    def _stop(self) -> None:
        """Leave the profiler: the schedule ends with writing the trace (``_export``) if it hasn't yet."""
        running, self._running, self.profiler = self._running, None, None
        if running is not None:
            running.close()

    def _export(self, profiler: torch.profiler.profile) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = trace_path(self.output_dir, self.rank)
        profiler.export_chrome_trace(str(path))
        self.trace_file = path
        logger.info("Profiler trace (from step %d, rank %d) written to %s", self._first_step, self.rank, path)


class EvaluationProfiler:
    """Profile batches ``warmup_batches + 1`` to ``warmup_batches + active_batches`` of one evaluation or
    prediction loop (``--profiling_warmup_steps_eval`` / ``--profiling_steps_eval``, optimum-habana's flags).

    Each loop writes ``profile_{loop}_rank{N}.pt.trace.json`` (``eval``, ``test``, ``prediction``): the next
    loop of the same name overwrites it. A loop shorter than the window writes what it recorded.
    """

    def __init__(
        self,
        warmup_batches: int,
        active_batches: int,
        record_shapes: bool = False,
        with_stack: bool = False,
        output_dir: str | os.PathLike = "profiling",
        rank: int = 0,
        activities: Sequence[ProfilerActivity] | None = None,
    ) -> None:
        self.warmup_batches = warmup_batches
        self.active_batches = active_batches
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.output_dir = Path(output_dir)
        self.rank = rank
        self.activities = list(activities) if activities is not None else None
        self.trace_file: Path | None = None
        self._loop = "eval"
        self._batches = 0
        self._running: contextlib.ExitStack | None = None
        self._profiler: torch.profiler.profile | None = None

    @classmethod
    def from_training_args(cls, args: Any) -> EvaluationProfiler | None:
        if not getattr(args, "profiling_steps_eval", 0):
            return None
        return cls(
            warmup_batches=args.profiling_warmup_steps_eval,
            active_batches=args.profiling_steps_eval,
            **_trace_settings(args),
        )

    @contextlib.contextmanager
    def loop(self, name: str) -> Iterator[EvaluationProfiler]:
        """Around one evaluation or prediction loop; ``name`` names its trace."""
        self._loop, self._batches = name.lower().replace(" ", "_"), 0
        if self.warmup_batches == 0:
            self._start()
        try:
            yield self
        finally:
            self._stop()

    def batch_end(self) -> None:
        """After each batch of the loop: start, step or stop the profiler."""
        self._batches += 1
        if self._profiler is not None:
            if self._batches >= self.warmup_batches + self.active_batches:
                self._stop()
            else:
                self._profiler.step()
        elif self._batches == self.warmup_batches:
            self._start()

    def _start(self) -> None:
        self.trace_file = None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=0, active=self.active_batches, repeat=1)
        profiler = torch.profiler.profile(
            activities=current_activities(self.activities),
            schedule=schedule,
            on_trace_ready=self._export,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
        )
        self._running = contextlib.ExitStack()
        self._profiler = self._running.enter_context(profiler)

    def _stop(self) -> None:
        running, self._running, self._profiler = self._running, None, None
        if running is not None:
            running.close()

    def _export(self, profiler: torch.profiler.profile) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = trace_path(self.output_dir, self.rank, self._loop)
        profiler.export_chrome_trace(str(path))
        self.trace_file = path
        logger.info(
            "Profiler trace of %s batches %d-%d written to %s",
            self._loop,
            self.warmup_batches + 1,
            self.warmup_batches + self.active_batches,
            path,
        )
