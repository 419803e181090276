"""Preemption: SIGTERM (Slurm, Kubernetes, ``optimum-gaudi launch`` passing it on) during ``train()`` finishes
the optimizer step in flight, writes a complete checkpoint and ends the process with exit code 143.

The handler only sets a flag; the step end acts on it. Under several processes the ranks first agree on the step
to stop after (supervision/agreement.py: through the job's store, no collective on steps where nobody asked),
because a checkpoint is a collective: ranks that stopped at different steps would wait for each other forever.
When every rank got the signal they stop after the step in flight; when only some did, after the one that
follows (their peers may have ended the step in flight already), so the orchestrator's grace period must cover
that and one checkpoint; the log says how long a step and the last checkpoint took when the signal came.

Two things would spend that grace period or waste the checkpoint: a launcher killed outright (SIGKILL) leaves
its ranks writing into a pipe nobody reads, where every write fails (the checkpoint would fail at its first
progress bar), so from the signal on such output is dropped (:class:`OutputThatCannotFail`); and once the
checkpoint is published the process ends at once (:func:`exit_after_checkpoint`) instead of spending seconds
freeing every object at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

from .agreement import StopAgreement, default_store

logger = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM


class Preemption(TrainerCallback):
    """Installed by GaudiTrainer around each ``train()``; ``stopped`` says whether the run ended on SIGTERM."""

    def __init__(self) -> None:
        self.requested = False  # set by the signal handler, on this rank only
        self.stopped = False  # every rank agreed to stop, and the checkpoint was asked for
        self.stop_step: int | None = None
        self._agreement: StopAgreement | None = None  # how the ranks agree (None: one process)
        self._step_started = 0.0
        self.step_seconds = 0.0
        self.save_seconds: float | None = None
        self._save_started: float | None = None
        self.output = OutputThatCannotFail()  # installed at the signal

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.requested = True  # no I/O here: the step end logs and saves
        self.output.install()  # as early as can be: the launcher may be gone already

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The SIGTERM handler for the duration of ``train()`` (main thread only: Python allows no other);
        the previous one is put back unless someone replaced ours meanwhile (transformers' JIT checkpoint
        callback restores its own predecessor at train end)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, previous)
            if not self.stopped:  # a signal too late to stop training: the script goes on, its output as it was
                self.output.restore()

    def on_train_begin(self, args, state, control, **kwargs):
        store = default_store() if args.world_size > 1 else None
        self._agreement = StopAgreement(store, args.process_index, args.world_size) if store is not None else None

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.monotonic()
        self.step_seconds = now - self._step_started
        if self._agreed(state.global_step):
            self.stopped, self.stop_step = True, state.global_step
            self.output.install()  # a rank that agreed to stop without the signal of its own
            logger.warning(
                "SIGTERM: stopping after step %d, writing its checkpoint (the step took %.1f s%s).",
                state.global_step,
                self.step_seconds,
                "" if self.save_seconds is None else f", the last checkpoint {self.save_seconds:.1f} s",
            )
            control.should_save = True
            control.should_training_stop = True
        if control.should_save:
            self._save_started = now

    def on_save(self, args, state, control, **kwargs):
        if self._save_started is not None:
            self.save_seconds = time.monotonic() - self._save_started
            self._save_started = None

    def _agreed(self, step: int) -> bool:
        if self.stopped:
            return False
        if self._agreement is None:
            return self.requested
        # the wait for the other ranks' word, where this one was asked: they end this step within about a step
        wait = min(max(2 * self.step_seconds, 1.0), 10.0)
        return self._agreement.step_end(step, self.requested, wait)


class OutputThatCannotFail:
    """From the signal to the exit, stdout and stderr (where they are pipes) go through a pipe of this process,
    copied on by a thread; where the copy fails because nobody reads any more (the launcher was killed: the ranks
    write into its pipe, and every write would raise BrokenPipeError), the output is dropped instead, and the
    checkpoint does not fail at its first progress bar. Files and terminals never fail so and are left alone."""

    def __init__(self) -> None:
        self._copies: list[tuple[int, int, threading.Thread]] = []  # (fd, where it went, copier)

    def install(self) -> None:
        """Descriptor calls only (what Python has buffered goes out later, through our pipe): safe in a signal
        handler, which may run inside a write of the main thread. A second call does nothing."""
        for fd in (1, 2) if not self._copies else ():
            try:
                if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                    continue
            except OSError:
                continue
            original = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            copier = threading.Thread(target=_copy, args=(read_end, original), name="preemption-output", daemon=True)
            copier.start()
            self._copies.append((fd, original, copier))

    def restore(self, timeout: float = 2.0) -> None:
        """Put the streams back and let the copiers pass on what is left (at most ``timeout`` seconds)."""
        _flush_streams()
        for fd, original, _ in self._copies:
            os.dup2(original, fd)  # our pipe's last write end closes: its copier reads to the end and stops
        for _, original, copier in self._copies:
            copier.join(timeout)
            os.close(original)
        self._copies = []


def _copy(read_end: int, to: int) -> None:
    reader_alive = True
    while chunk := os.read(read_end, 65536):
        while reader_alive and chunk:
            try:
                chunk = chunk[os.write(to, chunk) :]
            except OSError:  # EPIPE: the reader is gone; what comes later has nowhere to go
                reader_alive = False
    os.close(read_end)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def exit_after_checkpoint(output: OutputThatCannotFail, code: int = EXIT_CODE) -> None:
    """End the process now that the checkpoint is published (every rank is past its last collective): run the
    exit handlers (integrations flush their logs there), flush the streams, and skip the interpreter's teardown,
    which can take longer than the checkpoint did and would eat the rest of the grace period."""
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # logging.shutdown among them
    output.restore()
    os._exit(code)
