"""A checkpoint from someone else cannot run code on resume (docs/security.md): each pickle a resume reads
carries a payload that would create a file if anything executed it."""

from __future__ import annotations

import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments


class Payload:
    """Unpickling this calls ``Path.touch(marker)``: the file existing means code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def trained_checkpoint(tmp_path, tiny_gpt2, tiny_lm_data) -> Path:
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=8, report_to=[]
    )
    GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data).train()
    return tmp_path / "run" / "checkpoint-2"


def resume(checkpoint: Path, tmp_path, tiny_gpt2, tiny_lm_data) -> None:
    """As from a checkpoint made elsewhere: no manifest (plain transformers writes none, a forger leaves it out),
    so the files' sizes are not checked and every load path is reached."""
    (checkpoint / "checkpoint_manifest.json").unlink()
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path / "resumed"), max_steps=3, per_device_train_batch_size=8, report_to=[]
    )
    GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data).train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_a_torch_pickle_with_a_payload_is_refused_not_run(name, tmp_path, tiny_gpt2, tiny_lm_data):
    checkpoint = trained_checkpoint(tmp_path, tiny_gpt2, tiny_lm_data)
    marker = tmp_path / "payload-ran"
    torch.save({"state": Payload(marker)}, checkpoint / name)
    with pytest.raises(pickle.UnpicklingError):  # weights_only=True: the payload's global is not allowed
        resume(checkpoint, tmp_path, tiny_gpt2, tiny_lm_data)
    assert not marker.exists()


def test_training_args_bin_is_read_without_running_anything(tmp_path, tiny_gpt2, tiny_lm_data):
    checkpoint = trained_checkpoint(tmp_path, tiny_gpt2, tiny_lm_data)
    marker = tmp_path / "payload-ran"
    torch.save(Payload(marker), checkpoint / "training_args.bin")  # what the resume check reads (save_only_model?)
    resume(checkpoint, tmp_path, tiny_gpt2, tiny_lm_data)  # transformers itself never loads it on resume
    assert not marker.exists()
    shutil.rmtree(tmp_path / "resumed")


@pytest.mark.parametrize(("version", "warned"), [("2.9.1+hpu", True), ("2.9.2", False), ("2.13.0+cpu", False)])
def test_resuming_pickles_on_a_torch_with_a_bypassable_loader_is_said(
    version, warned, tmp_path, tiny_gpt2, tiny_lm_data, monkeypatch, caplog
):
    checkpoint = trained_checkpoint(tmp_path, tiny_gpt2, tiny_lm_data)
    monkeypatch.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING):
        resume(checkpoint, tmp_path, tiny_gpt2, tiny_lm_data)
    said = [r.getMessage() for r in caplog.records if "CVE-2026-24747" in r.getMessage()]
    assert len(said) == (1 if warned else 0)
    if warned:
        assert "optimizer.pt" in said[0] and "rng_state.pth" in said[0]
