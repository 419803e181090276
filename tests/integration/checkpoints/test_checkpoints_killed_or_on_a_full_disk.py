"""Crash-safe checkpoints in real processes: killed at random moments during saves, a run always resumes from a
complete checkpoint; a really full disk (a small tmpfs, root only) leaves only complete checkpoints; under DDP
every rank writes into the staging directory and one publishes.

The kill test forks a real training process (GaudiTrainer, tiny GPT-2, a save every step) from a fork server
that imported torch and this module once, so each of the ~25 runs starts in a fraction of a second (forking
pytest itself, with the threads earlier tests left, can deadlock the child), and SIGKILLs it at a random moment of a
save; the next process resumes with ``resume_from_checkpoint=True`` and must get past loading everything.
``tests/scripts/kill_sweep.py`` does the same to run_clm.py in fresh processes, for a longer sweep. What complete
means and what resume picks, in process: tests/unit/checkpoints/test_crash_safe_checkpoints.py.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from support import SCRIPTS
from support import checkpointing_trainer as make_trainer
from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState

from optimum_gaudi.checkpoints import MANIFEST_NAME, checkpoint_problem, latest_complete_checkpoint, list_checkpoints


def assert_loadable(checkpoint: Path) -> int:
    """Everything resuming reads, read back; returns the checkpoint's step."""
    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    safetensors.torch.load_file(checkpoint / "model.safetensors")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.load(checkpoint / name, weights_only=False)
    return state.global_step


# ---- the kill test ----------------------------------------------------------------------------------------


class _Reporter(TrainerCallback):
    def __init__(self, conn) -> None:
        self.conn = conn

    def on_train_begin(self, args, state, control, **kwargs):
        self.conn.send(("resumed", state.global_step))  # everything of the checkpoint is loaded by now


def _train_until_killed(out: str, conn, resume: bool) -> None:
    """The forked child: train with a save every step, reporting the start and the end of each save."""
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    trainer = make_trainer(Path(out), callbacks=[_Reporter(conn)], max_steps=10_000)
    save = trainer._save_checkpoint

    def reported_save(model, trial):
        conn.send(("save", trainer.state.global_step))
        conn.recv()  # the parent's go: it then knows the save starts now, wherever the child's messages stand
        save(model, trial)
        conn.send(("saved", trainer.state.global_step))

    trainer._save_checkpoint = reported_save
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        os._exit(1)


def _wait_for(conn, kind: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(max(0.0, deadline - time.monotonic())):
            message = conn.recv()
            if message[0] == "failed":
                pytest.fail(f"the training process failed: {message[1]}")
            if message[0] == "save":
                conn.send("go")  # the child waits for it before saving
            if message[0] == kind:
                return message
    pytest.fail(f"no '{kind}' from the training process in {timeout} s")


def kill_during_saves(out: Path, kills: int, seed: int) -> dict[str, int]:
    """Kill a fresh training process ``kills`` times at a random moment of a save; after each kill the newest
    complete checkpoint must load, and the next process must resume from exactly that one."""
    rng, ctx = random.Random(seed), multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # a clean single-threaded server; each child is a cheap fork of it
    counts = {"kills": 0, "during_save": 0, "unusable_newest": 0, "resumed": 0}
    save_time = 0.05
    for _ in range(kills):
        newest = latest_complete_checkpoint(out)
        expected_step = assert_loadable(newest) if newest is not None else 0
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_train_until_killed, args=(str(out), child, newest is not None))
        process.start()
        assert _wait_for(parent, "resumed")[1] == expected_step
        counts["resumed"] += newest is not None
        for _ in range(rng.randint(0 if newest is not None else 1, 2)):  # a few saves complete first (one at least
            # on a fresh start: killed in its first save every time, the run would never get anywhere)
            _wait_for(parent, "saved")
        _wait_for(parent, "save")
        started = time.monotonic()  # the save's own duration feeds the estimate, not the step before it
        time.sleep(rng.uniform(0, save_time))
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        counts["kills"] += 1
        finished = False
        while parent.poll():
            kind, _ = parent.recv()
            if kind == "saved":
                finished, save_time = True, 0.8 * save_time + 0.2 * (time.monotonic() - started)
        counts["during_save"] += not finished
        newest = latest_complete_checkpoint(out)
        try:
            if newest is not None:
                assert_loadable(newest)
        except Exception:
            counts["unusable_newest"] += 1
    return counts


def test_sigkill_at_random_moments_of_saves_never_leaves_an_unusable_newest_checkpoint(tmp_path):
    kills = 18
    counts = kill_during_saves(tmp_path / "run", kills=kills, seed=0)
    print(f"kill test: {counts}")
    assert counts["kills"] == kills and counts["unusable_newest"] == 0, counts
    assert counts["during_save"] >= 3, counts  # some kills land inside a save (7 of 18 here, 8-11 of 24 before)
    assert counts["resumed"] == kills - 1, counts  # every round after the first resumed, from the newest complete one
    for checkpoint in list_checkpoints(tmp_path / "run"):  # not only the newest: every one is complete
        assert checkpoint_problem(checkpoint) is None, checkpoint


# ---- a full disk --------------------------------------------------------------------------------------------


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0


def test_a_really_full_disk_leaves_only_complete_checkpoints(tmp_path):
    """A 3 MB file system fills up after a few checkpoints (about 1 MB each): the save that fails leaves nothing."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "3m"):
        pytest.skip("mounting a small tmpfs needs root on Linux; the simulated case is in test_bad_inputs.py")
    try:
        trainer = make_trainer(disk / "run", max_steps=20)
        with pytest.raises(Exception) as failure:
            trainer.train()
        assert "no space left" in str(failure.value)
        published = list_checkpoints(disk / "run")
        assert published and all(checkpoint_problem(p) is None for p in published)
        assert not list((disk / "run").glob(".staging-*"))
    finally:
        subprocess.run(["umount", "--lazy", str(disk)])


# ---- several processes --------------------------------------------------------------------------------------


def test_ddp_every_rank_writes_into_the_staging_directory_and_one_publishes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), str(SCRIPTS / "train_tiny.py"), str(tmp_path / "losses.json"),
        "--output_dir", str(out), "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
        "--report_to", "none", "--disable_tqdm", "true", "--per_device_train_batch_size", "4",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert not list(out.glob(".staging-*"))
    for checkpoint in list_checkpoints(out):
        assert checkpoint_problem(checkpoint) is None
        manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())["files"]
        assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "model.safetensors"} <= set(manifest)
