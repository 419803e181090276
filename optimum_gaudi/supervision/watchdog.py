"""A progress watchdog for multi-process training: a rank that stops making progress ends the job within a set
time, with a report of where every rank was, instead of holding every card for the process group's timeout.

Each rank runs one thread. The training loop marks progress (a step began, a step ended) and pauses the watch
for what may take long without being a stall (the first step's compilation, a save, an evaluation). The thread
publishes a heartbeat in the job's rendezvous store every tick: a counter (the process is alive), the progress
mark, the number of collectives this rank issued on the default group (torch's count; where the backend keeps
none, as HCCL, the project's own: supervision/collective_count.py), whether it is paused, and its pid and host. When its own rank has made no progress for the limit, and no rank is paused, it names the rank(s) that
stopped progressing from the heartbeats:

- ranks whose heartbeat stopped (a process stopped by SIGSTOP or a debugger, or frozen in native code);
- else the ranks furthest behind (an endless loop, a collective the others never join: the others went on to
  the next collective and wait there);
- else every rank (none can be told apart).

The first rank to decide writes the verdict into the store (compare-and-set); every rank then writes the Python
stacks of all its threads and the collective it waits in (torch's flight recorder, else the project's count's
record of the collective and its call site, else the innermost frame of its main thread) to ``<output_dir>/hang-<time>/rank<N>.txt`` and exits with
:data:`STALL_EXIT_CODE`. torchrun's elastic agent sees failed ranks: it stops the job, or with ``--max_restarts``
restarts it, and the restarted job resumes from the newest complete checkpoint. A stopped rank on the same host
is continued (SIGCONT) so that it writes its own stacks; the agent kills whatever is left.

Nothing waits for ever, on any backend (the Gaudi bridge's HCCL groups have no timeout): the windows that may take
long without being a stall (the first step, a save, an evaluation, a torch.compile compilation, and a step that may
compile outside torch.compile's callbacks: on a Gaudi the first steps of each process and steps with new input
shapes) have a limit of their own, :meth:`Watchdog.window_limit`: a floor (``--hang_long_timeout``,
:data:`LONG_WINDOW_SECONDS` by default), or twice the longest window of the same kind measured in the run if that is
longer; the ranks waiting for one wait that long: a compile of ten minutes never fires, a rank that hangs inside a
save does, after the save's limit.

Store calls go through a thread of their own with a time limit: the store's own timeout does not cover a server
that stopped answering (the process holding it was stopped), and the watchdog must still decide then.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..launch.ranks import STALL_EXIT_CODE, STALL_LINE_ENV
from . import collective_count

logger = logging.getLogger(__name__)

AUTO_FLOOR_SECONDS = 60.0  # the default limit never goes below this
AUTO_STEP_FACTOR = 10.0  # ... nor below this many times the slowest step seen
AUTO_PAUSE_FACTOR = 2.0  # ... nor below twice the slowest save or evaluation seen
FINISHED = "the end of training"  # a rank's last heartbeat
CONTINUED_REPORT_SECONDS = 10.0  # a stopped rank, continued, writes its stacks within this
STORE_CALL_SECONDS = 10.0  # a store call taking longer: the process holding the store stopped answering
TICK_ENDS_SECONDS = 2 * STORE_CALL_SECONDS  # a tick's first store call hanging fails the others at once
LONG_WINDOW_SECONDS = 1800.0  # the least limit of a first step, save, evaluation or compile (a Gaudi's take minutes)
WINDOW_FACTOR = 2.0  # ... nor below twice the longest window of its kind this rank measured
COMPILING = "a step that may compile"  # the kind of window a compiling step is


def auto_limit(slowest_step: float, slowest_pause: float, floor: float = AUTO_FLOOR_SECONDS) -> float:
    """The default limit, from the run's own times."""
    return max(floor, AUTO_STEP_FACTOR * slowest_step, AUTO_PAUSE_FACTOR * slowest_pause)


@dataclass
class Beat:
    """What a rank publishes each tick."""

    beat: int  # counts ticks: a heartbeat that stops changing is a process that stopped running
    progress: int  # 2 x step, + 1 inside a step
    collectives: int  # issued on the default group so far
    paused: str | None
    pid: int
    host: str
    compiling: bool = False  # in a step that may compile: watched with the compile limit


class StoreGone(Exception):
    """The job's store stopped answering, or the process holding it is gone."""


