"""A run checks its memory plan against its card before step 1 (issue 48, point 2): one line where it does not
fit, training with --ignore_plan. This CPU has no card, so the card is stood in for (1 GB, less than the 2 GB the
plan reserves for a GPU's runtime)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import LENGTH, llama, llama_config, lm_data

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.errors import UserError
from optimum_gaudi.planning import Adapters, Card, Setting, Workload, breakdown, load_model_shape
from optimum_gaudi.planning.check import TOLERANCE
from optimum_gaudi.trainers import plan_check

SMALL_CARD = Card("a 1 GB test card", 1.0, None, None, 0.0, "test", "cuda")


def _trainer(tmp_path, model=None, **flags):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                  report_to="none", save_strategy="no", **flags)  # fmt: skip
    return GaudiTrainer(model=model or llama(), args=args, train_dataset=lm_data(8))


def test_a_run_that_does_not_fit_its_card_stops_in_one_line_before_step_1(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_check, "card_of", lambda device: SMALL_CARD)
    trainer = _trainer(tmp_path)
    with pytest.raises(UserError, match=r"^the plan says this run needs 2\.\d GB a card of 1\.0 GB .*--ignore_plan"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_ignore_plan_trains_anyway_and_a_cpu_is_not_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_check, "card_of", lambda device: SMALL_CARD)
    assert _trainer(tmp_path, ignore_plan=True).train().global_step == 1
    monkeypatch.undo()  # the CPU itself: no card, no check
    assert plan_check.card_of(_trainer(tmp_path).gaudi_device) is None


def test_a_run_that_trains_part_of_the_weights_is_not_stopped_by_a_full_fine_tuning_plan(tmp_path, monkeypatch):
    """The planner counts full fine-tuning and LoRA adapters. A run that freezes weights some other way (here: all
    but the q projections, no adapter) needs less than full fine-tuning, which would stop a run that fits, so such
    a run is not checked."""
    monkeypatch.setattr(plan_check, "card_of", lambda device: SMALL_CARD)
    trainer = _trainer(tmp_path)
    for name, parameter in trainer.model.named_parameters():
        parameter.requires_grad_("q_proj" in name)  # the weights a LoRA adapter would sit beside
    assert trainer.train().global_step == 1


LORA = Adapters(rank=4, targets=("q_proj", "v_proj"), dropout=True, frozen_bytes=4)


def _lora_model():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.05, task_type="CAUSAL_LM")
    return peft.get_peft_model(llama(), config)


def _card_between_lora_and_full_fine_tuning() -> Card:
    """A stand-in Gaudi (its reserve 5% of it) on which the tiny Llama's LoRA plan fits and its full fine-tuning
    plan exceeds the card by more than the check's tolerance."""
    shape = load_model_shape(llama_config())
    workload = Workload(cards=1, sequence=LENGTH, global_batch=2, precision="fp32", adapters=LORA)
    lora = breakdown(shape, workload, Setting(micro_batch=2), Card("probe", 1.0, None, None, 0.0, "test", "hpu"))
    gb = lora.training / 0.8 / 1e9  # LoRA's plan takes 85% of it, the reserve included
    card = Card(f"a {gb * 1e6:.0f} kB test card", gb, None, None, 0.0, "test", "hpu")
    full = breakdown(shape, dataclasses.replace(workload, adapters=None), Setting(micro_batch=2), card)
    assert full.peak > gb * 1e9 * (1 + TOLERANCE)
    return card


def test_a_lora_run_is_checked_with_its_adapters_not_a_full_fine_tuning_plan(tmp_path, monkeypatch):
    """LoRA trains the adapters alone: on a card its plan fits, the run trains, where the same model trained whole
    stops in one line."""
    card = _card_between_lora_and_full_fine_tuning()
    monkeypatch.setattr(plan_check, "card_of", lambda device: card)
    assert plan_check.adapters_of(_lora_model(), load_model_shape(llama_config())) == LORA
    assert _trainer(tmp_path, model=_lora_model()).train().global_step == 1
    with pytest.raises(UserError, match=r"^the plan says this run needs .* \(ddp 2x1, sequence 16;"):
        _trainer(tmp_path).train()


def test_a_lora_run_that_does_not_fit_stops_in_one_line_and_trains_with_ignore_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_check, "card_of", lambda device: SMALL_CARD)
    trainer = _trainer(tmp_path, model=_lora_model())
    with pytest.raises(UserError, match=r"^the plan says this run needs .*\(ddp 2x1, LoRA r4 q_proj\+v_proj, sequence"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert _trainer(tmp_path, model=_lora_model(), ignore_plan=True).train().global_step == 1


def _card_between_bf16_and_float32_weights() -> Card:
    """A stand-in Gaudi (its reserve 5% of it) on which the tiny Llama's full fine-tuning in bf16 weights fits and
    in float32 weights exceeds the card by more than the check's tolerance."""
    shape = load_model_shape(llama_config())
    workload = Workload(cards=1, sequence=LENGTH, global_batch=2, precision="fp32", weight_bytes=2)
    bf16 = breakdown(shape, workload, Setting(micro_batch=2), Card("probe", 1.0, None, None, 0.0, "test", "hpu"))
    gb = bf16.training / 0.8 / 1e9  # the bf16 plan takes 85% of it, the reserve included
    card = Card(f"a {gb * 1e6:.0f} kB test card", gb, None, None, 0.0, "test", "hpu")
    float32 = breakdown(shape, dataclasses.replace(workload, weight_bytes=4), Setting(micro_batch=2), card)
    assert float32.peak > gb * 1e9 * (1 + TOLERANCE)
    return card


def test_a_model_loaded_in_bf16_is_checked_in_the_dtype_of_its_weights(tmp_path, monkeypatch):
    """At step 1 the weights are loaded: their own dtype is the plan's. bf16 weights train with bf16 gradients and
    AdamW moments (torch keeps a moment in its parameter's dtype), half of float32's 16 bytes a parameter: on a card
    that holds that, the bf16 model trains where the same model in float32 stops in one line; --bf16 autocast over
    float32 weights keeps them float32, and stops too."""
    card = _card_between_bf16_and_float32_weights()
    monkeypatch.setattr(plan_check, "card_of", lambda device: card)
    assert _trainer(tmp_path, model=llama().to(torch.bfloat16)).train().global_step == 1
    with pytest.raises(UserError, match=r"^the plan says this run needs .* \(ddp 2x1, sequence 16;"):
        _trainer(tmp_path).train()
    with pytest.raises(UserError, match=r"^the plan says this run needs .* \(ddp 2x1, sequence 16;"):
        _trainer(tmp_path, bf16=True).train()
