"""A stalled rank never wastes the cluster (issue 38), in process on a store in memory: SIGTERM's agreement on the
step to stop after costs no collective, and the progress watchdog names a rank behind or stopped (never in the
first step, nor a rank whose training ended) with a limit from the run's own times. The multi-process launches:
tests/integration/supervision/test_stalled_slow_or_diverging_ranks.py."""

from __future__ import annotations

import dataclasses
import json
import os
import threading


class FakeStore:
    """The slice of a c10d store the watchdog and SIGTERM's agreement use, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(key in self.data for key in keys)

    def multi_get(self, keys):
        return [self.data[key] for key in keys]

    def compare_set(self, key, expected, desired):
        with self.lock:
            if key not in self.data and expected == "":
                self.data[key] = desired.encode()
            return self.data[key]


def test_sigterm_to_every_rank_stops_after_the_step_in_flight_and_to_some_after_the_next():
    """SIGTERM's agreement (supervision/agreement.py) on a store in memory: ranks asked at the ends of steps 3
    and 4 (a step end apart) stop after 4; a rank asked alone makes every rank stop after the next step."""
    from optimum_gaudi.supervision.agreement import StopAgreement

    store = FakeStore()
    ranks = [StopAgreement(store, rank, 2, serial=0) for rank in (0, 1)]  # as two processes' first
    results = {}
    threads = [
        threading.Thread(target=lambda r=r, s=s: results.update({r: ranks[r].step_end(s, True, 5.0)}))
        for r, s in ((0, 3), (1, 4))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {0: False, 1: True} and [a.stop_after for a in ranks] == [4, 4]
    assert ranks[0].step_end(4, True) is True

    store = FakeStore()
    alone, other = StopAgreement(store, 1, 2, serial=0), StopAgreement(store, 0, 2, serial=0)
    assert other.step_end(5, False) is False  # rank 0 ended step 5 before rank 1 said anything
    assert alone.step_end(5, True, wait_seconds=0.05) is False  # rank 0 never answers: after step 6
    assert (other.step_end(6, False), alone.step_end(6, True)) == (True, True)


def watchdog_pair(tmp_path, limit=1.0):
    """Rank 0's watchdog and a way to publish rank 1's heartbeat; a verdict is recorded, not acted on."""
    from optimum_gaudi.supervision import watchdog

    store = FakeStore()
    dog = watchdog.Watchdog(store, 0, 2, tmp_path, limit=limit)
    verdicts = []
    dog._finish = lambda verdict, decided, beats=None: verdicts.append(verdict)

    def peer(beat: int, progress: int, paused=None):
        record = watchdog.Beat(beat, progress, 0, paused, 1, "elsewhere")
        store.set(dog._key("beat/1"), json.dumps(dataclasses.asdict(record)))

    return dog, peer, verdicts


def test_the_watchdog_waits_for_a_rank_behind_it_that_saves_and_names_a_stopped_one_even_while_paused(tmp_path):
    dog, peer, verdicts = watchdog_pair(tmp_path)
    dog.step_begin(1)
    dog.step_end(1)  # armed after the first step
    dog.step_begin(2)
    dog._last_progress -= 5  # no progress for 5 s, over the 1 s limit
    peer(1, 2, paused="a save")  # rank 1 saves, behind rank 0 (after step 1): rank 0 waits for it
    dog._tick()
    peer(2, 2, paused="a save")
    dog._tick()
    assert verdicts == []
    dog.pause("an evaluation")  # rank 0 evaluates; rank 1 stops beating: seen from a paused rank too
    dog._seen[1] = (2, dog._seen[1][1] - 2)
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and "stopped running" in verdicts[0]["why"]


def test_the_watchdog_names_the_rank_behind_and_never_fires_in_the_first_step(tmp_path):
    dog, peer, verdicts = watchdog_pair(tmp_path)
    dog.step_begin(1)
    dog._last_progress -= 5  # the first step (compilation) takes 5 s: no verdict
    peer(1, 1)
    dog._tick()
    assert verdicts == [] and dog._paused == "the first step"
    dog.step_end(1)
    dog.step_begin(2)
    dog._last_progress -= 5
    peer(2, 2)  # rank 1 alive, still after step 1: rank 0 waits in step 2's collective for it
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and "went on to the next collective" in verdicts[0]["why"]
    assert verdicts[0]["where"] == "after step 1"


def test_a_rank_stopped_before_its_watchdogs_first_tick_is_named_as_stopped(tmp_path):
    """Each watchdog publishes a heartbeat as it starts, so a rank stopped after a few fast steps, before its thread
    first ticked, is seen (and continued, to write its stacks) as any other; a rank never heard from at all counts
    as stopped once the first step (which it took part in) ended a limit ago. CI saw the first case named 'rank 0:
    every rank waits'."""
    from optimum_gaudi.supervision import watchdog

    store = FakeStore()
    first = watchdog.Watchdog(store, 1, 2, tmp_path, limit=1.0)
    first._run = lambda: None  # its thread never ticks: the process stops first
    first.start()
    assert json.loads(store.get(first._key("beat/1")))["pid"] == os.getpid()
    dog, _, verdicts = watchdog_pair(tmp_path)
    dog._store = first._store
    dog.step_begin(1)
    dog.step_end(1)
    dog._tick()
    dog._seen[1] = (1, dog._seen[1][1] - 2)  # its first beat, 2 s ago
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and "stopped running" in verdicts[0]["why"]

    lonely, _, verdicts = watchdog_pair(tmp_path)  # rank 1 never published anything
    lonely.step_begin(1)
    lonely.step_end(1)
    lonely._tick()
    assert verdicts == []
    lonely._armed_at -= 2
    lonely._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and "stopped running" in verdicts[0]["why"]