class _Store:
    """Store calls on a thread of their own, each given ``seconds``; once one hangs or fails, every later call
    fails (raising :class:`StoreGone`), as does every call after :meth:`close`."""

    def __init__(self, store: Any, seconds: float = STORE_CALL_SECONDS) -> None:
        self._store, self._seconds = store, seconds
        self._calls: queue.Queue = queue.Queue()
        self.stuck = False
        self._thread = threading.Thread(target=self._serve, name="watchdog-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Returns once the call in flight ended (or hung past its time). A store call is C++ run with the GIL
        released: one still running when the interpreter ends is cut off by CPython 3.11's pthread_exit, whose
        unwinding through torch's noexcept frames aborts the process ("terminate called without an active
        exception")."""
        self.stuck = True
        self._calls.put(None)
        self._thread.join(self._seconds)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            function, args, box, done = call
            try:
                box.append((True, getattr(self._store, function)(*args)))
            except Exception as e:
                box.append((False, e))
            done.set()

    def __call__(self, function: str, *args: Any) -> Any:
        if self.stuck:
            raise StoreGone
        box: list = []
        done = threading.Event()
        self._calls.put((function, args, box, done))
        if not done.wait(self._seconds) or not box[0][0]:  # hung, or failed (a lost connection)
            self.stuck = True
            raise StoreGone
        return box[0][1]


class Watchdog:
    """One per ``train()`` on each rank of a multi-process run; ``limit`` None derives it from the run's times."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        output_dir: str | os.PathLike,
        limit: float | None = None,
        name: str = "watchdog",
        serial: int = 0,
        long_floor: float = LONG_WINDOW_SECONDS,
    ) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.rank, self.world_size, self.output_dir = rank, world_size, Path(output_dir)
        self.fixed_limit = limit
        self.long_floor = long_floor
        self._prefix = f"optimum_gaudi/{name}/{restart}/{serial}"
        self._store = _Store(store)
        self._stop = threading.Event()
        self._ending = threading.Event()  # a verdict is known: the process ends once every report is written
        self._thread: threading.Thread | None = None
        # written by the training loop (plain attribute writes: no lock, no I/O on its path)
        self._progress = 0
        self._last_progress = time.monotonic()
        self._paused: str | None = "the first step"  # it compiles: watched with the long limit
        self._step_began: float | None = None
        self._pause_began: float | None = None
        self._armed = False  # after the first step
        self._compiling: str | None = None  # this step may compile (until it ends): the compile limit holds
        self._armed_at = 0.0
        self.slowest_step = 0.0
        self.slowest_pause = 0.0
        self.longest: dict[str, float] = {}  # kind of window (what paused it, or COMPILING) -> its longest here
        # the thread's own
        self._beat = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat counter, when it last changed)
        self._last_paused: dict[int, str | None] = {}
        self._last_compiling: dict[int, bool] = {}
        self._host = socket.gethostname()

    # ---- the training loop's side ---------------------------------------------------------------------------

    @property
    def limit(self) -> float:
        if self.fixed_limit is not None:
            return self.fixed_limit
        return auto_limit(self.slowest_step, self.slowest_pause)

    @property
    def long_limit(self) -> float:
        """The floor of every window's limit (``--hang_long_timeout``), at least the step limit."""
        return max(self.limit, self.long_floor)

    def window_limit(self, window: str | None) -> float:
        """The limit of a window that may take long without being a stall (the first step, a save, an evaluation,
        a compilation, a step that may compile): the floor, or :data:`WINDOW_FACTOR` times the longest window of
        that kind measured in this run, if longer. Each kind has its own: a slow evaluation lengthens no save's."""
        return max(self.long_limit, WINDOW_FACTOR * self.longest.get(window or "", 0.0))

    def _measured(self, window: str | None, seconds: float) -> None:
        if window is not None:
            self.longest[window] = max(self.longest.get(window, 0.0), seconds)

    def _window(self) -> str | None:
        """The kind of window this rank is in, or None in a plain step."""
        return self._paused if self._paused is not None else COMPILING if self._compiling is not None else None

    def compiling(self, what: str) -> None:
        """This step (until it ends) may compile for minutes: its limit is :meth:`window_limit` of COMPILING."""
        self._compiling = what

    def _hold_once_ending(self) -> None:
        """Once the job is ending, the loop must make no more progress: a stopped rank, continued to write its
        stacks, rejoins the collective the others wait in, and they would train on and publish checkpoints newer
        than the stall until the process ends (the thread ending it never returns here)."""
        if self._ending.is_set():
            threading.Event().wait()

    def step_begin(self, step: int) -> None:
        self._hold_once_ending()
        now = time.monotonic()
        self._end_pause(now)
        self._step_began = now
        self._progress, self._last_progress = 2 * step - 1, now

    def step_end(self, step: int) -> None:
        self._hold_once_ending()
        now = time.monotonic()
        if self._step_began is not None:
            if self._compiling is not None:
                self._measured(COMPILING, now - self._step_began)
            if self._armed:
                self.slowest_step = max(self.slowest_step, now - self._step_began)
            else:
                if self._paused == "the first step":
                    self._measured(self._paused, now - self._step_began)
                    self._paused = None
                self._armed, self._armed_at = True, now
        self._step_began = None
        self._compiling = None
        self._progress, self._last_progress = 2 * step, now

    def pause(self, what: str) -> None:
        """Until the next step begins (or :meth:`resume`): ``what`` may take long without being a stall."""
        self._hold_once_ending()
        if self._paused is None:
            self._paused, self._pause_began = what, time.monotonic()

    def resume(self) -> None:
        self._end_pause(time.monotonic())

    @contextlib.contextmanager
    def paused(self, what: str) -> Iterator[None]:
        if self._paused is not None:  # inside a longer pause already
            yield
            return
        self.pause(what)
        try:
            yield
        finally:
            self.resume()

    def _end_pause(self, now: float) -> None:
        if self._pause_began is not None:
            self.slowest_pause = max(self.slowest_pause, now - self._pause_began)
            self._measured(self._paused, now - self._pause_began)
            self._pause_began = None
            self._paused = None
            self._last_progress = now

    # ---- the thread -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """A first heartbeat before training's first step: a rank that stops before its thread's first tick (a
        few fast steps) is seen, and can be continued, as any other."""
        with contextlib.suppress(StoreGone):
            self._publish()
        self._thread = threading.Thread(target=self._run, name="progress-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Training ended here: a last heartbeat says so (the others must not take its silence for a stall). Returns
        once neither thread calls the store (see :meth:`_Store.close`)."""
        self._stop.set()
        self._paused = FINISHED
        if self._thread is not None:  # a tick in flight ends: its store calls take STORE_CALL_SECONDS at most each
            self._thread.join(TICK_ENDS_SECONDS)
        with contextlib.suppress(Exception):
            beat = Beat(self._beat + 1, self._progress, _collectives(), FINISHED, os.getpid(), self._host, False)
            self._store("set", self._key(f"beat/{self.rank}"), json.dumps(asdict(beat)))
        self._store.close()

    def _tick_seconds(self) -> float:
        return min(5.0, max(0.25, self.limit / 10))

    def _run(self) -> None:
        while not self._stop.wait(self._tick_seconds()):
            if self._stop.is_set():
                return
            try:
                self._tick()
            except StoreGone:
                if not self._stop.is_set():  # closed by stop(), not gone
                    self._store_gone()
            except Exception as e:  # a watchdog that fails must never end the run it watches
                logger.warning("The progress watchdog stopped: %s", str(e).splitlines()[0] if str(e) else type(e))
                return

    def _key(self, what: str) -> str:
        return f"{self._prefix}/{what}"

    def _publish(self) -> None:
        self._beat += 1
        compiling = self._compiling is not None
        mine = Beat(self._beat, self._progress, _collectives(), self._paused, os.getpid(), self._host, compiling)
        self._store("set", self._key(f"beat/{self.rank}"), json.dumps(asdict(mine)))

    def _tick(self) -> None:
        self._publish()
        now = time.monotonic()
        if self._store("check", [self._key("verdict")]):
            self._finish(json.loads(self._store("get", self._key("verdict"))), decided=False)
        beats = self._beats(now)  # every tick, paused or not: a peer that stopped running is seen from anywhere
        frozen = [rank for rank in range(self.world_size) if rank != self.rank and self._frozen(rank, now)]
        if frozen:
            self._decide(beats, frozen, _STOPPED, where=f"while rank {self.rank} was {_where(self._progress)}")
            return
        stalled_for = now - self._last_progress
        window = self._window()
        if stalled_for < (self.window_limit(window) if window is not None else self.limit):
            return
        others = [b for r, b in beats.items() if r != self.rank and b.progress <= self._progress]
        windows = [b.paused or COMPILING for b in others if b.paused or b.compiling]
        if windows and stalled_for < max(map(self.window_limit, windows)):
            return  # a rank behind this one saves, evaluates or compiles: this one waits for it, that long
        lowest = min((beat.progress, beat.collectives) for beat in beats.values())
        behind = sorted(rank for rank, beat in beats.items() if (beat.progress, beat.collectives) == lowest)
        silent = [rank for rank in behind if rank != self.rank and self._silent_since_the_stall(rank, now)]
        if silent:  # stopped as progress stopped: its heartbeat is a tick or two short of the limit, not running
            self._decide(beats, silent, _STOPPED, where=f"while rank {self.rank} was {_where(self._progress)}")
        elif len(behind) < len(beats):
            self._decide(beats, behind, "the other ranks went on to the next collective and wait there for it")
        else:
            self._decide(beats, sorted(beats), "every rank waits, none ahead of another")

    def _decide(self, beats: dict[int, Beat], ranks: list[int], why: str, where: str | None = None) -> None:
        verdict = {
            "folder": time.strftime("hang-%Y%m%d-%H%M%S"),
            "ranks": ranks,
            "why": why,
            "seconds": round(max(time.monotonic() - self._last_progress, self.limit)),
            "where": where or _where(min(beats[rank].progress for rank in ranks if rank in beats)),
            "by": self.rank,
        }
        verdict = json.loads(self._store("compare_set", self._key("verdict"), "", json.dumps(verdict)))
        self._finish(verdict, decided=verdict["by"] == self.rank, beats=beats)

    def _beats(self, now: float) -> dict[int, Beat]:
        keys = [self._key(f"beat/{rank}") for rank in range(self.world_size)]
        if not self._store("check", keys):  # one round trip once every rank has beaten; one a rank before that
            keys = [key for key in keys if self._store("check", [key])]
        values = self._store("multi_get", keys) if keys else []
        beats = {int(k.rsplit("/", 1)[1]): Beat(**json.loads(v)) for k, v in zip(keys, values, strict=True)}
        for rank, beat in beats.items():
            seen = self._seen.get(rank)
            if seen is None or seen[0] != beat.beat:
                self._seen[rank] = (beat.beat, now)
            self._last_paused[rank] = beat.paused
            self._last_compiling[rank] = beat.compiling
        return beats

    def _silent_since_the_stall(self, rank: int, now: float) -> bool:
        """``rank``'s heartbeat stopped about when progress did: silent for all but two ticks of the limit (a running
        process beats every tick). A rank stopped at a step's end is so when the limit of no progress is reached,
        a tick or so before :meth:`_frozen` would say it."""
        seen = self._seen.get(rank)
        if seen is None or self._last_paused.get(rank) == FINISHED or self._last_compiling.get(rank):
            return False
        return now - seen[1] >= self.limit - 2 * self._tick_seconds()

    def _frozen(self, rank: int, now: float) -> bool:
        """No new heartbeat from ``rank`` for the limit (unless its training ended): its process does not run,
        whatever it was doing. A rank never heard from counts from the end of this rank's first step, which every
        rank's first collectives (so its watchdog's start) came before."""
        seen = self._seen.get(rank)
        if seen is None:
            return self._armed and now - self._armed_at >= self.limit
        compiling = self._last_compiling.get(rank)  # a compile may hold the GIL: silent that long
        limit = self.window_limit(COMPILING) if compiling else self.limit
        return now - seen[1] >= limit and self._last_paused.get(rank) != FINISHED

    # ---- the end ----------------------------------------------------------------------------------------------

    def _store_gone(self) -> None:
        """The store stopped answering: the process holding it (rank 0 or torchrun's agent) stopped. Decide
        alone, once this rank has made no progress for the limit."""
        window = self._window()
        limit = self.window_limit(window) if window is not None else self.limit
        if time.monotonic() - self._last_progress >= limit:
            verdict = {
                "folder": time.strftime("hang-%Y%m%d-%H%M%S"),
                "ranks": [0],
                "why": "the job's rendezvous store, which rank 0 (or torchrun's agent on node 0) holds, stopped "
                "answering",
                "seconds": round(time.monotonic() - self._last_progress),
                "where": _where(self._progress),
                "by": self.rank,
            }
            self._finish(verdict, decided=True)

    def _finish(self, verdict: dict, decided: bool, beats: dict[int, Beat] | None = None) -> None:
        try:
            folder = self.output_dir / verdict["folder"]
            line = stall_line(verdict, folder)
            try:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"rank{self.rank}.txt").write_text(self._report(verdict), encoding="utf-8")
                if decided:
                    (folder / "summary.txt").write_text(line + "\n", encoding="utf-8")
            except OSError as e:
                line += f" (the report could not be written: {e})"
            self._ending.set()  # after the report: its stacks show where the loop was
            if decided:
                print(f"error: {line}", file=sys.stderr, flush=True)
                path = os.environ.get(STALL_LINE_ENV)
                if path:
                    with contextlib.suppress(OSError):
                        Path(path).write_text(line, encoding="utf-8")
            self._wait_for_the_others(
                partial(self._continue_stopped_ranks, verdict, folder, beats) if decided else None
            )
        finally:  # whatever failed above, the process ends: its training loop is held
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(STALL_EXIT_CODE)

    def _wait_for_the_others(self, continue_stopped: Callable[[], list[int]] | None) -> None:
        """Say this rank's report is written, and wait (a few ticks at most) for every other rank's: the process
        holding the store (rank 0, where torchrun's agent does not) leaving first would leave the others without
        the verdict, and a rank in an endless loop without its stacks. Running ranks come first: the deciding rank
        continues a stopped one (``continue_stopped`` returns the ranks it continued) only once they wrote theirs,
        as it joins the collective they wait in and moves them on. Every rank then waits for the continued ranks'
        reports (it may hold the store they read)."""
        ticks = 3 * self._tick_seconds()
        now = time.monotonic()
        others = [r for r in range(self.world_size) if r != self.rank and self._last_paused.get(r) != FINISHED]
        with contextlib.suppress(StoreGone):
            self._store("set", self._key(f"done/{self.rank}"), "1")
        self._wait_for([self._key(f"done/{r}") for r in others if not self._frozen(r, now)], ticks + 5)
        continued = continue_stopped() if continue_stopped is not None else None
        if continued is not None:
            with contextlib.suppress(StoreGone):
                self._store("set", self._key("continued"), json.dumps(continued))
        elif self._wait_for([self._key("continued")], ticks + 5):
            with contextlib.suppress(StoreGone, ValueError):
                continued = json.loads(self._store("get", self._key("continued")))
        others = [self._key(f"done/{r}") for r in continued or [] if r != self.rank]
        self._wait_for(others, ticks + CONTINUED_REPORT_SECONDS)

    def _wait_for(self, keys: list[str], seconds: float) -> bool:
        """Whether every key was set in the store within ``seconds``."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(StoreGone):
            while keys and time.monotonic() < deadline:
                keys = [key for key in keys if not self._store("check", [key])]
                if keys:
                    time.sleep(0.1)
            return not keys
        return False

    def _continue_stopped_ranks(self, verdict: dict, folder: Path, beats: dict[int, Beat] | None) -> list[int]:
        """A stalled rank on this host that is stopped (SIGSTOP) cannot write its stacks: continue it so that its
        own watchdog does (it reads the verdict at its next tick), and say so where it could not. Returns the
        ranks continued."""
        if beats is None:
            with contextlib.suppress(Exception):
                beats = self._beats(time.monotonic())
        continued = []
        for rank in verdict["ranks"]:
            beat = (beats or {}).get(rank)
            if rank == self.rank or beat is None or beat.host != self._host or _state(beat.pid) != "T":
                continue
            with contextlib.suppress(OSError):
                os.kill(beat.pid, signal.SIGCONT)
            continued.append(rank)
            report = folder / f"rank{rank}.txt"
            deadline = time.monotonic() + CONTINUED_REPORT_SECONDS
            while not report.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not report.exists():
                with contextlib.suppress(OSError):
                    report.write_text(
                        f"rank {rank} (pid {beat.pid} on {beat.host}) was stopped (SIGSTOP or a debugger) and did "
                        f"not write its stacks within {CONTINUED_REPORT_SECONDS:.0f} s of being continued.\n",
                        encoding="utf-8",
                    )
        return continued

    def _report(self, verdict: dict) -> str:
        stalled = ", ".join(map(str, verdict["ranks"]))
        lines = [
            f"rank {self.rank} of {self.world_size} (pid {os.getpid()} on {self._host}); last progress "
            f"{_where(self._progress)}, {time.monotonic() - self._last_progress:.1f} s ago",
            f"stalled: rank(s) {stalled}: {verdict['why']} (watchdog limit {self.limit:.0f} s)",
            f"collectives issued on the default group: {_collectives()}{_whose_count()}",
            f"waiting in: {waiting_in()}",
            "",
            "Python stacks of every thread (most recent call first within each):",
        ]
        return "\n".join(lines) + "\n" + _stacks()


_STOPPED = "its process stopped running: stopped by a signal or a debugger, or frozen"


def stall_line(verdict: dict, folder: Path) -> str:
    ranks = verdict["ranks"]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return (
        f"{who} made no progress for {verdict['seconds']} s {verdict['where']} ({verdict['why']}); "
        f"every rank's stacks are in {folder}"
    )


def _where(progress: int) -> str:
    return f"in step {(progress + 1) // 2}" if progress % 2 else f"after step {progress // 2}"


def _collectives() -> int:
    """Collectives this rank issued on the default group (they count up together on ranks that keep pace): torch's
    count, else the project's own where the backend keeps none (HCCL: supervision/collective_count.py), else -1."""
    with contextlib.suppress(Exception):
        return int(torch.distributed.group.WORLD._get_sequence_number_for_group())
    count = collective_count.active()
    return count.default_count() if count is not None else -1


