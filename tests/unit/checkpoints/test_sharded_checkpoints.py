"""FSDP2's sharded checkpoints (torch.distributed.checkpoint folders) make every promise the single-device ones
make: published whole with every rank's shards in the manifest, checked complete and of the same model before
resuming, written at SIGTERM, resumed by a restarted job and by hand exactly, and resharded on another world size.

The checks read a checkpoint made in this process (DCP saves without a process group as one rank); the training
runs are two launches of tests/scripts/train_sharded.py on 2 and 4 gloo processes, each checking several things.

The launches: tests/integration/checkpoints/test_sharded_checkpoints_launches.py."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny
import torch
import torch.distributed.checkpoint as dcp
from conftest import cpu_fsdp
from support import SHARDED_WRAP as WRAP
from transformers.trainer_callback import TrainerState

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import (
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


@cpu_fsdp
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