def test_once_a_verdict_is_known_the_training_loop_makes_no_more_progress(tmp_path, monkeypatch):
    """A stopped rank is continued to write its stacks, and it then rejoins the collective the others wait in: their
    training went on and saved checkpoints while the watchdog ended the job (a 4-process stall test resumed past
    its next stall). Once this rank knows the verdict, its loop waits at its next step boundary or save for the
    process to end, so no checkpoint newer than the stall is published."""
    from optimum_gaudi.supervision import watchdog

    exits = []
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: exits.append(code))
    store = FakeStore()
    dog = watchdog.Watchdog(store, 0, 2, tmp_path, limit=1.0)
    store.set(dog._key("done/1"), "1")  # the other rank's report is written: no wait for it
    store.set(dog._key("continued"), "[]")  # nor for the decider to continue a stopped rank
    dog.step_begin(1)
    dog.step_end(1)  # no verdict: the loop goes on
    verdict = {"folder": "hang-x", "ranks": [1], "why": "stopped", "seconds": 6, "where": "after step 5", "by": 1}
    dog._finish(verdict, decided=False, beats={})
    assert exits == [watchdog.STALL_EXIT_CODE] and (tmp_path / "hang-x" / "rank0.txt").exists()
    for mark in (lambda: dog.step_begin(2), lambda: dog.step_end(1), lambda: dog.pause("a save")):
        loop = threading.Thread(target=mark, daemon=True)  # the training loop's thread, held until the process ends
        loop.start()
        loop.join(0.5)
        assert loop.is_alive()