def _whose_count() -> str:
    if collective_count.active() is not None and not collective_count.backend_counts():
        return " (optimum-gaudi's count: the backend keeps none)"
    return ""


def waiting_in() -> str:
    """The collective this rank waits in. Its main thread's innermost Python frame says whether it waits inside
    torch at all (a collective is called from torch.distributed, a gradient reduction from autograd or DDP);
    then torch's flight recorder names the collective issued last (the one of the default group's backend: NCCL's
    own, gloo's from torch 2.8; collective_count.flight_record_dump), else the project's own count (a backend
    without either, HCCL) names it and its call site, else that frame does."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    path = frame.f_code.co_filename.replace(os.sep, "/") if frame is not None else ""
    if not any(part in path for part in ("/torch/", "/accelerate/", "/deepspeed/", "/habana_frameworks/")):
        return "no collective (its main thread runs outside torch: see its stack)"
    recorded = _recorded_wait()
    if recorded is not None:
        return recorded
    count = collective_count.active()
    counted = count.waiting_in() if count is not None else None
    if counted is not None:  # a backend without a flight record (HCCL): the project's own record
        return counted
    short = path.split("/site-packages/", 1)[-1]
    return f"{frame.f_code.co_name} ({short}:{frame.f_lineno}), its main thread's innermost frame"


def _recorded_wait() -> str | None:
    """The collective torch's flight recorder holds as this rank's newest not completed one (the recorder of the
    default group's backend), or None: no record of this backend, its recorder off, or nothing pending."""
    dump_json = collective_count.flight_record_dump()
    if dump_json is None:
        return None
    with contextlib.suppress(Exception):
        dump = json.loads(dump_json(True, True))
        status = dump.get("pg_status", {})
        newest: dict[str, dict] = {}  # each group's last collective (gloo marks completion only where waited on)
        for entry in dump.get("entries", []):
            group = str(entry.get("pg_id"))
            if entry.get("collective_seq_id", 0) >= newest.get(group, {}).get("collective_seq_id", 0):
                newest[group] = entry
        pending = [
            entry
            for group, entry in newest.items()
            if entry.get("collective_seq_id", 0) > int(status.get(group, {}).get("last_completed_collective", -1))
        ]
        if pending:  # the one issued last is the one this rank waits in
            entry = max(pending, key=lambda e: e.get("time_created_ns", 0))
            age = (time.time_ns() - entry.get("time_created_ns", time.time_ns())) / 1e9
            name, description = (list(entry.get("process_group") or []) + ["?", "?"])[:2]
            label = description if description not in ("", "undefined") else f"#{name}"
            return (
                f"{entry.get('profiling_name')} on group {label} (its collective {entry['collective_seq_id']}, "
                f"issued {age:.1f} s ago, input sizes {entry.get('input_sizes')}; torch's flight recorder)"
            )
    return None


def _stacks() -> str:
    """Every thread's Python stack, as faulthandler writes it (it needs no lock the stalled code could hold)."""
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def _state(pid: int) -> str | None:
    """The process state letter from /proc (T: stopped), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
