"""FSDP2's sharded checkpoints (torch.distributed.checkpoint folders) make every promise the single-device ones
make: published whole with every rank's shards in the manifest, checked complete and of the same model before
resuming, written at SIGTERM, resumed by a restarted job and by hand exactly, and resharded on another world size.

The checks read a checkpoint made in this process (DCP saves without a process group as one rank); the training
runs are two launches of tests/scripts/train_sharded.py on 2 and 4 gloo processes, each checking several things.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import tiny
import torch
import torch.distributed.checkpoint as dcp
from support import SHARDED_FLAGS as FLAGS
from support import SHARDED_SCRIPT as SCRIPT
from support import SHARDED_WRAP as WRAP
from support import job_environment, launch_command
from transformers.trainer_callback import TrainerState

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import (
    MANIFEST_NAME,
    CheckpointError,
    check_sharded_resume,
    check_weights_fit,
    checkpoint_problem,
    latest_complete_checkpoint,
    resolve_resume,
)
from optimum_gaudi.errors import UserError

# ---- the checks, on a checkpoint laid out as FSDP writes it ---------------------------------------------------


def sharded_checkpoint(directory: Path, model=None) -> Path:
    """``model``'s weights and an optimizer state in DCP folders, as accelerate saves them, with a trainer state
    and a scheduler: a complete checkpoint (no manifest, as one written by another tool)."""
    model = model or tiny.llama()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=directory / "pytorch_model_fsdp_0")
        dcp.save({"optimizer": {"step": torch.tensor(3.0)}}, checkpoint_id=directory / "optimizer_0")
    TrainerState(global_step=3).save_to_json(str(directory / "trainer_state.json"))
    torch.save({}, directory / "scheduler.pt")
    return directory


class Payload:
    def __reduce__(self):
        return os.system, ("touch payload-ran",)


def _smuggled_call() -> bytes:
    """A pickle that reaches os.system through a module DCP's metadata classes live in (a dotted name)."""
    module, name, arg = b"torch.distributed.checkpoint.filesystem", b"os.system", b"touch payload-ran"
    text = b"".join(b"\x8c" + bytes([len(t)]) + t for t in (module, name))
    return b"\x80\x04" + text + b"\x93\x8c" + bytes([len(arg)]) + arg + b"\x85R."


def _truncate(shard: Path) -> None:
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)


@pytest.mark.parametrize(
    "damage, words",
    [
        (
            lambda c: _truncate(c / "pytorch_model_fsdp_0" / "__0_0.distcp"),
            "pytorch_model_fsdp_0/__0_0.distcp is trunc",
        ),
        (lambda c: (c / "optimizer_0" / "__0_0.distcp").unlink(), "optimizer_0/__0_0.distcp is missing (a rank's"),
        (lambda c: _truncate(c / "optimizer_0" / ".metadata"), "optimizer_0/.metadata is unreadable"),
        (
            lambda c: (c / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Payload())),
            "pytorch_model_fsdp_0/.metadata is not DCP metadata (posix.system is not part of",
        ),
        (
            lambda c: (c / "optimizer_0" / ".metadata").write_bytes(_smuggled_call()),
            "optimizer_0/.metadata is not DCP metadata (torch.distributed.checkpoint.filesystem.os.system is not",
        ),
    ],
    ids=["truncated-shard", "missing-shard", "truncated-metadata", "foreign-pickle", "dotted-name"],
)
def test_a_damaged_sharded_checkpoint_is_incomplete_in_one_line(tmp_path, monkeypatch, damage, words):
    monkeypatch.chdir(tmp_path)
    older = sharded_checkpoint(tmp_path / "checkpoint-2")
    assert checkpoint_problem(older) is None
    newest = sharded_checkpoint(tmp_path / "checkpoint-3")
    damage(newest)
    assert words in checkpoint_problem(newest)
    with pytest.raises(CheckpointError, match="Can't find a valid checkpoint") as refused:
        resolve_resume(str(newest), tmp_path)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    assert latest_complete_checkpoint(tmp_path) == older
    assert not (tmp_path / "payload-ran").exists()


def test_a_sharded_checkpoint_of_another_model_is_refused_and_the_same_model_fits(tmp_path):
    checkpoint = sharded_checkpoint(tmp_path / "checkpoint-3")
    check_weights_fit(tiny.llama(seed=1), checkpoint)
    with pytest.raises(CheckpointError, match="holds another model") as refused:
        check_weights_fit(tiny.llama(hidden_size=64), checkpoint)
    line = str(refused.value)
    assert "(pytorch_model_fsdp_0/): model.embed_tokens.weight is 100x32 there and 100x64 here" in line
    assert "\n" not in line
    with pytest.raises(CheckpointError, match=r"it has 9 weight\(s\) \(model.layers.1."):
        check_weights_fit(tiny.llama(num_hidden_layers=1), checkpoint)


def test_a_run_that_cannot_load_sharded_weights_is_told_in_one_line_before_training(tmp_path):
    checkpoint = sharded_checkpoint(tmp_path / "checkpoint-3")
    args = GaudiTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", max_steps=6)
    trainer = GaudiTrainer(model=tiny.llama(), args=args, train_dataset=tiny.lm_data())
    trainer.training_step = lambda *a, **k: pytest.fail("a training step ran")
    with pytest.raises(CheckpointError, match="only a run with --fsdp loads") as refused:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "\n" not in str(refused.value)
    from torch.distributed.fsdp import StateDictType

    with pytest.raises(CheckpointError, match='resume with "state_dict_type": "SHARDED_STATE_DICT"'):
        check_sharded_resume(checkpoint, SimpleNamespace(state_dict_type=StateDictType.FULL_STATE_DICT))
    check_sharded_resume(checkpoint, SimpleNamespace(state_dict_type=StateDictType.SHARDED_STATE_DICT))


def test_fsdp_checkpoints_are_sharded_unless_the_config_names_a_state_dict_type(tmp_path):
    def fsdp_args(config: str, **flags) -> GaudiTrainingArguments:
        return GaudiTrainingArguments(
            output_dir=str(tmp_path), fsdp="full_shard", fsdp_config=json.loads(config), **flags
        )

    assert fsdp_args(f"{{{WRAP}}}").fsdp_plugin_args["state_dict_type"] == "SHARDED_STATE_DICT"
    only_model = fsdp_args(f"{{{WRAP}}}", save_only_model=True)  # which sharded checkpoints cannot be
    assert only_model.fsdp_plugin_args["state_dict_type"] == "FULL_STATE_DICT"
    full = fsdp_args(f'{{{WRAP}, "state_dict_type": "FULL_STATE_DICT"}}')
    assert full.fsdp_plugin_args["state_dict_type"] == "FULL_STATE_DICT"
    fsdp1 = fsdp_args(f'{{{WRAP}, "version": 1}}')  # whose final save_model writes no sharded model
    assert fsdp1.fsdp_plugin_args["state_dict_type"] == "FULL_STATE_DICT"
    with pytest.raises(UserError, match="^--async_save with --load_best_model_at_end") as refused:
        fsdp_args(f"{{{WRAP}}}", async_save=True, load_best_model_at_end=True, eval_strategy="steps", save_steps=500)
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="--async_save writes FSDP's sharded checkpoints") as refused:
        GaudiTrainingArguments(output_dir=str(tmp_path), async_save=True)
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="--async_save"):
        GaudiTrainingArguments(
            output_dir=str(tmp_path), fsdp="full_shard", fsdp_config={"state_dict_type": "FULL_STATE_DICT"},
            async_save=True,
        )  # fmt: skip


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