def test_a_stopped_rank_is_continued_only_once_every_running_rank_wrote_where_it_waits(tmp_path, monkeypatch):
    """Continued to write its stacks, a stopped rank joins the collective the others wait in and they move on: a
    rank that had not yet read the verdict then reported wherever training had gone since (CI saw a 4-rank job's
    rank 2 report 'no collective'). The deciding rank continues it only once every running rank's report is
    written; a running rank stays (a few ticks) until the continued one wrote its own, as it may hold the store."""
    from optimum_gaudi.supervision import watchdog

    monkeypatch.setattr(watchdog.os, "_exit", lambda code: None)
    monkeypatch.setattr(watchdog, "_state", lambda pid: "T" if pid == 4242 else "R")
    store, host = FakeStore(), watchdog.socket.gethostname()
    dog = watchdog.Watchdog(store, 0, 3, tmp_path, limit=1.0)
    now = watchdog.time.monotonic()
    beats = {
        1: watchdog.Beat(9, 10, 40, None, os.getpid(), host),  # running, waiting in collective 40
        2: watchdog.Beat(8, 10, 39, None, 4242, host),  # stopped after step 5, before collective 40
    }
    dog._seen = {1: (9, now), 2: (8, now - 5)}
    verdict = {"folder": "hang-x", "ranks": [2], "why": "stopped", "seconds": 6, "where": "after step 5", "by": 0}
    continued_after = []

    def kill(pid, sig):
        assert (pid, sig) == (4242, watchdog.signal.SIGCONT)
        continued_after.append(store.check([dog._key("done/1")]))
        (tmp_path / "hang-x" / "rank2.txt").write_text("rank 2, continued\n")
        store.set(dog._key("done/2"), "1")

    monkeypatch.setattr(watchdog.os, "kill", kill)
    rank1 = threading.Timer(0.5, lambda: store.set(dog._key("done/1"), "1"))  # reads the verdict a tick later
    rank1.start()
    dog._finish(verdict, decided=True, beats=beats)
    rank1.join()
    assert continued_after == [True]

    checked = []  # rank 1, not deciding, waits for the report of rank 2, whom the decider continued

    def recorded(op, *args):
        if op == "check":
            checked.extend(args[0])
        return getattr(store, op)(*args)

    other = watchdog.Watchdog(store, 1, 3, tmp_path, limit=1.0)
    other._seen = {0: (5, now), 2: (8, now - 5)}
    monkeypatch.setattr(other, "_store", recorded)
    other._wait_for_the_others(None)
    assert checked[-1] == other._key("done/2") and json.loads(store.get(other._key("continued"))) == [2]


def test_a_rank_whose_training_ended_is_not_taken_for_a_stopped_one(tmp_path):
    from optimum_gaudi.supervision.watchdog import FINISHED

    dog, peer, verdicts = watchdog_pair(tmp_path)
    dog.step_begin(1)
    dog.step_end(1)
    peer(7, 2, paused=FINISHED)
    dog._tick()
    dog._seen[1] = (7, dog._seen[1][1] - 10)
    dog._tick()
    assert verdicts == []


def test_the_default_limit_comes_from_the_runs_own_times_with_a_floor():
    from optimum_gaudi.supervision.watchdog import AUTO_FLOOR_SECONDS, auto_limit

    assert auto_limit(0.5, 10.0) == AUTO_FLOOR_SECONDS == 60
    assert auto_limit(12.0, 10.0) == 120  # 10 x the slowest step
    assert auto_limit(1.0, 90.0) == 180  # 2 x the slowest save or evaluation


# ---- steps that may compile (issue 46, point 3) -------------------------------------------------------------------


def beat_of_rank_1(dog, beat: int, progress: int, compiling: bool) -> None:
    from optimum_gaudi.supervision import watchdog

    record = watchdog.Beat(beat, progress, -1, None, 1, "elsewhere", compiling)  # hccl: no collective count
    dog._store("set", dog._key("beat/1"), json.dumps(dataclasses.asdict(record)))


