"""A stalled, slow or diverging rank never wastes the cluster (issue 38): every group honours --ddp_timeout, the
SIGTERM agreement costs no collective, a stalled rank is reported and the job restarted, non-finite steps stop
or are skipped, stragglers are named.

Multi-process runs are few and short: each launch checks several things."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import threading

import pytest
from test_launch import SCRIPTS, job_environment, launch_command


def test_every_group_the_project_makes_honours_ddp_timeout(tmp_path):
    """The host group, --async_save's writer groups and the sequence-parallel groups fail after --ddp_timeout
    when a rank never joins (torch's new_group would wait its default 30 minutes)."""
    timeout = 3
    result = subprocess.run(
        launch_command("--world_size", "2", str(SCRIPTS / "group_timeouts.py"), str(tmp_path))
        + ["--ddp_timeout", str(timeout)],
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    waits = json.loads((tmp_path / "waits.json").read_text())
    assert set(waits) == {"host", "async_save_model", "sequence_parallel"}
    for name, wait in waits.items():
        assert wait["failed"] and timeout - 0.5 < wait["seconds"] < timeout + 3, (name, wait)


# ---- the progress watchdog (point 2) ------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_stopped_rank_an_endless_loop_and_a_collective_never_joined_are_reported_and_restarted(tmp_path, world_size):
    """One job, three attempts (--max_restarts 2): in each, the last rank stalls another way after a checkpoint
    (tests/scripts/train_stalls.py). Each time every rank writes its stacks and the collective it waits in, the
    deciding rank one line, and torchrun restarts the job from the newest complete checkpoint; the last attempt's
    line is the launcher's. (A first step, save or evaluation outlasting the limit: the in-process tests below.)"""
    out, last = tmp_path / "run", world_size - 1
    result = subprocess.run(
        launch_command("--world_size", str(world_size), "--max_restarts", "2", str(SCRIPTS / "train_stalls.py"))
        + [str(tmp_path), "5", "--output_dir", str(out), "--max_steps", "16", "--save_strategy", "steps"]
        + ["--save_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--report_to", "none"]
        + ["--disable_tqdm", "true", "--hang_timeout", "6"],
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=500,
    )
    errors = "\n".join(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert result.returncode != 0, result.stderr[-3000:]
    folders = sorted(out.glob("hang-*"))
    assert len(folders) == 3, result.stderr[-3000:]
    final = result.stderr.rstrip().splitlines()[-1]
    assert final == f"error: {(folders[-1] / 'summary.txt').read_text().strip()} (after 2 restart(s))", final
    assert final.startswith(f"error: rank {last} made no progress for ") and str(folders[-1]) in final
    assert "Restart 1 of this job: resuming from" in result.stderr
    assert "Restart 2 of this job: resuming from" in result.stderr
    # no checkpoint newer than a stall was published while the job ended (stalls after steps 5 and 9)
    resumed = [json.loads((tmp_path / f"attempt-{n}.json").read_text())["resumed_at"] for n in range(3)]
    assert resumed == [0, 4, 8], resumed
    # one line per stall from the deciding rank, and the launcher's
    assert [line.startswith(f"error: rank {last} made no progress") for line in errors.splitlines()] == [True] * 4, (
        errors
    )
    reports = [{rank: (folder / f"rank{rank}.txt").read_text() for rank in range(world_size)} for folder in folders]
    for report in reports:
        for text in report.values():
            assert "Python stacks of every thread" in text and 'File "' in text
        for rank in range(last):
            assert "waiting in: gloo:" in report[rank]  # the others wait for the last rank in a collective
    stopped, looping, blocked = reports
    assert f"stalled: rank(s) {last}: its process stopped running" in stopped[0]
    assert "in endless_loop" in looping[last] and "waiting in: no collective" in looping[last]
    assert "waiting in: gloo:all_reduce on group #" in blocked[last]  # the group the others never join


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
    """SIGTERM's agreement (distributed/agreement.py) on a store in memory: ranks asked at the ends of steps 3
    and 4 (a step end apart) stop after 4; a rank asked alone makes every rank stop after the next step."""
    from optimum_gaudi.distributed.agreement import StopAgreement

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
    from optimum_gaudi.distributed import watchdog

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
    from optimum_gaudi.distributed import watchdog

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
    from optimum_gaudi.distributed import watchdog

    exits = []
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: exits.append(code))
    dog = watchdog.Watchdog(FakeStore(), 0, 2, tmp_path, limit=1.0)
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


def test_a_rank_whose_training_ended_is_not_taken_for_a_stopped_one(tmp_path):
    from optimum_gaudi.distributed.watchdog import FINISHED

    dog, peer, verdicts = watchdog_pair(tmp_path)
    dog.step_begin(1)
    dog.step_end(1)
    peer(7, 2, paused=FINISHED)
    dog._tick()
    dog._seen[1] = (7, dog._seen[1][1] - 10)
    dog._tick()
    assert verdicts == []


def test_the_default_limit_comes_from_the_runs_own_times_with_a_floor():
    from optimum_gaudi.distributed.watchdog import AUTO_FLOOR_SECONDS, auto_limit

    assert auto_limit(0.5, 10.0) == AUTO_FLOOR_SECONDS == 60
    assert auto_limit(12.0, 10.0) == 120  # 10 x the slowest step
    assert auto_limit(1.0, 90.0) == 180  # 2 x the slowest save or evaluation


# ---- stragglers (point 4) and non-finite steps on several processes (point 3) -------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_slow_rank_is_logged_and_named_once_and_a_nan_or_spike_on_one_rank_is_skipped_on_every_rank_then_stops(
    tmp_path, world_size
):
    """The last rank is slow every step, its loss is NaN at steps 9, 13 and 14 and spikes (x 1000) at step 7
    (tests/scripts/train_stragglers.py): each logging step records the slowest and fastest rank, the slow one is
    named once; steps 7 and 9 are skipped on every rank (no AdamW stepped; the spike judged on the ranks' mean loss
    against its running median, --loss_spike_factor 20 over a window of 5), steps 13 and 14 are two in a row
    (--max_nonfinite_skips 1): one line, exit 2."""
    out, last = tmp_path / "run", world_size - 1
    result = subprocess.run(
        launch_command("--world_size", str(world_size), str(SCRIPTS / "train_stragglers.py"), str(tmp_path))
        + ["9,13,14", "7", "--output_dir", str(out), "--max_steps", "16", "--save_strategy", "steps", "--save_steps"]
        + ["4", "--logging_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none"]
        + ["--disable_tqdm", "true", "--on_nonfinite", "skip", "--max_nonfinite_skips", "1"]
        + ["--loss_spike_factor", "20", "--loss_spike_window", "5"],
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.rstrip().splitlines()[-1] == (
        f"error: step 14: the loss is nan on rank {last} (gradient norm nan): 2 such steps in a row; stopped before "
        "its optimizer step (--max_nonfinite_skips 1 skips at most that many in a row)."
    )
    assert f"step 9: the loss is nan on rank {last} (gradient norm nan); step skipped" in result.stderr
    assert re.search(r"step 7: the loss \S+ is over 20 x the running median \S+; step skipped", result.stderr)
    steps = [(tmp_path / f"optimizer_steps.rank{r}").read_text() for r in range(world_size)]
    assert steps == ["10"] * world_size
    assert result.stderr.count(f"Rank {last} has been slower than the median rank for 3 logging intervals") == 1
    history = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
    logged = [h for h in history if "loss" in h]
    assert len(logged) == 6 and all(h["slowest_rank"] == last and h["fastest_rank"] != last for h in logged)
    assert all(h["slowest_rank_step_time"] > h["fastest_rank_step_time"] + 0.1 for h in logged)
    assert [h["nonfinite_skipped_steps"] for h in logged] == [0, 0, 0, 1, 2, 2]
    assert not list(out.glob("hang-*"))  # the watchdog (on by default) never fired
