"""Resuming from a checkpoint in whole trainings: the best checkpoint is found, kept and loaded as transformers does
it, and a resumed run's trainer state is the uninterrupted one's but for times. What complete means and which
checkpoint a resume picks, in process: tests/unit/checkpoints/test_crash_safe_checkpoints.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny
import torch
from transformers import TrainerCallback

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import list_checkpoints

# ---- the best checkpoint, as transformers.Trainer keeps it (issue 21, point 1) ------------------------------

# Evaluations at the end of each 4-step epoch, after the step's save: the checkpoint of the best step (the first
# evaluation here) exists before the evaluation that makes it the best.
_SCORES = {4: 5.0, 8: 3.0, 12: 1.0}


def _run_with_best(trainer_cls, out: Path, resume_at: int | None, **flags):
    """Train 12 steps (``resume_at`` steps, then resume to 12) scoring each evaluation by _SCORES; returns the
    trainer, the best checkpoint's name, the checkpoints kept, and the best checkpoint each of them names."""
    from transformers import Trainer, TrainingArguments

    args_cls = TrainingArguments if trainer_cls is Trainer else GaudiTrainingArguments
    trainers = []

    def score(_):
        return {"score": _SCORES.get(trainers[-1].state.global_step, 0.0)}

    def make(max_steps):
        args = args_cls(
            output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
            disable_tqdm=True, logging_steps=1, seed=0, max_steps=max_steps, save_strategy="steps",
            metric_for_best_model="score", greater_is_better=True, **flags,
        )  # fmt: skip
        trainer = trainer_cls(
            model=tiny.gpt2(), args=args, train_dataset=tiny.lm_data(16), eval_dataset=tiny.lm_data(4),
            compute_metrics=score, preprocess_logits_for_metrics=lambda logits, labels: logits[..., :1],
        )  # fmt: skip
        trainers.append(trainer)
        return trainer

    if resume_at:
        make(resume_at).train()
    trainer = make(12)
    trainer.train(resume_from_checkpoint=True if resume_at else None)
    name = lambda path: None if path is None else Path(path).name  # noqa: E731
    kept = {
        p.name: name(json.loads((p / "trainer_state.json").read_text())["best_model_checkpoint"])
        for p in list_checkpoints(out)
    }
    return trainer, name(trainer.state.best_model_checkpoint), kept


@pytest.mark.parametrize(
    "flags, resume_at",
    [
        (dict(eval_strategy="epoch", save_steps=1, save_total_limit=2), None),
        (dict(eval_strategy="epoch", save_steps=1, save_total_limit=1), 6),
        (dict(eval_strategy="epoch", save_steps=2, save_total_limit=2), 6),
        (dict(eval_strategy="steps", eval_steps=2, save_steps=4, save_total_limit=1, load_best_model_at_end=True), 6),
    ],
    ids=["limit2", "limit1-resumed", "save2-limit2-resumed", "load-best-limit1-resumed"],
)
def test_the_best_checkpoint_is_found_kept_and_loaded_as_transformers_does(tmp_path, flags, resume_at):
    from transformers import Trainer

    plain, plain_best, plain_kept = _run_with_best(Trainer, tmp_path / "plain", resume_at, **flags)
    gaudi, gaudi_best, gaudi_kept = _run_with_best(GaudiTrainer, tmp_path / "gaudi", resume_at, **flags)
    assert plain_best is not None  # the runs do have a best checkpoint
    assert (gaudi_best, gaudi_kept) == (plain_best, plain_kept)
    theirs = plain.model.state_dict()  # with load_best_model_at_end, the best checkpoint's weights
    for key, ours in gaudi.model.state_dict().items():
        assert torch.equal(ours, theirs[key]), key


# ---- a resumed run's state is the uninterrupted run's (issue 21, point 3) -----------------------------------


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True  # an interruption: the schedule still runs to max_steps


def _differences(a, b, path: str = "") -> list[str]:
    """The paths of the JSON values that differ between ``a`` and ``b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _whole_and_resumed(trainer_cls, tmp_path: Path, logging_steps: int) -> tuple[dict, dict]:
    """trainer_state.json of 8 steps run at once, and of 4 steps then resumed to 8: the last checkpoint's, and
    the final state (save_state)."""
    from transformers import Trainer, TrainingArguments

    args_cls = TrainingArguments if trainer_cls is Trainer else GaudiTrainingArguments

    def run(out, callbacks=(), resume=None):
        args = args_cls(
            output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
            disable_tqdm=True, seed=0, max_steps=8, logging_steps=logging_steps, save_strategy="steps",
            save_steps=4, eval_strategy="steps", eval_steps=4,
        )  # fmt: skip
        trainer = trainer_cls(
            model=tiny.gpt2(), args=args, train_dataset=tiny.lm_data(), eval_dataset=tiny.lm_data(8),
            callbacks=list(callbacks),
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        if callbacks:
            return None
        trainer.save_state()
        return {
            "checkpoint-8": json.loads((out / "checkpoint-8" / "trainer_state.json").read_text()),
            "final": json.loads((out / "trainer_state.json").read_text()),
        }

    whole = run(tmp_path / trainer_cls.__name__ / "whole")
    run(tmp_path / trainer_cls.__name__ / "resumed", callbacks=[_StopAt(4)])
    resumed = run(tmp_path / trainer_cls.__name__ / "resumed", resume=True)
    return whole, resumed


@pytest.mark.parametrize("logging_steps", [2, 3])  # the checkpoint at step 4 on a logging step, or between two
def test_a_resumed_runs_trainer_state_is_the_uninterrupted_ones_but_for_times(tmp_path, logging_steps):
    from transformers import Trainer

    from optimum_gaudi.features.metrics import is_measurement_key

    differ = {}
    for trainer_cls in (Trainer, GaudiTrainer):
        whole, resumed = _whole_and_resumed(trainer_cls, tmp_path, logging_steps)
        paths = {f"{name}{path}" for name in whole for path in _differences(whole[name], resumed[name])}
        differ[trainer_cls] = {
            "times": sorted({p.rsplit(".", 1)[1] for p in paths if is_measurement_key(p.rsplit(".", 1)[1])}),
            "other": sorted(p for p in paths if not is_measurement_key(p.rsplit(".", 1)[1])),
        }
    print({cls.__name__: found for cls, found in differ.items()})
    plain, gaudi = differ[Trainer], differ[GaudiTrainer]
    # transformers.Trainer itself varies the times, and reports the loss of the resumed part alone (train_loss),
    # of a shorter first logging interval too when the checkpoint falls between two logging steps
    # (a short evaluation's rounded eval_runtime can come out equal in both runs; a resumed run's train_runtime,
    # over half the steps, cannot)
    assert {"train_runtime", "train_samples_per_second"} <= set(plain["times"])
    if logging_steps == 2:  # log_history: losses at 2 and 4, eval, losses at 6 and 8, eval, the train metrics
        assert plain["other"] == ["final.log_history[6].train_loss"]
    else:  # loss at 3, eval, loss at 6 (over steps 5 and 6 once resumed), eval, the train metrics
        assert plain["other"] == [
            "checkpoint-8.log_history[2].loss", "final.log_history[2].loss", "final.log_history[4].train_loss"
        ]  # fmt: skip
    # GaudiTrainer: the times, and what transformers varies in the logs (its train_loss covers the whole run,
    # the same on a logging step; within a float rounding otherwise, as the loss of that interval differs)
    if logging_steps == 2:
        assert gaudi["other"] == []
    else:
        assert set(gaudi["other"]) <= set(plain["other"])