def test_a_step_that_may_compile_is_watched_with_the_long_limit_on_every_rank(tmp_path):
    """At default settings (a 60 s floor), a step marked compiling that takes 10 minutes never fires, on the
    compiling rank nor on one waiting for it, and a stall in it fires once the long limit (30 min) is over;
    a rank whose last heartbeat said compiling may go silent that long (a compile holding the GIL)."""
    from optimum_gaudi.supervision.watchdog import LONG_WINDOW_SECONDS

    assert LONG_WINDOW_SECONDS == 1800
    dog, _, verdicts = watchdog_pair(tmp_path, limit=None)
    dog.step_begin(1)
    dog.step_end(1)
    dog.step_begin(2)
    dog.compiling("step 2 of this process")  # rank 0 compiles; rank 1, done compiling, waits in step 2 for it
    dog._last_progress -= 600
    beat_of_rank_1(dog, 1, 3, compiling=False)
    dog._tick()
    assert verdicts == []
    dog._last_progress -= LONG_WINDOW_SECONDS - 600 + 1  # a stall in a compiling step: after the long limit
    beat_of_rank_1(dog, 2, 3, compiling=False)
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[0, 1]] and verdicts[0]["where"] == "in step 2"

    dog, _, verdicts = watchdog_pair(tmp_path, limit=None)
    dog.step_begin(1)
    dog.step_end(1)
    dog.step_begin(2)
    dog.step_end(2)
    dog.step_begin(3)  # rank 0 is not compiling: it waits in step 3 for rank 1, which compiles step 2
    dog._last_progress -= 600
    beat_of_rank_1(dog, 1, 3, compiling=True)
    dog._tick()
    dog._seen[1] = (1, dog._seen[1][1] - 600)  # rank 1's heartbeat silent for 10 minutes while it compiles
    dog._tick()
    assert verdicts == []
    dog._last_progress -= LONG_WINDOW_SECONDS
    beat_of_rank_1(dog, 2, 3, compiling=True)
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and verdicts[0]["where"] == "in step 2"


def test_on_a_gaudi_the_first_three_steps_of_each_process_and_new_shapes_are_compiling_steps(tmp_path):
    """HPUDevice: steps 1-3 of a process (a restarted one too) and a step with new input shapes and the one after
    it (lazy mode compiles at the next sync) are compiling steps; on a device that compiles nothing outside
    torch.compile, none is."""
    import torch
    from transformers import TrainerControl, TrainerState

    from optimum_gaudi.devices.hpu import HPUDevice
    from optimum_gaudi.supervision.watch import ProgressWatch
    from optimum_gaudi.supervision.watchdog import Watchdog

    def compiling_steps(device, shapes_at) -> list[int]:
        watch = ProgressWatch(device)
        watch.watchdog = Watchdog(FakeStore(), 0, 2, tmp_path)
        state, control, found = TrainerState(), TrainerControl(), []
        for step in range(1, 9):
            watch.on_step_begin(None, state, control)
            watch.note_inputs({"input_ids": torch.zeros(shapes_at.get(step, (4, 8)), dtype=torch.long)})
            if watch.watchdog._compiling is not None:
                found.append(step)
            state.global_step = step
            watch.on_step_end(None, state, control)
        return found

    assert compiling_steps(HPUDevice, {6: (4, 5)}) == [1, 2, 3, 6, 7]
    assert compiling_steps(HPUDevice, {}) == [1, 2, 3]  # a restarted process compiles again
    assert compiling_steps(None, {6: (4, 5)}) == []


def test_a_hang_in_the_first_step_a_save_or_an_evaluation_fires_after_the_long_limit(tmp_path):
    """Nothing waits for ever (HCCL groups have no timeout): the first step and a save, on the rank inside it and on
    a rank waiting for it, are watched with the long limit: --hang_long_timeout (30 minutes by default), at least
    the limit and twice the slowest pause seen."""
    from optimum_gaudi.supervision.watchdog import LONG_WINDOW_SECONDS, Watchdog

    dog, peer, verdicts = watchdog_pair(tmp_path, limit=None)
    dog.step_begin(1)  # the first step, 10 minutes so far: it may compile
    dog._last_progress -= 600
    peer(1, 1)
    dog._tick()
    assert verdicts == []
    dog._last_progress -= LONG_WINDOW_SECONDS
    peer(2, 1)
    dog._tick()
    assert len(verdicts) == 1 and verdicts[0]["where"] == "in step 1"

    dog, peer, verdicts = watchdog_pair(tmp_path, limit=None)
    for step in (1, 2):
        dog.step_begin(step)
        dog.step_end(step)
    dog.step_begin(3)  # rank 0 waits in step 3 for rank 1, which saves after step 2 (and hangs there)
    dog._last_progress -= 600
    peer(1, 4, paused="a save")
    dog._tick()
    assert verdicts == []
    dog._last_progress -= LONG_WINDOW_SECONDS
    peer(2, 4, paused="a save")
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and verdicts[0]["where"] == "after step 2"

    dog = Watchdog(FakeStore(), 0, 2, tmp_path, long_floor=100)
    assert dog.long_limit == 100 == dog.window_limit("a save")


