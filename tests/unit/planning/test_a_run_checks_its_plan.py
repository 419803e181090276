"""A run checks its memory plan against its card before step 1 (issue 48, point 2): one line where it does not
fit, training with --ignore_plan. This CPU has no card, so the card is stood in for (1 GB, less than the 2 GB the
plan reserves for a GPU's runtime)."""

from __future__ import annotations

import pytest
from tiny import llama, lm_data

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.errors import UserError
from optimum_gaudi.planning import Card
from optimum_gaudi.trainers import plan_check

SMALL_CARD = Card("a 1 GB test card", 1.0, None, None, 0.0, "test", "cuda")


def _trainer(tmp_path, **flags):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                  report_to="none", save_strategy="no", **flags)  # fmt: skip
    return GaudiTrainer(model=llama(), args=args, train_dataset=lm_data(8))


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
    """The planner counts full fine-tuning (every weight's gradient and optimizer state). A run that freezes weights,
    as LoRA and other PEFT methods do, needs far less: the full plan would stop a LoRA run that fits (a 70B model's
    adapters on 8 cards), so such a run is not checked."""
    monkeypatch.setattr(plan_check, "card_of", lambda device: SMALL_CARD)
    trainer = _trainer(tmp_path)
    for name, parameter in trainer.model.named_parameters():
        parameter.requires_grad_("q_proj" in name)  # the weights a LoRA adapter would sit beside
    assert trainer.train().global_step == 1
