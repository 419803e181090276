"""GaudiTrainer is a drop-in for transformers.Trainer (issue 9, point 7).

Code written against Trainer inspects and edits callbacks, reads ``state`` and ``log_history``, resumes
from checkpoints and calls ``evaluate()``/``predict()``; each test runs the same code on both trainers.
"""

import dataclasses

import numpy as np
import pytest
from transformers import DefaultFlowCallback, PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.features.metrics import is_measurement_key

COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, report_to=[], seed=0, save_strategy="no")


class RecordEvents(TrainerCallback):
    """Everything a user's callback sees: each event with the step it came at."""

    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: self.events.append((name, state.global_step))
        return super().__getattribute__(name)


def make(trainer_cls, tmp_path, tiny_gpt2, data, **kwargs):
    args_cls = GaudiTrainingArguments if trainer_cls is GaudiTrainer else TrainingArguments
    args = args_cls(output_dir=str(tmp_path / trainer_cls.__name__), **{**COMMON, **kwargs})
    return trainer_cls(model=tiny_gpt2(), args=args, train_dataset=data, eval_dataset=data[:12])


def both(tmp_path, tiny_gpt2, data, gaudi_only=None, **kwargs):
    """The same run with transformers.Trainer and with GaudiTrainer (all Gaudi features off)."""
    plain = make(Trainer, tmp_path, tiny_gpt2, data, **kwargs)
    return plain, make(GaudiTrainer, tmp_path, tiny_gpt2, data, **kwargs, **(gaudi_only or {}))


def types(trainer):
    return [type(cb) for cb in trainer.callback_handler.callbacks]


def without_measurements(history):
    return [{k: v for k, v in entry.items() if not is_measurement_key(k)} for entry in history]


# ---- callbacks ----------------------------------------------------------------------------------------


def test_the_callback_list_is_transformers_own(tmp_path, tiny_gpt2, tiny_lm_data):
    plain, gaudi = both(tmp_path, tiny_gpt2, tiny_lm_data, gaudi_only={"throughput_warmup_steps": 2})
    assert types(gaudi) == types(plain)
    assert types(gaudi)[0] is DefaultFlowCallback
    assert gaudi.callback_handler.callback_list == plain.callback_handler.callback_list


def test_add_pop_and_remove_callback_behave_as_on_trainer(tmp_path, tiny_gpt2, tiny_lm_data):
    plain, gaudi = both(tmp_path, tiny_gpt2, tiny_lm_data)
    for trainer in (plain, gaudi):
        trainer.add_callback(RecordEvents)
        recorder = RecordEvents()
        trainer.add_callback(recorder)
        popped = trainer.pop_callback(recorder)
        assert popped is recorder
        assert trainer.pop_callback(RecordEvents) is not None  # the one added by class
        trainer.remove_callback(PrinterCallback if PrinterCallback in types(trainer) else ProgressCallback)
    assert types(gaudi) == types(plain)


def test_a_user_callback_sees_the_same_events_in_the_same_order(tmp_path, tiny_gpt2, tiny_lm_data):
    plain, gaudi = both(
        tmp_path, tiny_gpt2, tiny_lm_data, max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=2
    )
    recorders = []
    for trainer in (plain, gaudi):
        recorders.append(RecordEvents())
        trainer.add_callback(recorders[-1])
        trainer.train()
    assert recorders[1].events == recorders[0].events
    assert ("on_optimizer_step", 0) in recorders[1].events


def test_removing_every_callback_but_the_flow_keeps_gaudi_metrics_and_mark_steps(
    tmp_path, tiny_gpt2, tiny_lm_data, bridge
):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), use_habana=True, use_lazy_mode=True, max_steps=4, logging_steps=2, **COMMON
    )
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data)
    for callback in list(trainer.callback_handler.callbacks):
        if not isinstance(callback, DefaultFlowCallback):
            trainer.remove_callback(callback)
    assert types(trainer) == [DefaultFlowCallback]
    bridge().reset()
    metrics = trainer.train().metrics
    assert bridge().names().count("core.mark_step") == 2 * 4  # after backward and after each optimizer step
    assert metrics["train_throughput_steps"] == 4 and metrics["train_tokens_per_second"] > 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("interval_samples_per_second" in h and "memory_allocated (GB)" in h for h in logs)