def test_each_window_has_a_limit_of_its_own_from_the_runs_measured_times_above_a_floor(tmp_path):
    """Issue 46, point 2: a save's limit is the floor (--hang_long_timeout) or twice the longest save measured,
    an evaluation's likewise from evaluations, a compiling step's from compiling steps: a long evaluation does not
    lengthen a save's limit. A rank waiting for a peer's save waits the save's limit."""
    from optimum_gaudi.supervision.watchdog import COMPILING

    dog, peer, verdicts = watchdog_pair(tmp_path, limit=1.0)
    dog.long_floor = 10.0
    dog.step_begin(1)
    dog._step_began -= 4  # the first step took 4 s
    dog.step_end(1)
    dog.pause("a save")
    dog._pause_began -= 30  # a save of 30 s
    dog.step_begin(2)
    dog.compiling("step 2 of this process")
    dog._step_began -= 7  # a compiling step of 7 s
    dog.step_end(2)
    dog.pause("an evaluation")
    dog._pause_began -= 3  # an evaluation of 3 s: under the floor
    dog.step_begin(3)
    assert set(dog.longest) == {"the first step", "a save", COMPILING, "an evaluation"}
    assert 4 <= dog.longest["the first step"] < 5
    assert 60 <= dog.window_limit("a save") < 61  # twice the longest save
    assert 14 <= dog.window_limit(COMPILING) < 15  # twice the longest compiling step
    assert dog.window_limit("an evaluation") == 10.0 == dog.window_limit("a compilation")  # the floor
    # rank 0 waits in step 3 for rank 1, which saves after step 2: the save's limit, not the floor, holds
    dog._last_progress -= 40
    peer(1, 4, paused="a save")
    dog._tick()
    assert verdicts == []
    dog._last_progress -= 21
    peer(2, 4, paused="a save")
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]]


def test_a_rank_stopped_as_a_step_ended_is_named_as_stopped_not_behind(tmp_path):
    """The 4-rank stall test once read a SIGSTOPped rank as 'behind': it stopped at a step's end, so the others'
    limit of no progress came a tick before its heartbeat had been silent for the whole limit. Silent for all but
    two ticks when progress stopped, it is a stopped process; a rank that beats is still one behind."""
    dog, peer, verdicts = watchdog_pair(tmp_path, limit=6.0)  # ticks of 0.6 s
    dog.step_begin(1)
    dog.step_end(1)
    dog.step_begin(2)
    peer(1, 2)  # rank 1 after step 1
    dog._tick()
    dog._seen[1] = (1, dog._seen[1][1] - 5.0)  # silent 5 s, under the 6 s limit: not frozen yet
    dog._last_progress -= 6.5
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and "stopped running" in verdicts[0]["why"]

    dog, peer, verdicts = watchdog_pair(tmp_path, limit=6.0)
    dog.step_begin(1)
    dog.step_end(1)
    dog.step_begin(2)
    peer(1, 2)
    dog._tick()
    dog._seen[1] = (1, dog._seen[1][1] - 2.0)  # beat 2 s ago: running, behind
    dog._last_progress -= 6.5
    dog._tick()
    assert [v["ranks"] for v in verdicts] == [[1]] and "went on to the next collective" in verdicts[0]["why"]


