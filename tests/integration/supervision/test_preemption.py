"""Preemption (issue 21, point 5): SIGTERM during training finishes the step in flight, writes a complete
checkpoint and exits 143; resuming from it trains exactly as the uninterrupted run did.

Each run is a fresh process (tests/scripts/train_preemptible.py) stopped at a random moment after training
began (seeded), also during checkpoint saves; then `--resume_from_checkpoint true` runs to the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch
from support import SCRIPTS, job_environment, launch_command
from transformers import TrainingArguments

from optimum_gaudi.checkpoints import checkpoint_problem, checkpoint_step, latest_complete_checkpoint
from optimum_gaudi.supervision.preemption import EXIT_CODE

SCRIPT = SCRIPTS / "train_preemptible.py"
STEPS = 200
FLAGS = (
    "--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", "50", "--logging_steps", "1",
    "--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0",
)  # fmt: skip


def _command(out: Path, *extra: str, processes: int = 1) -> list[str]:
    script = [str(SCRIPT), str(out), "--output_dir", str(out / "run"), *FLAGS, *extra]
    if processes == 1:
        return [sys.executable, *script]
    return launch_command("--world_size", str(processes), *script)


def _run(out: Path, *extra: str, processes: int = 1) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {**job_environment(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        _command(out, *extra, processes=processes), capture_output=True, text=True, env=env, timeout=300
    )


def _start(out: Path, processes: int = 1, extra: tuple = ()) -> subprocess.Popen:
    """Start a run and wait until training began."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**job_environment(), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(_command(out, *extra, processes=processes), stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not (out / "started").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not (out / "started").exists():
        job.kill()
        raise AssertionError(f"training did not start: {job.communicate()[1][-3000:]}")
    return job


def _stop_at_random(out: Path, delay: float, processes: int = 1, extra: tuple = ()) -> tuple[int, str]:
    """Start a run, SIGTERM it (the launcher, for several processes) ``delay`` s after training began; the job
    must end well before the minute its teardown would take (tests/scripts/train_preemptible.py), once every
    rank's exit handlers ran."""
    job = _start(out, processes, extra)
    try:
        time.sleep(delay)
        job.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert time.monotonic() - signalled < 30, f"the job took {time.monotonic() - signalled:.0f} s to end"
    assert len(list(out.glob("exit_handlers_ran.rank*"))) == processes, err[-3000:]
    return job.returncode, err


def _same_weights(a: Path, b: Path) -> bool:
    x, y = safetensors.torch.load_file(a), safetensors.torch.load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    result = _run(out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


JIT = ("--enable_jit_checkpoint", "true") if "enable_jit_checkpoint" in TrainingArguments.__dataclass_fields__ else ()


@pytest.mark.parametrize("run, flags", [(0, ()), (1, ()), (2, JIT)], ids=["run0", "run1", "run2-jit-checkpoint"])
def test_sigterm_at_a_random_moment_loses_no_step_and_resumes_exactly(tmp_path, uninterrupted, run, flags):
    """transformers 5's --enable_jit_checkpoint (run 2) takes the same path: one checkpoint, written crash-safe."""
    delay = random.Random(run).uniform(0.0, 2.5)  # training takes about 3.5 s here; saves every 50 steps
    code, err = _stop_at_random(tmp_path, delay, extra=flags)
    assert code == EXIT_CODE, err[-3000:]
    finished = int((tmp_path / "signal_step").read_text())  # steps done when the signal came
    newest = latest_complete_checkpoint(tmp_path / "run")
    assert newest is not None and checkpoint_problem(newest) is None
    # the step in flight was finished and saved, no later one (global_step counts a step before its step-end
    # callbacks run: a signal landing between the two finds the step already counted)
    assert finished <= checkpoint_step(newest) <= finished + 1
    assert "Resume with --resume_from_checkpoint true." in err
    assert not list(newest.glob("checkpoint-is-incomplete*"))  # transformers' JIT sentinel never written
    assert not (tmp_path / "result.json").exists()  # the script did not go on after train()

    resumed = _run(tmp_path, "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = json.loads((tmp_path / "result.json").read_text())["losses"]
    assert losses == json.loads((uninterrupted / "result.json").read_text())["losses"]
    assert len(losses) == STEPS
    assert _same_weights(tmp_path / "weights.safetensors", uninterrupted / "weights.safetensors")


def test_sigterm_to_one_rank_stops_both_at_one_step_without_a_collective_per_step_and_the_job_resumes_exactly(
    tmp_path,
):
    """SIGTERM to rank 1 alone, as Slurm signals the ranks (the launcher passing it on to every rank: the SIGKILL
    test below and tests/integration/launch/test_launch_jobs.py): rank 0 learns it through the job's store (issue 38, point 1), both stop
    after the same step with one checkpoint, no collective ran on the host group in the steps before, the launcher
    exits 143 (a scheduler reads 143 as a preemption, 1 as a failure), and the job resumes to the weights of an
    uninterrupted 2-process run."""
    reference = _run(tmp_path / "uninterrupted", processes=2)
    assert reference.returncode == 0, reference.stderr[-3000:]
    stopped = tmp_path / "stopped"
    job = _start(stopped, processes=2, extra=("--logging_steps", "1000"))  # logging steps gather step times
    try:
        time.sleep(1.0)
        os.kill(int((stopped / "pid.rank1").read_text()), signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == EXIT_CODE, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("error: every rank stopped on SIGTERM after writing"), err[-3000:]
    # no host collective after the first step (the old agreement all-reduced on every step)
    assert [int((stopped / f"host_collectives.rank{r}").read_text()) for r in (0, 1)] == [0, 0]
    finished = int((stopped / "signal_step.rank1").read_text())
    assert not (stopped / "signal_step.rank0").exists()  # rank 0 was never signalled
    newest = latest_complete_checkpoint(stopped / "run")
    # the step after the one in flight: peers may have ended the step in flight already (supervision/preemption.py)
    assert newest is not None and finished < checkpoint_step(newest) <= finished + 2
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(newest))  # both ranks saved their part

    resumed = _run(stopped, "--resume_from_checkpoint", "true", processes=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _same_weights(stopped / "weights.safetensors", tmp_path / "uninterrupted" / "weights.safetensors")


def test_sigkill_to_the_launcher_still_leaves_the_checkpoint_of_the_step_in_flight(tmp_path):
    """The killed launcher's ranks get SIGTERM (torchrun's parent-death signal passed on) and write into the pipe
    of a process that is gone: their output goes nowhere, but the checkpoint they announce is written."""
    job = _start(tmp_path, processes=2)
    try:
        job_processes = psutil.Process(job.pid).children(recursive=True)  # torchrun and the two ranks
        time.sleep(0.5)
        job.kill()
        job.communicate(timeout=30)
        _, alive = psutil.wait_procs(job_processes, timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert len(job_processes) == 3 and not alive, "the job outlived its launcher by a minute"
    newest = latest_complete_checkpoint(tmp_path / "run")
    assert newest is not None, "no checkpoint"
    finished = int((tmp_path / "signal_step").read_text())
    assert finished <= checkpoint_step(newest) <= finished + 1
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(newest))  # both ranks saved their part