# ---- state, log_history, evaluate, predict ------------------------------------------------------------


def test_state_log_history_evaluate_and_predict_match_trainer(tmp_path, tiny_gpt2, tiny_lm_data):
    trainers = []
    for trainer_cls in (Trainer, GaudiTrainer):  # each built just before it trains, as a script does
        trainers.append(make(trainer_cls, tmp_path, tiny_gpt2, tiny_lm_data, max_steps=4, logging_steps=1))
        trainers[-1].train()
    plain, gaudi = trainers
    assert gaudi.state.global_step == plain.state.global_step == 4
    assert gaudi.state.max_steps == plain.state.max_steps and gaudi.state.epoch == plain.state.epoch
    assert without_measurements(gaudi.state.log_history) == without_measurements(plain.state.log_history)
    # with every Gaudi feature off, exactly Trainer's keys in every entry (no throughput or memory added)
    assert [set(entry) for entry in gaudi.state.log_history] == [set(entry) for entry in plain.state.log_history]

    evaluated = gaudi.evaluate(), plain.evaluate()
    assert set(evaluated[0]) == set(evaluated[1])
    assert evaluated[0]["eval_loss"] == pytest.approx(evaluated[1]["eval_loss"], rel=1e-6)

    predicted = gaudi.predict(tiny_lm_data[:6]), plain.predict(tiny_lm_data[:6])
    assert set(predicted[0].metrics) == set(predicted[1].metrics)
    np.testing.assert_allclose(predicted[0].predictions, predicted[1].predictions, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(predicted[0].label_ids, predicted[1].label_ids)


@pytest.mark.parametrize(
    "flags", [{"log_throughput_and_memory": True}, {"throughput_warmup_steps": 1}], ids=["flag", "warmup"]
)
def test_the_gaudi_metrics_appear_where_asked_for_and_add_only_measurements(tmp_path, tiny_gpt2, tiny_lm_data, flags):
    plain, gaudi = both(tmp_path, tiny_gpt2, tiny_lm_data, gaudi_only=flags, max_steps=4, logging_steps=2)
    for trainer in (plain, gaudi):
        trainer.train()
    for ours, theirs in zip(gaudi.state.log_history, plain.state.log_history, strict=True):
        assert set(theirs) <= set(ours) and all(is_measurement_key(k) for k in set(ours) - set(theirs))
    losses = [entry for entry in gaudi.state.log_history if "loss" in entry]
    assert all({"interval_samples_per_second", "memory_allocated (GB)"} <= set(entry) for entry in losses)
    assert "train_throughput_steps" in gaudi.state.log_history[-1]


@pytest.mark.parametrize(
    ("flags", "on"),
    [({}, False), ({"use_habana": True}, True), ({"adjust_throughput": True}, True),
     ({"throughput_warmup_steps": 2, "log_throughput_and_memory": False}, False)],
)  # fmt: skip
def test_the_gaudi_metrics_default_to_on_for_a_gaudi_run_or_a_throughput_flag(tmp_path, flags, on):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], **flags)
    assert args.log_throughput_and_memory is on


def test_transformers_resume_check_passes_with_every_gaudi_feature_off(tmp_path, tiny_gpt2, tiny_lm_data):
    """transformers' own test_can_resume_training (tests/trainer/test_trainer.py) compares the trainer state of a
    resumed run with the uninterrupted run's, log entries but for train_runtime, train_samples_per_second,
    train_steps_per_second and train_loss; the interval speed and memory keys failed it with GaudiTrainer."""
    whole, _ = resume_run(tmp_path / "whole", tiny_gpt2, tiny_lm_data)
    resumed, _ = resume_run(tmp_path / "resumed", tiny_gpt2, tiny_lm_data, str(tmp_path / "whole" / "checkpoint-4"))
    skipped = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
    states = [dataclasses.asdict(trainer.state) for trainer in (whole, resumed)]
    histories = [[{k: v for k, v in e.items() if k not in skipped} for e in s.pop("log_history")] for s in states]
    assert states[0] == states[1]
    assert histories[0] == histories[1]


