import json

import pytest
import torch
from torch.profiler import ProfilerActivity
from transformers import Trainer, TrainerCallback, TrainingArguments

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import CPUDevice, HPUDevice
from optimum_gaudi.features.profiling import GaudiProfilerCallback, profile, trace_path


class StepRecorder(TrainerCallback):
    """Added after the profiler callback: sees its state once it has handled each event."""

    def __init__(self, profiler_callback: GaudiProfilerCallback) -> None:
        self.cb = profiler_callback
        self.step = 0
        self.active_during: dict[int, bool] = {}  # step -> profiler object alive while the step runs
        self.recording_in_forward: dict[int, bool] = {}  # step -> torch profiler enabled in the forward pass
        self.active_after: dict[int, bool] = {}  # step -> profiler object alive once the step has ended

    def forward_hook(self, module, inputs, output):
        self.recording_in_forward[self.step] = torch.autograd._profiler_enabled()
        with profile("my_region"):
            output.logits.float().mean()

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1
        self.active_during[self.step] = self.cb.profiler is not None

    def on_step_end(self, args, state, control, **kwargs):
        self.active_after[state.global_step] = self.cb.profiler is not None


def run(model, data, tmp_path, warmup, active, max_steps, with_stack=False):
    cb = GaudiProfilerCallback(
        warmup, active, record_shapes=True, with_stack=with_stack, output_dir=tmp_path / "profiling", rank=0
    )
    recorder = StepRecorder(cb)
    model.register_forward_hook(recorder.forward_hook)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, recorder]).train()
    return cb, recorder


def trace_events(path):
    trace = json.loads(path.read_text())
    return trace, [e.get("name", "") for e in trace["traceEvents"]]


def test_profiles_exactly_the_window_and_writes_a_chrome_trace(tiny_gpt2, tiny_lm_data, tmp_path):
    cb, rec = run(tiny_gpt2(), tiny_lm_data, tmp_path, warmup=1, active=2, max_steps=5)

    # Steps 2 and 3 are profiled; before and after, no profiler exists and torch records nothing.
    assert rec.active_during == {1: False, 2: True, 3: True, 4: False, 5: False}
    assert rec.recording_in_forward == {1: False, 2: True, 3: True, 4: False, 5: False}
    assert rec.active_after == {1: False, 2: True, 3: False, 4: False, 5: False}
    assert cb.profiler is None

    path = tmp_path / "profiling" / "profile_rank0.pt.trace.json"
    assert cb.trace_file == path == trace_path(tmp_path / "profiling", 0)
    trace, names = trace_events(path)
    assert sorted(n for n in set(names) if n.startswith("ProfilerStep#")) == ["ProfilerStep#0", "ProfilerStep#1"]
    assert names.count("my_region") == 2  # one forward per profiled step
    assert {"aten::mm", "aten::addmm", "aten::linear"} & set(names)
    assert trace["optimum_gaudi_first_step"] == 2
    assert trace["optimum_gaudi_rank"] == 0


def test_training_that_stops_inside_the_window_still_writes_the_trace_with_stacks(tiny_gpt2, tiny_lm_data, tmp_path):
    cb, rec = run(tiny_gpt2(), tiny_lm_data, tmp_path, warmup=1, active=10, max_steps=3, with_stack=True)
    assert rec.recording_in_forward == {1: False, 2: True, 3: True}
    assert cb.profiler is None
    trace, names = trace_events(cb.trace_file)
    assert names.count("my_region") == 2
    assert {"aten::mm", "aten::addmm", "aten::linear"} & set(names)
    assert any(e.get("cat") == "python_function" for e in trace["traceEvents"])  # with_stack: Python frames


def test_training_that_ends_before_the_window_never_starts_the_profiler(tiny_gpt2, tiny_lm_data, tmp_path):
    cb, rec = run(tiny_gpt2(), tiny_lm_data, tmp_path, warmup=5, active=1, max_steps=2)
    assert rec.active_during == {1: False, 2: False}
    assert cb.trace_file is None
    assert not (tmp_path / "profiling").exists()


def test_profile_region_is_a_no_op_without_a_profiler(monkeypatch):
    def fail(name):
        raise AssertionError("record_function must not be called while nothing is profiled")

    monkeypatch.setattr(torch.profiler, "record_function", fail)
    with profile("idle"):
        pass


def test_profile_region_works_as_a_decorator():
    @profile("decorated")
    def work():
        return torch.ones(3) * 2

    work()  # outside a profiler: nothing to see, nothing breaks
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
        work()
    assert [e.name for e in prof.events()].count("decorated") == 2


def test_callback_from_training_args(tmp_path):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path),
        profiling_warmup_steps=3,
        profiling_steps=2,
        profiling_record_shapes=True,
        report_to=[],
    )
    cb = GaudiProfilerCallback.from_training_args(args)
    assert (cb.warmup_steps, cb.active_steps, cb.record_shapes, cb.with_stack) == (3, 2, True, False)
    assert cb.output_dir == tmp_path
    assert cb.rank == 0
    assert cb.activities == [ProfilerActivity.CPU]
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[])
    assert GaudiProfilerCallback.from_training_args(args) is None


def test_activities_follow_the_device():
    assert CPUDevice().profiler_activities() == [ProfilerActivity.CPU]
    if hasattr(ProfilerActivity, "HPU"):
        assert HPUDevice().profiler_activities() == [ProfilerActivity.CPU, ProfilerActivity.HPU]


def test_gaudi_trainer_profiling_flags_write_the_trace(tiny_gpt2, tiny_lm_data, tmp_path):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, report_to=[], save_strategy="no",
        profiling_warmup_steps=1, profiling_steps=2, profiling_with_stack=True,
    )  # fmt: skip
    GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data).train()
    _, names = trace_events(tmp_path / "profile_rank0.pt.trace.json")
    assert "ProfilerStep#0" in names and "ProfilerStep#1" in names and "ProfilerStep#2" not in names
    assert any(n in names for n in ("aten::addmm", "aten::mm"))


def test_rejects_an_empty_window():
    with pytest.raises(ValueError, match="active_steps >= 1"):
        GaudiProfilerCallback(warmup_steps=0, active_steps=0)
