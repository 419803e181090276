"""Non-finite steps (issue 38, point 3): a NaN/inf loss or gradient norm stops the run at once with one line, or
is skipped with --on_nonfinite skip (optimizer, scheduler, scaler untouched, at most N in a row); a checkpoint
whose weights hold a NaN or inf is never published nor rotates the last finite one out; resuming with ``true``
picks the newest finite one. On several processes: tests/integration/supervision/test_stalled_slow_or_diverging_ranks.py."""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import tiny
import torch
from transformers import TrainerCallback

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import FINITE_MARKER, latest_complete_checkpoint, resolve_resume, write_manifest
from optimum_gaudi.supervision.nonfinite import NonFiniteStepError


def make_trainer(out, **flags) -> GaudiTrainer:
    args = GaudiTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, report_to="none", disable_tqdm=True, logging_steps=1,
        **{"max_steps": 8, "save_strategy": "no", "seed": 0, **flags},
    )  # fmt: skip
    return GaudiTrainer(model=tiny.gpt2(**tiny.NO_DROPOUT), args=args, train_dataset=tiny.lm_data())


class NanLossAt:
    """A compute_loss_func: the model's loss, NaN on the given (1-based) steps."""

    def __init__(self, steps) -> None:
        self.steps, self.trainer = set(steps), None

    def __call__(self, outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"][:, :-1].reshape(-1, outputs["logits"].shape[-1])
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        return loss * float("nan") if self.trainer.state.global_step + 1 in self.steps else loss


def test_the_issues_diverging_run_stops_at_once_in_one_line_with_finite_checkpoints(tmp_path):
    """run_clm with --learning_rate 1e12 --max_grad_norm 0 --save_steps 4 --save_total_limit 2 logged a loss of 0,
    exited 0 and kept two NaN checkpoints; now the first NaN step stops the run."""
    trainer = make_trainer(tmp_path, learning_rate=1e12, max_grad_norm=0, save_strategy="steps", save_steps=1)
    with pytest.raises(NonFiniteStepError) as stopped:
        trainer.train()
    line = str(stopped.value)
    assert "\n" not in line and line.startswith("step 2: the loss is nan (gradient norm nan); stopped before")
    assert trainer.state.global_step == 1  # the bad step never updated anything
    keys = set().union(*trainer.state.log_history)  # one process, skipping off: no key of ours (issue 39)
    assert not keys & {"nonfinite_skipped_steps", "slowest_rank", "fastest_rank_step_time"}
    for checkpoint in tmp_path.glob("checkpoint-*"):
        weights = safetensors.torch.load_file(checkpoint / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), checkpoint.name


def test_skip_leaves_optimizer_scheduler_and_weights_untouched_and_stops_after_too_many_in_a_row(tmp_path, caplog):
    nan = NanLossAt({3, 4, 6})
    trainer = make_trainer(tmp_path, on_nonfinite="skip", max_nonfinite_skips=2)
    trainer.compute_loss_func, nan.trainer = nan, trainer
    seen = {}

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen[state.global_step + 1] = [p.detach().clone() for p in model.parameters()]

    trainer.add_callback(Watch())
    trainer.train()
    skipped = {3, 4, 6}
    for step in range(1, 8):  # weights before step + 1 equal those before step exactly when step was skipped
        same = all(torch.equal(a, b) for a, b in zip(seen[step], seen[step + 1], strict=True))
        assert same == (step in skipped), step
    optimizer = trainer.optimizer.optimizer
    assert {int(s["step"]) for s in optimizer.state.values()} == {8 - 3}  # AdamW stepped 5 times of 8
    assert trainer.lr_scheduler.last_epoch == 8 - 3
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["nonfinite_skipped_steps"] for h in logged] == [0, 0, 1, 2, 2, 3, 3, 3]
    assert "step 3: the loss is nan (gradient norm nan); step skipped" in caplog.text

    nan3 = NanLossAt({2, 3, 4})
    again = make_trainer(tmp_path / "again", on_nonfinite="skip", max_nonfinite_skips=2)
    again.compute_loss_func, nan3.trainer = nan3, again
    with pytest.raises(NonFiniteStepError, match=r"^step 4: the loss is nan .*: 3 such steps in a row; stopped"):
        again.train()