RECORD = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
dist.all_reduce(torch.ones(3))
sys.stdout.write(torch._C._distributed_c10d._dump_fr_trace_json(True, True).decode())
sys.stdout.flush()
os._exit(0)  # gloo's threads at interpreter exit may abort ("terminate called without an active exception")
"""


def test_on_nccl_the_report_names_the_collective_from_ncclS_own_recorder(tmp_path, monkeypatch):
    """ "waiting in" on an NCCL default group reads NCCL's recorder (``_dump_nccl_trace_json``), not gloo's
    (``_dump_fr_trace_json``, which holds none of NCCL's). The record is a real one, written by torch's recorder
    for gloo (torch 2.8+ writes both recorders' JSON with one template, FlightRecorderDetail.hpp's ``dump_json``;
    2.6's NCCL one has the same keys, FlightRecorder.cpp), its status set as a rank stuck in its second
    collective has it. No NCCL runs here."""
    import subprocess
    import sys

    import pytest
    import torch

    from optimum_gaudi.launch.ranks import FLIGHT_RECORDER_ENV
    from optimum_gaudi.supervision import collective_count, watchdog

    if not collective_count.generic_flight_recorder():
        pytest.skip("torch < 2.8 has no recorder for gloo to write a record with")
    env = {**os.environ, FLIGHT_RECORDER_ENV: "100"}
    written = subprocess.run([sys.executable, "-c", RECORD, str(tmp_path / "store")], env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert written.returncode == 0, written.stderr
    record = json.loads(written.stdout)
    record["pg_status"]["0"]["last_completed_collective"] = "1"  # collective 2 never completed on this rank
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *flags: json.dumps(record).encode(), raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *flags: b'{"entries": []}')  # gloo's: none of NCCL's
    monkeypatch.setattr(collective_count, "_default_backend", lambda: "nccl")
    monkeypatch.setenv(FLIGHT_RECORDER_ENV, "100")
    wait = watchdog._recorded_wait()
    assert wait.startswith("gloo:all_reduce on group default_pg (its collective 2, issued ")
    assert wait.endswith("input sizes [[3]]; torch's flight recorder)")
    monkeypatch.setattr(collective_count, "_default_backend", lambda: "gloo")  # the same record is not gloo's
    assert watchdog._recorded_wait() is None


def test_once_stop_returns_no_store_call_is_in_flight_nor_begins(tmp_path):
    """A store call runs in C++ with the GIL released. One still running on a daemon thread when the interpreter
    ends is cut off by CPython 3.11's pthread_exit, whose unwinding through torch's noexcept frames aborts the
    process ("terminate called without an active exception", rank 0 of a finished 2-rank run, exit code -6): so
    stop() returns only once the watchdog's threads are done with the store."""
    from optimum_gaudi.supervision import watchdog

    class SlowStore(FakeStore):
        def __init__(self) -> None:
            super().__init__()
            self.in_flight, self.in_check, self.stopped = 0, threading.Event(), False
            self.after_stop: list[str] = []

        def _call(self, name, function, *args):
            if self.stopped:
                self.after_stop.append(name)
            self.in_flight += 1
            try:
                return function(*args)
            finally:
                self.in_flight -= 1

        def set(self, key, value):
            return self._call("set", super().set, key, value)

        def check(self, keys):
            def slow(keys):
                self.in_check.set()
                threading.Event().wait(0.5)  # a store answering slowly
                return FakeStore.check(self, keys)

            return self._call("check", slow, keys)

    store = SlowStore()
    dog = watchdog.Watchdog(store, 0, 2, tmp_path, limit=1.0)
    dog.start()
    assert store.in_check.wait(10)  # the thread's tick is inside a store call
    dog.stop()
    in_flight = store.in_flight
    store.stopped = True
    threading.Event().wait(0.6)  # a tick would have begun by now
    assert (in_flight, store.after_stop) == (0, [])
    assert not dog._thread.is_alive() and not dog._store._thread.is_alive()
