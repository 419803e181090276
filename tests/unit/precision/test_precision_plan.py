"""PrecisionPlan (precision/plan.py): the one object a trainer asks about its precision, built from the arguments,
the Gaudi config and the device. Each answer is checked here on the CPU device without training; the trainings
that use it (bit-equal before and after the plan) are in test_precision.py, test_fp8.py and test_fsdp_trainings.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from optimum_gaudi import GaudiConfig
from optimum_gaudi.devices import CPUDevice
from optimum_gaudi.precision.autocast import OpListAutocast
from optimum_gaudi.precision.fp8 import Fp8Plan
from optimum_gaudi.precision.plan import PrecisionPlan


def arguments(**given):
    """The training arguments the plan reads, Trainer's defaults unless given."""
    defaults = dict(
        bf16=False, fp8=False, fp8_recipe=None, minimize_memory=False, torch_compile=False, flash_attention_fp8=False,
        flash_attention_recompute=False, use_hpu_graphs_for_training=False, process_index=0, world_size=1,
    )  # fmt: skip
    return SimpleNamespace(**{**defaults, **given})


class FakeFp8Device(CPUDevice):
    """The CPU device with an fp8 plan of its own: a context that records when it is entered, no conversion."""

    def __init__(self, entered: list[str]) -> None:
        super().__init__()
        self.entered = entered

    def fp8_plan(self, minimize_memory, compiling, recipe=None) -> Fp8Plan:
        @contextlib.contextmanager
        def fp8_context():
            self.entered.append("fp8")
            yield

        return Fp8Plan("fake fp8", lambda model, layers: None, fp8_context)


def test_with_every_feature_off_the_plan_leaves_precision_to_accelerate():
    plan = PrecisionPlan.build(arguments(bf16=True), GaudiConfig(), CPUDevice())
    assert plan.autocast is None and plan.fp8 is None
    assert plan.accelerate_mixed_precision is None  # the arguments' own choice, as transformers.Trainer
    assert plan.fsdp_mixed_precision_policy() is None
    sentinel = contextlib.nullcontext("accelerate's")
    assert plan.forward_context(True, lambda: sentinel) is sentinel
    assert isinstance(plan.loop_context(), contextlib.nullcontext)
    state = {"w": torch.zeros(1)}
    assert plan.weights_to_save(torch.nn.Linear(1, 1), state) is state


def test_op_lists_replace_accelerates_bf16_and_gather_fsdp_parameters_in_bf16():
    config = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["mm"], autocast_fp32_ops=["softmax"])
    plan = PrecisionPlan.build(arguments(bf16=True), config, CPUDevice())
    autocast = plan.autocast()
    assert isinstance(autocast, OpListAutocast)
    assert plan.accelerate_mixed_precision == "no"
    asked = []
    assert plan.forward_context(True, lambda: asked.append(1)) is autocast and asked == []  # accelerate's not made
    policy = plan.fsdp_mixed_precision_policy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    with plan.loop_context():
        x = torch.randn(2, 2)
        with plan.forward_context(True, contextlib.nullcontext):
            assert torch.mm(x, x).dtype == torch.bfloat16 and torch.softmax(x, -1).dtype == torch.float32


def test_fp8_context_is_entered_inside_the_autocast_in_training_forwards_only():
    entered: list[str] = []

    @contextlib.contextmanager
    def accelerate_autocast():
        entered.append("autocast")
        yield

    plan = PrecisionPlan.build(arguments(bf16=True, fp8=True), GaudiConfig(), FakeFp8Device(entered))
    with plan.forward_context(True, accelerate_autocast):
        assert entered == ["autocast", "fp8"]
    entered.clear()
    with plan.forward_context(False, accelerate_autocast):  # evaluation: the model's precision, as accelerate's fp8
        assert entered == ["autocast"]


class Scaled(torch.nn.Module):
    """A module with Transformer Engine-like scaling state (its ``_extra_state``)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def get_extra_state(self):
        return torch.tensor([self.value])

    def set_extra_state(self, state) -> None:
        self.value = float(state[0])


def test_scaling_state_is_saved_per_rank_and_resumed_once_the_fp8_modules_exist(tmp_path):
    args = arguments(fp8=True, process_index=1, world_size=2)
    plan = PrecisionPlan.build(args, GaudiConfig(), FakeFp8Device([]))
    plan.save_scaling_state(torch.nn.Sequential(Scaled(2.5)), str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["fp8_scaling_state.rank1.pt"]

    resumed = PrecisionPlan.build(args, GaudiConfig(), FakeFp8Device([]))
    model = torch.nn.Sequential(Scaled(0.0))
    resumed.resume_scaling_from(str(tmp_path), model)
    assert model[0].value == 0.0  # not converted yet: kept for the conversion
    resumed.convert(model)
    assert model._gaudi_fp8 == "fake fp8" and model[0].value == 2.5
    model[0].value = 7.0
    resumed.convert(model)  # a later wrap converts nothing and loads nothing again
    assert model[0].value == 7.0
    assert "0._extra_state" not in resumed.weights_to_save(model, None)  # saved weights as transformers reads them


def test_without_fp8_nothing_is_saved_beside_the_weights(tmp_path):
    plan = PrecisionPlan.build(arguments(), GaudiConfig(), CPUDevice())
    plan.save_scaling_state(torch.nn.Sequential(Scaled(1.0)), str(tmp_path))
    plan.resume_scaling_from(str(tmp_path), torch.nn.Sequential(Scaled(1.0)))
    assert list(tmp_path.iterdir()) == []


def test_the_plan_describes_itself_in_one_line_for_the_runs_log():
    """What autocasts each forward (or accelerate's mixed precision) and what trains in fp8: the line the trainer
    logs at start."""
    cpu = CPUDevice()
    assert PrecisionPlan.build(arguments(), GaudiConfig(), cpu).describe() == "float32, no mixed precision; no fp8"
    assert PrecisionPlan.build(arguments(fp16=True), GaudiConfig(), cpu).describe() == (
        "fp16 mixed precision by accelerate; no fp8"
    )
    lists = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["mm", "bmm"], autocast_fp32_ops=["softmax"])
    assert PrecisionPlan.build(arguments(bf16=True), lists, cpu).describe() == (
        "bf16 autocast on cpu by the op lists (2 bf16, 1 fp32 ops); no fp8"
    )
    fp8 = PrecisionPlan.build(
        arguments(bf16=True, fp8=True, flash_attention_fp8=True), GaudiConfig(), FakeFp8Device([])
    )
    assert fp8.describe() == "bf16 mixed precision by accelerate; fp8 by fake fp8, fp8 attention"
    assert "\n" not in fp8.describe()
    assert PrecisionPlan().describe() == "accelerate's mixed precision; no fp8"  # built by hand: what it knows


def test_the_precision_flags_check_themselves_before_any_device():
    from optimum_gaudi.precision.plan import argument_problem

    assert argument_problem(arguments()) is None
    assert argument_problem(arguments(fp8_recipe='{"interval": 4}')) is None
    assert argument_problem(arguments(fp8_recipe='{"nope": 1}')).startswith("--fp8_recipe: unknown key(s) nope")