def test_a_checkpoint_with_nonfinite_weights_is_never_published_and_resuming_picks_the_newest_finite_one(
    tmp_path, caplog
):
    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 4:
                with torch.no_grad():
                    model.transformer.wte.weight[0, 0] = math.inf

    trainer = make_trainer(tmp_path, save_strategy="steps", save_steps=2, save_total_limit=1, max_steps=6)
    trainer.add_callback(Poison())
    with pytest.raises(NonFiniteStepError, match="^step 5: the loss is nan"):
        trainer.train()
    assert "checkpoint-4 not written: the weights hold a NaN or inf (transformer.wte.weight" in caplog.text
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]  # not rotated out
    assert resolve_resume(True, tmp_path) == str(tmp_path / "checkpoint-2")

    # an older run's checkpoint (no marker) holding an inf is skipped when resuming with `true`
    clean = make_trainer(tmp_path / "older", save_strategy="steps", save_steps=2, max_steps=4)
    clean.train()
    newest = latest_complete_checkpoint(tmp_path / "older")
    weights = safetensors.torch.load_file(newest / "model.safetensors")
    weights["transformer.wte.weight"][0, 0] = math.nan
    safetensors.torch.save_file(weights, newest / "model.safetensors", metadata={"format": "pt"})
    (newest / FINITE_MARKER).unlink()
    write_manifest(newest)
    assert newest.name == "checkpoint-4" and latest_complete_checkpoint(tmp_path / "older") == newest
    assert resolve_resume(True, tmp_path / "older") == str(tmp_path / "older" / "checkpoint-2")
    assert "Skipping checkpoint-4 (a non-finite weight: model.safetensors: " in caplog.text


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"on_nonfinite": "warn"}, "--on_nonfinite must be one of stop, skip, ignore, got 'warn'."),
        ({"on_nonfinite": "ignore", "loss_spike_factor": 5}, "--loss_spike_factor handles a spike as --on_nonfinite"),
        ({"hang_timeout": -1}, "--hang_timeout must be >= 0 seconds"),
        ({"max_nonfinite_skips": 0}, "--max_nonfinite_skips must be a whole number >= 1, got 0."),
        ({"loss_spike_factor": 0.5}, "--loss_spike_factor 0.5 would catch ordinary steps"),
    ],
)
def test_bad_stall_flags_are_one_line(tmp_path, flags, message):
    from optimum_gaudi.trainers.training_args import GaudiArgumentError

    with pytest.raises(GaudiArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GaudiTrainingArguments(output_dir=str(tmp_path), **flags)


def test_a_loss_spike_is_handled_as_a_nonfinite_step(tmp_path, caplog):
    class Spike(NanLossAt):
        def __call__(self, outputs, labels, num_items_in_batch=None):
            loss = super().__call__(outputs, labels, num_items_in_batch)
            return loss * 100 if self.trainer.state.global_step + 1 == 14 else loss

    spike = Spike(())
    trainer = make_trainer(tmp_path, on_nonfinite="skip", loss_spike_factor=10, max_steps=16)
    trainer.compute_loss_func, spike.trainer = spike, trainer
    trainer.train()
    assert "step 14: the loss " in caplog.text and "x the running median" in caplog.text
    assert trainer.state.log_history[-2]["nonfinite_skipped_steps"] == 1


def overflowing_scaler(trainer: GaudiTrainer, init_scale: float = 2.0**127) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling on the CPU, where accelerate makes no scaler: a scale so high that the first
    steps' gradients overflow, as they do by design early in a GPU's fp16 run."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    trainer.accelerator.scaler = scaler  # prepare() hands it to the optimizer, backward() scales the loss with it
    trainer.accelerator.native_amp = True
    trainer.accelerator.state._mixed_precision = "fp16"  # unscale_gradients() unscales under fp16 only
    return scaler


def test_steps_the_gradient_scaler_skips_for_an_overflow_are_left_to_it(tmp_path):
    """An overflowing scale makes the first steps' gradients inf: the scaler skips those optimizer steps and lowers
    its scale; the run neither stops nor counts them (it stopped at step 1 before). A NaN loss under the same
    scaler still stops the run."""
    trainer = make_trainer(tmp_path / "overflow", on_nonfinite="skip", max_nonfinite_skips=1)
    scaler = overflowing_scaler(trainer)
    trainer.train()
    assert trainer.state.global_step == 8 and scaler.get_scale() <= 2.0**125  # at least two steps overflowed
    skipped = [h["nonfinite_skipped_steps"] for h in trainer.state.log_history if "nonfinite_skipped_steps" in h]
    assert skipped and set(skipped) == {0}
    assert math.isfinite(trainer.state.log_history[-2]["loss"])

    nan = NanLossAt({5})
    trainer = make_trainer(tmp_path / "nan")
    trainer.compute_loss_func, nan.trainer = nan, trainer
    overflowing_scaler(trainer, init_scale=2.0**10)
    with pytest.raises(NonFiniteStepError, match="step 5: the loss is nan"):
        trainer.train()


def test_on_nonfinite_ignore_is_transformers_own_behaviour(tmp_path):
    """transformers' ``test_logging_inf_nan_filter`` with GaudiTrainer: a learning rate of 1e9 makes the loss
    inf or NaN within a few steps; with ``--on_nonfinite ignore`` training goes on as transformers' does, the same
    losses logged (NaN or inf where ``logging_nan_inf_filter`` is off, filtered where it is on). The default,
    ``stop``, ends that run: the exception the README's promise names."""
    from transformers import Trainer, TrainingArguments

    def losses(trainer):
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    def gaudi(filtered, **flags):
        flags = {"learning_rate": 1e9, "max_steps": 10, "logging_nan_inf_filter": filtered, **flags}
        return make_trainer(tmp_path / f"gaudi-{filtered}", **flags)

    common = dict(per_device_train_batch_size=4, report_to="none", disable_tqdm=True, logging_steps=1, max_steps=10,
                  save_strategy="no", seed=0, learning_rate=1e9)  # fmt: skip
    for filtered in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path / f"hf-{filtered}"), logging_nan_inf_filter=filtered, **common)
        expected = losses(Trainer(model=tiny.gpt2(**tiny.NO_DROPOUT), args=args, train_dataset=tiny.lm_data()))
        got = losses(gaudi(filtered, on_nonfinite="ignore"))
        assert len(got) == len(expected) == 10
        assert all(
            (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5)
            for a, b in zip(got, expected, strict=True)
        )
        assert any(not math.isfinite(loss) for loss in got) != filtered, got

    with pytest.raises(NonFiniteStepError, match="--on_nonfinite skip skips such steps instead"):
        gaudi(False).train()
