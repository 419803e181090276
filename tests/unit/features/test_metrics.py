import time

import pytest
from transformers import TrainerCallback

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.features.metrics import Throughput

MEMORY_KEYS = ("memory_allocated (GB)", "max_memory_allocated (GB)", "total_memory_available (GB)")


class SlowFirstSteps(TrainerCallback):
    """Stands in for graph compilation: the first `n` optimizer steps take `seconds` longer."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step <= self.n:
            time.sleep(self.seconds)


def run(tiny_gpt2, data, tmp_path, warmup, **kwargs):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=4,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        throughput_warmup_steps=warmup,
        log_throughput_and_memory=True,  # also with no warm-up
        **kwargs,
    )
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=data, callbacks=[SlowFirstSteps(3, 0.4)])
    return trainer, trainer.train().metrics


def test_warmup_steps_are_left_out_of_throughput(tiny_gpt2, tiny_lm_data, tmp_path):
    _, with_warmup = run(tiny_gpt2, tiny_lm_data, tmp_path / "a", warmup=3)
    _, without = run(tiny_gpt2, tiny_lm_data, tmp_path / "b", warmup=0)
    assert with_warmup["train_throughput_steps"] == 5 and with_warmup["train_throughput_warmup_steps"] == 3
    assert without["train_throughput_steps"] == 8
    # 1.2 s of sleep sits in the first three steps: excluded, 5 steps take far less than 1.2 s
    assert with_warmup["train_steps_per_second"] > 5 / 1.2
    assert without["train_steps_per_second"] < 8 / 1.2
    assert with_warmup["train_runtime"] >= 1.2  # the total runtime still says how long the run took
    assert with_warmup["train_tokens_per_second"] == pytest.approx(
        with_warmup["train_samples_per_second"] * 16, rel=0.05
    )


def test_warmup_longer_than_run_keeps_all_steps_and_says_so(tiny_gpt2, tiny_lm_data, tmp_path, caplog):
    _, metrics = run(tiny_gpt2, tiny_lm_data, tmp_path, warmup=50)
    assert metrics["train_throughput_steps"] == 8
    assert "covers every step" in caplog.text


def test_memory_is_logged_every_logging_step(tiny_gpt2, tiny_lm_data, tmp_path):
    trainer, _ = run(tiny_gpt2, tiny_lm_data, tmp_path, warmup=0)
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(train_logs) == 4
    for entry in train_logs:
        assert all(entry[k] > 0 for k in MEMORY_KEYS)


def test_training_logs_carry_throughput_since_the_previous_log(tiny_gpt2, tiny_lm_data, tmp_path):
    trainer, _ = run(tiny_gpt2, tiny_lm_data, tmp_path, warmup=3)
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert "interval_samples_per_second" not in logs[2]  # still warming up
    # steps 3..4 include no sleep after the clock starts at step 3; samples = 4 per step
    assert logs[4]["interval_samples_per_second"] > 4 / 0.4
    assert logs[8]["interval_tokens_per_second"] == pytest.approx(logs[8]["interval_samples_per_second"] * 16, rel=0.05)


def test_evaluation_throughput_leaves_out_its_first_batches(tiny_gpt2, tiny_lm_data, tmp_path):
    model = tiny_gpt2()
    calls = []

    def slow_first_eval_batches(module, args, output):
        calls.append(1)
        if not module.training and len(calls) <= 2:
            time.sleep(0.4)

    model.register_forward_hook(slow_first_eval_batches)
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], throughput_warmup_steps=3
    )
    metrics = GaudiTrainer(model=model, args=args, eval_dataset=tiny_lm_data[:32]).evaluate()
    assert metrics["eval_throughput_steps"] == 5  # 8 batches, 3 left out
    assert metrics["eval_runtime"] >= 0.8  # the whole evaluation still counts in the runtime
    assert metrics["eval_samples_per_second"] > 20 / 0.8  # 20 samples after warm-up take far less than 0.8 s


def test_evaluation_throughput_after_warm_up_counts_the_samples_of_every_process():
    def samples_per_batch(world_size: int) -> float:
        throughput = Throughput(warmup_steps=1)
        throughput.eval_begin()
        for _ in range(4):
            throughput.eval_batch(4)  # this process's 4 rows a batch
        metrics = {}
        throughput.rewrite_eval(metrics, "eval", world_size)
        return metrics["eval_samples_per_second"] / metrics["eval_steps_per_second"]

    assert samples_per_batch(1) == pytest.approx(4)
    assert samples_per_batch(2) == pytest.approx(8)  # as transformers' own eval metrics and training's count
