"""FSDP2's sharded checkpoints in real jobs: two launches of tests/scripts/train_sharded.py, on 2 and 4 gloo
processes, each checking several things (written at SIGTERM and SIGKILL, resumed by a restarted job and by hand
exactly, resharded on another world size). The checks on one checkpoint made in this process:
tests/unit/checkpoints/test_sharded_checkpoints.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import cpu_fsdp
from support import SHARDED_FLAGS as FLAGS
from support import SHARDED_SCRIPT as SCRIPT
from support import SHARDED_WRAP as WRAP
from support import job_environment, launch_command

from optimum_gaudi.checkpoints import MANIFEST_NAME

# ---- training on 2 and 4 processes ------------------------------------------------------------------------------


def _launch(out: Path, world: int, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_command("--world_size", str(world), *flags),
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=out,
        timeout=400,
    )


pytestmark = cpu_fsdp  # FSDP on CPU processes


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """2 processes, batches of 4: an uninterrupted run, then a run stopped by SIGTERM after step 3 that the
    launcher's agent restarts; it resumes on its own, loses rank 1 to SIGKILL while saving checkpoint-4, and is
    restarted again (--max_restarts 2)."""
    out = tmp_path_factory.mktemp("sharded")
    script = [str(SCRIPT), str(out), "job", "--output_dir", str(out / "run"), "--per_device_train_batch_size", "4"]
    # no state_dict_type: sharded by default; the shards written in the background
    flags = [*FLAGS, "--fsdp_config", f"{{{WRAP}}}", "--async_save"]
    return out, _launch(out, 2, "--max_restarts", "2", *script, *flags)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(path)


def test_sigterm_and_sigkill_leave_sharded_checkpoints_the_restarted_job_resumes_exactly(job):
    out, result = job
    assert result.returncode == 0, result.stderr[-4000:]
    assert "checkpoint-3 written in" in result.stderr  # the SIGTERM line: the step in flight was saved
    assert f"Restart 1 of this job: resuming from {out / 'run' / 'checkpoint-3'}" in result.stderr
    # killed half-way through checkpoint-4 (the model's shards written, rank 1's optimizer shard not): never picked
    assert "(exitcode: -9) local_rank: 1" in result.stderr
    assert f"Restart 2 of this job: resuming from {out / 'run' / 'checkpoint-3'}" in result.stderr
    checkpoint = out / "run" / "checkpoint-3"
    listed = json.loads((checkpoint / MANIFEST_NAME).read_text())["files"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # every rank's shards, listed after all were written
        assert {f"{folder}/.metadata", f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp"} <= listed.keys()
    assert not list(out.glob("run/.staging-*"))
    whole, resumed = (json.loads((out / f"{name}.json").read_text()) for name in ("whole", "resumed"))
    assert resumed["resumed_from"] == str(checkpoint)
    assert len(whole["losses"]) == 6 and resumed["losses"] == whole["losses"]
    a, b = _weights(out / "whole.safetensors"), _weights(out / "resumed.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # --async_save: a save returns before its checkpoint is published (training goes on), but for the last one
    assert resumed["published_at_save"] == {"4": False, "6": True}
    assert sorted(p.name for p in (out / "run").iterdir()) == [f"checkpoint-{n}" for n in (2, 3, 4, 6)]
    assert_no_rank_published_the_poisoned_checkpoint(out / "poisoned", result.stderr, world=2)


def assert_no_rank_published_the_poisoned_checkpoint(run: Path, stderr: str, world: int) -> None:
    """train_sharded.py's poisoned run: a NaN in the last rank's shard at step 4; every rank leaves checkpoint-4
    out (one line from that rank, one from rank 0), checkpoint-2 stays (--save_total_limit 1 rotated nothing)."""
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    last = world - 1
    assert (
        f"checkpoint-4 not written: the weights hold a NaN or inf (model.layers.1.mlp.up_proj.weight, rank {last})"
        in stderr
    )
    assert "checkpoint-4 not written: the weights hold a NaN or inf (on another rank)" in stderr


def test_a_sharded_checkpoint_saved_on_2_processes_resumes_on_4(job):
    """The same global batch (4 processes of 2): DCP reshards weights and optimizer state, and the run goes on as
    the uninterrupted one on 2 processes did (up to the order of the sums)."""
    out, result = job
    assert result.returncode == 0, result.stderr[-4000:]
    run = out / "on4" / "run"
    shutil.copytree(out / "run" / "checkpoint-3", run / "checkpoint-3")
    script = [str(SCRIPT), str(out / "on4"), "resume", "--output_dir", str(run), "--per_device_train_batch_size", "2"]
    sharded = f'{{{WRAP}, "state_dict_type": "SHARDED_STATE_DICT"}}'  # saved as the job did, but synchronously
    resized = _launch(out / "on4", 4, *script, *FLAGS, "--fsdp_config", sharded, "--resume_from_checkpoint", "true")
    assert resized.returncode == 0, resized.stderr[-4000:]
    whole, on4 = json.loads((out / "whole.json").read_text()), json.loads((out / "on4" / "resized.json").read_text())
    assert on4["world"] == 4 and on4["resumed_from"] == str(run / "checkpoint-3")
    assert on4["losses"] == pytest.approx(whole["losses"], abs=1e-4)
    a, b = _weights(out / "whole.safetensors"), _weights(out / "on4" / "resized.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert_no_rank_published_the_poisoned_checkpoint(out / "on4" / "poisoned", resized.stderr, world=4)
