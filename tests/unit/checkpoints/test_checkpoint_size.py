"""Room for one checkpoint, checked when train() starts (optimum_gaudi/trainers/checkpoint_size.py): a disk too
small is one line before step 1, not a full disk at the first save. The free space is simulated.

On 2 processes with FSDP2: tests/integration/checkpoints/test_checkpoint_size_on_two_processes.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import tiny

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.errors import UserError
from optimum_gaudi.trainers.checkpoint_size import check_room_for_a_checkpoint, estimate_checkpoint_size

MIB = 2**20
WIDE = dict(n_embd=128, n_layer=2)  # 1.6 MiB of weights: more than the simulated disks hold


def make_trainer(out: Path, model=None, **flags) -> GaudiTrainer:
    args = GaudiTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, report_to="none", disable_tqdm=True,
        **{"max_steps": 1, "save_strategy": "steps", "save_steps": 1, **flags},
    )  # fmt: skip
    return GaudiTrainer(model=model or tiny.gpt2(**WIDE), args=args, train_dataset=tiny.lm_data())


@pytest.fixture
def free_space(monkeypatch):
    """``free_space(n)``: the file system of every path has ``n`` bytes free."""

    def simulate(free: int) -> None:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))

    return simulate


@pytest.fixture
def no_step(monkeypatch):
    monkeypatch.setattr(GaudiTrainer, "training_step", lambda *a, **k: pytest.fail("a training step ran"))


def test_the_estimate_is_a_close_lower_bound_of_a_real_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path)
    size = estimate_checkpoint_size(trainer.model, trainer.args)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    weights = (checkpoint / "model.safetensors").stat().st_size
    optimizer = (checkpoint / "optimizer.pt").stat().st_size
    assert 0.99 * weights <= size.weights <= weights
    assert 0.99 * optimizer <= size.optimizer <= optimizer
    assert size.trusted


@pytest.mark.parametrize(
    "flags, tensors",
    [({}, 2), ({"optim": "adagrad"}, 1), ({"optim": "sgd"}, 0), ({"save_only_model": True}, 0)],
)
def test_the_optimizer_state_follows_optim(tmp_path, flags, tensors):
    trainer = make_trainer(tmp_path, **flags)
    size = estimate_checkpoint_size(trainer.model, trainer.args)
    assert size.optimizer == tensors * size.weights  # every weight of the GPT-2 trains, in float32


def test_a_peft_model_counts_only_its_adapters(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny.gpt2(**WIDE), LoraConfig(r=4, target_modules=["c_attn"]))
    size = estimate_checkpoint_size(model, make_trainer(tmp_path, model=model).args)
    adapters = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert size.weights == adapters and size.optimizer == 2 * adapters


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_step_1(tmp_path, free_space, no_step):
    trainer = make_trainer(tmp_path / "run")
    free_space(2 * MIB)
    with pytest.raises(UserError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "one checkpoint needs at least 4.7 MiB (weights 1.6 MiB, optimizer state 3.1 MiB)" in message
    assert "only 2.0 MiB is free" in message and "--save_only_model" in message
    assert not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("flags", [{"save_strategy": "no"}, {"save_only_model": True}])
def test_runs_that_save_less_fit_where_a_full_checkpoint_does_not(tmp_path, free_space, flags):
    trainer = make_trainer(tmp_path, **flags)
    free_space(2 * MIB)
    check_room_for_a_checkpoint(trainer)  # weights only (1.6 MiB), or nothing saved


def test_sharded_saves_only_warn(tmp_path, free_space, caplog):
    trainer = make_trainer(tmp_path)
    trainer.is_deepspeed_enabled = True  # DeepSpeed's own files: the estimate is a guess
    free_space(2 * MIB)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi.trainers.checkpoint_size"):
        check_room_for_a_checkpoint(trainer)
    assert "may need about 4.7 MiB" in caplog.text and "only an estimate" in caplog.text