def test_gaudi_config_may_be_a_dict(tmp_path, tiny_gpt2):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[])
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, gaudi_config={"use_fused_adam": True})
    assert trainer.gaudi_config == GaudiConfig(use_fused_adam=True)


# ---- resume -------------------------------------------------------------------------------------------


def resume_run(tmp_path, tiny_gpt2, data, resume_from=None, **kwargs):
    settings = {**COMMON, "save_strategy": "steps", "save_steps": 2, "max_steps": 8, "logging_steps": 1, **kwargs}
    args = GaudiTrainingArguments(output_dir=str(tmp_path), **settings)
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=data, eval_dataset=data[:8])
    output = trainer.train(resume_from_checkpoint=resume_from)
    return trainer, output


@pytest.mark.parametrize("warmup", [0, 2])
def test_a_resumed_run_logs_what_the_uninterrupted_run_logs(tmp_path, tiny_gpt2, tiny_lm_data, warmup):
    extra = dict(throughput_warmup_steps=warmup, log_throughput_and_memory=True, eval_strategy="steps", eval_steps=4)
    whole, whole_out = resume_run(tmp_path / "whole", tiny_gpt2, tiny_lm_data, **extra)
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    resumed, resumed_out = resume_run(tmp_path / "resumed", tiny_gpt2, tiny_lm_data, str(checkpoint), **extra)

    assert without_measurements(resumed.state.log_history) == without_measurements(whole.state.log_history)
    assert resumed_out.training_loss == whole_out.training_loss  # the whole run's, not the last 4 steps'
    # the throughput covers the whole run: 8 steps less one warm-up per train() call
    assert whole_out.metrics["train_throughput_steps"] == 8 - warmup
    assert resumed_out.metrics["train_throughput_steps"] == 8 - 2 * warmup
    assert resumed_out.metrics["train_throughput_warmup_steps"] == 2 * warmup
    assert resumed_out.metrics["train_samples_per_second"] > 0
    # time and memory keys are there, recognisably named
    measured = {k for entry in resumed.state.log_history for k in entry if is_measurement_key(k)}
    assert {"train_runtime", "train_samples_per_second", "memory_allocated (GB)"} <= measured
    assert all(k.endswith(("_per_second", "_runtime", " (GB)")) or "_throughput_" in k for k in measured)


def test_restoring_callback_states_sees_only_callbacks(tmp_path, tiny_gpt2, tiny_lm_data, monkeypatch):
    import transformers.trainer

    warnings = []
    resume_run(tmp_path / "whole", tiny_gpt2, tiny_lm_data, max_steps=4)
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda msg, *a, **k: warnings.append(str(msg)))
    trainer, output = resume_run(
        tmp_path / "resumed", tiny_gpt2, tiny_lm_data, str(tmp_path / "whole" / "checkpoint-2"),
        max_steps=4, restore_callback_states_from_checkpoint=True, log_throughput_and_memory=True,
    )  # fmt: skip
    assert not [w for w in warnings if "callbacks not included" in w]
    assert output.metrics["train_throughput_steps"] == 4  # the totals still came through


def test_resuming_a_checkpoint_written_by_trainer_still_works(tmp_path, tiny_gpt2, tiny_lm_data):
    args = TrainingArguments(
        output_dir=str(tmp_path / "plain"), max_steps=4, save_steps=2, logging_steps=1,
        **{**COMMON, "save_strategy": "steps"},
    )  # fmt: skip
    plain = Trainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data)
    plain.train()
    trainer, output = resume_run(
        tmp_path / "gaudi",
        tiny_gpt2,
        tiny_lm_data,
        str(tmp_path / "plain" / "checkpoint-2"),
        max_steps=4,
        log_throughput_and_memory=True,
    )
    assert trainer.state.global_step == 4 and output.metrics["train_throughput_steps"] == 2  # this call only
    # steps 3 and 4 continue the Trainer's run exactly (the Gaudi metrics only log)
    resumed = losses_after(2, trainer.state.log_history)
    assert len(resumed) == 2 and resumed == losses_after(2, plain.state.log_history)


def losses_after(step: int, history: list[dict]) -> list[tuple[int, float]]:
    return sorted((entry["step"], entry["loss"]) for entry in history if "loss" in entry and entry["step"] > step)
