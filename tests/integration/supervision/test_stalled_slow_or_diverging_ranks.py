"""A stalled, slow or diverging rank never wastes the cluster (issue 38): every group honours --ddp_timeout, the
SIGTERM agreement costs no collective, a stalled rank is reported and the job restarted, non-finite steps stop
or are skipped, stragglers are named.

Multi-process runs are few and short: each launch checks several things.

The watchdog and SIGTERM's agreement in process: tests/unit/supervision/test_watchdog_and_sigterm_agreement.py."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from conftest import FAKES
from support import SCRIPTS, job_environment, launch_command

from optimum_gaudi.supervision.collective_count import generic_flight_recorder

# gloo's collectives as the report names them: torch's flight recorder's ("gloo:all_reduce on group #0 (...)"), or
# on torch 2.6 and 2.7, whose recorder holds NCCL's only, the project's count's ("all_reduce on the default group")
GLOO = "gloo:" if generic_flight_recorder() else ""  # the launched ranks turn the recorder on


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
            # the others wait for the last rank in a collective
            assert re.search(rf"waiting in: {GLOO}(all_reduce|all_gather|broadcast)", report[rank]), report[rank]
    stopped, looping, blocked = reports
    assert f"stalled: rank(s) {last}: its process stopped running" in stopped[0]
    # continued to write its stacks, the stopped rank joins the collective the others wait in: they wrote theirs
    # before, so they show where they waited at the stall, not wherever training had since gone
    for rank in range(last):
        assert "last progress after step 5, " in stopped[rank], stopped[rank][:400]
    assert "in endless_loop" in looping[last] and "waiting in: no collective" in looping[last]
    assert f"waiting in: {GLOO}all_reduce on group " in blocked[last]  # the group the others never join


def on_two_simulated_gaudis(tmp_path, script_and_flags: list[str], gaudis: bool = True) -> None:
    """A script of tests/scripts launched on 2 simulated Gaudis (--use_habana; with ``gaudis`` False on 2 CPU
    processes over gloo) into tmp_path/run; it must fail (the watchdog ends the job)."""
    env = {k: v for k, v in job_environment().items() if not k.startswith(("PT_HPU", "FAKE_HPU"))}
    if gaudis:
        env.update(PYTHONPATH=os.pathsep.join([FAKES, env["PYTHONPATH"]]), FAKE_HPU_DEVICE="1")
        env.update(FAKE_HPU_DEVICE_COUNT="2")
    script, *flags = script_and_flags
    result = subprocess.run(
        launch_command("--world_size", "2", str(SCRIPTS / script))
        + [*flags, "--output_dir", str(tmp_path / "run"), "--save_strategy", "no", "--logging_steps", "1"]
        + ["--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true"]
        + (["--use_habana"] if gaudis else []),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode != 0, result.stderr[-3000:]


def test_a_stopped_rank_on_two_simulated_gaudis_is_reported_without_a_collective_count_or_flight_record(tmp_path):
    """On simulated Gaudis (issue 46, point 1: 'hccl' without a timeout, sequence numbers or a flight record, as the
    bridge), rank 1 stops itself (SIGSTOP) after step 5: the other rank waits in an HCCL collective that never
    times out, the watchdog names the stopped rank, and the reports give what HCCL does not keep from the project's
    own count (point 4): the collectives issued, and the one waited in with its call site."""
    out = tmp_path / "run"
    on_two_simulated_gaudis(
        tmp_path, ["train_stalls.py", str(tmp_path), "5", "--max_steps", "12", "--hang_timeout", "6"]
    )
    (folder,) = out.glob("hang-*")
    reports = {rank: (folder / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert "stalled: rank(s) 1: its process stopped running" in reports[0], reports[0][:600]
    count = re.search(r"collectives issued on the default group: (\d+) \(optimum-gaudi's count", reports[0])
    assert count and int(count.group(1)) > 5, reports[0][:600]
    waiting = next(line for line in reports[0].splitlines() if line.startswith("waiting in: "))
    # rank 0 went on to step 5's log: transformers gathers the loss (logging every step)
    assert waiting.startswith("waiting in: all_gather on the default group (its collective "), waiting
    assert "from transformers/trainer_pt_utils.py:" in waiting and waiting.endswith("; optimum-gaudi's count)")


def test_on_simulated_gaudis_a_long_compile_in_step_2_never_fires_and_a_stall_in_step_3_fires_after_the_long_limit(
    tmp_path,
):
    """Issue 46, point 3, on 2 simulated Gaudis (--use_habana): rank 1's forward takes 8 s in step 2 (a compile, 4x
    --hang_timeout 2) and never returns in step 3. Steps 1-3 of a process may compile: the first passes, the second
    fires after the compiling steps' own limit (point 2: twice the longest measured, step 2's 8 s, over the 12 s
    floor --hang_long_timeout), not after the 2 s limit."""
    out = tmp_path / "run"
    script = ["train_compiles.py", str(tmp_path), "2", "8", "3", "--max_steps", "6"]
    on_two_simulated_gaudis(tmp_path, [*script, "--hang_timeout", "2", "--hang_long_timeout", "12"])
    (folder,) = out.glob("hang-*")  # one verdict: step 2's 8 s did not fire
    summary = (folder / "summary.txt").read_text()
    assert " in step 3 " in summary, summary
    # HCCL counts no collectives; the project's count (point 4) tells the rank looping in step 3's forward from the
    # rank waiting in its gradient all-reduce
    assert summary.startswith("rank 1 made no progress") and "went on to the next collective" in summary, summary
    seconds = int(re.search(r"made no progress for (\d+) s", summary).group(1))
    assert 16 <= seconds < 24, summary
    ended = json.loads((tmp_path / "steps.json").read_text())
    assert ended["2"] - ended["1"] >= 8, ended  # the slow step ran its course


@pytest.mark.parametrize("gaudis", [True, False], ids=["simulated-hccl", "gloo"])
def test_a_collective_the_others_never_join_within_a_step_names_its_rank_on_simulated_gaudis_as_on_gloo(
    tmp_path, gaudis
):
    """Issue 46, point 4: in step 5's forward rank 1 all-reduces on a group rank 0 never joins; rank 0 goes on to
    its gradient all-reduce. Both are in step 5: only the collectives issued tell them apart, torch's count on gloo,
    the project's own on simulated hccl (which keeps none). Either way the verdict names rank 1, and its report
    names the collective it waits in (on hccl with its call site)."""
    out = tmp_path / "run"
    script = ["train_missed_collective.py", "5", "--max_steps", "8", "--hang_timeout", "6"]
    on_two_simulated_gaudis(tmp_path, script, gaudis=gaudis)
    (folder,) = out.glob("hang-*")
    summary = (folder / "summary.txt").read_text()
    assert summary.startswith("rank 1 made no progress") and " in step 5 " in summary, summary
    assert "went on to the next collective" in summary, summary
    reports = {rank: (folder / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    waiting = {
        rank: next(ln for ln in text.splitlines() if ln.startswith("waiting in: ")) for rank, text in reports.items()
    }
    if gaudis:
        assert waiting[1].startswith("waiting in: all_reduce on group "), waiting[1]
        assert "train_missed_collective.py:" in waiting[1] and "(hook); optimum-gaudi's count)" in waiting[1]
        assert "from DDP's reducer" in waiting[0], waiting[0]
    elif GLOO:
        assert "gloo:all_reduce" in waiting[1] and "flight recorder" in waiting[1], waiting[1]
    else:  # torch 2.6 and 2.7: the project's count, as on hccl
        assert waiting[1].startswith("waiting in: all_reduce on group ") and "optimum-gaudi's count" in waiting[1]


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
