"""The op-list autocast and the Gaudi config's precision settings, in process. Whole trainings under the lists:
tests/integration/precision/test_precision_trainings.py."""

import logging

import pytest
import torch
import torch._dynamo
from conftest import DYNAMO_BREAKS_IN_TRANSFORMERS
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from optimum_gaudi import GaudiConfig, GaudiConfigError, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import CPUDevice
from optimum_gaudi.precision.autocast import OpListAutocast, aten_overloads


class Recorder(nn.Module):
    """A forward of common ops whose output dtypes it returns, so compiled runs report them too."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.proj(x)  # aten::linear
        p = torch.softmax(h, dim=-1)  # aten::softmax
        q = torch.mm(x, self.proj.weight)  # aten::mm
        r = torch.conv1d(x.T[None], self.proj.weight[:, :, None])  # in torch's CPU list, in none of ours
        n = self.norm(x)  # aten::layer_norm
        return h, p, q, r, n


NAMES = ("linear", "softmax", "mm", "conv1d", "layer_norm")


def dtypes(outputs):
    return dict(zip(NAMES, (o.dtype for o in outputs), strict=True))


def run(autocast, compiled=False, model=None):
    model = model or Recorder()
    fn = torch.compile(model, backend="aot_eager") if compiled else model
    with autocast:
        return dtypes(fn(torch.randn(4, 8)))


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_exactly_the_listed_ops_change_dtype(compiled):
    seen = run(OpListAutocast(["linear", "mm"], ["softmax"]), compiled)
    assert seen == {"linear": BF16, "softmax": FP32, "mm": BF16, "conv1d": FP32, "layer_norm": FP32}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp32_list_upcasts_bf16_inputs(compiled):
    # softmax of a bf16 linear output: without softmax in the fp32 list it stays bf16, with it fp32
    class Chain(nn.Module):
        def forward(self, x):
            return (torch.softmax(torch.mm(x, x.T), -1),)

    fn = torch.compile(Chain(), backend="aot_eager") if compiled else Chain()
    with OpListAutocast(["mm"], ["softmax"]):
        assert fn(torch.randn(4, 8))[0].dtype == FP32
    torch._dynamo.reset()
    with OpListAutocast(["mm"], []):
        assert fn(torch.randn(4, 8))[0].dtype == BF16


def test_swapping_the_lists_swaps_the_dtypes():
    seen = run(OpListAutocast(["softmax", "conv1d"], ["linear"]))
    assert seen == {"linear": FP32, "softmax": BF16, "mm": FP32, "conv1d": BF16, "layer_norm": FP32}
    x = torch.randn(4, 8)
    with OpListAutocast(["softmax"], []):  # bf16 input to softmax from an fp32 tensor
        assert torch.softmax(x, -1).dtype == BF16


def test_a_cast_op_in_a_list_applies_like_any_other():
    # the kernel's own casts are `_to_copy` calls: with `_to_copy` listed they recursed without end
    x = torch.randn(4, 8, dtype=torch.float64)
    with OpListAutocast(["_to_copy", "mm"], []):
        y = torch.randn(4, 8).to(torch.float64)  # through bf16, as the bridge casts a listed op's inputs
        assert y.dtype == torch.float64 and torch.equal(y, y.to(BF16).to(torch.float64))
        assert torch.mm(x.float(), x.float().T).dtype == BF16


def test_layer_norm_in_the_bf16_list_casts_only_its_input_as_the_bridge_does():
    x = torch.randn(4, 8)
    weight = torch.randn(8)
    with OpListAutocast(["layer_norm"], []):
        out = torch.nn.functional.layer_norm(x, (8,), weight.bfloat16(), None)
    assert out.dtype == BF16  # the input was cast; a bf16 weight stays bf16 and mixes fine


class NormOperands(TorchDispatchMode):
    """The dtypes of the floating operands each norm kernel receives (below autocast, where kernels run)."""

    NORMS = ("native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit")

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.NORMS:
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            self.seen[name.strip("_")] = {a.dtype for a in operands}
        return func(*args, **(kwargs or {}))


def test_norms_in_the_bf16_list_get_operands_of_one_dtype_on_every_device():
    # the bridge casts only a norm's input; CUDA's layer_norm refuses a bf16 input with float32 weights (GPT-2
    # under Habana's default lists on an H200): each norm computes in float32 on the bf16-rounded input
    x, weight, bias = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    batch_norm = nn.BatchNorm1d(8)
    with NormOperands() as kernels, OpListAutocast(["layer_norm", "group_norm", "batch_norm"], []):
        layer = nn.functional.layer_norm(x, (8,), weight, bias)
        group = nn.functional.group_norm(x, 2, weight, bias)
        batch = batch_norm(x)
    assert len(kernels.seen) == 3 and all(dtypes == {FP32} for dtypes in kernels.seen.values()), kernels.seen
    assert layer.dtype == group.dtype == batch.dtype == BF16
    rounded = x.bfloat16().float()
    assert torch.equal(layer, nn.functional.layer_norm(rounded, (8,), weight, bias).bfloat16())
    assert torch.equal(group, nn.functional.group_norm(rounded, 2, weight, bias).bfloat16())
    # what torch's CPU kernel computes from the mixed operands, to bf16's precision
    torch.testing.assert_close(layer, nn.functional.layer_norm(x.bfloat16(), (8,), weight, bias))
    assert batch_norm.running_mean.dtype == FP32


def test_plain_torch_autocast_is_unchanged_outside_and_after():
    def plain():
        with torch.autocast("cpu", dtype=BF16):
            return dtypes(Recorder()(torch.randn(4, 8)))

    before = plain()
    assert before["conv1d"] == BF16 and before["linear"] == BF16  # torch's own CPU list
    with OpListAutocast(["softmax"], ["linear", "conv1d"]):
        pass
    run(OpListAutocast(["softmax"], ["linear", "conv1d"]), compiled=True)
    assert plain() == before
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutocastCPU")


def test_nesting_the_same_lists_keeps_them_until_the_outer_exit():
    ctx = OpListAutocast(["mm"], [])
    x = torch.randn(4, 4)
    with ctx:
        with ctx:
            assert torch.mm(x, x).dtype == BF16
        assert torch.mm(x, x).dtype == BF16 and torch.is_autocast_enabled("cpu")
        with pytest.raises(RuntimeError, match="different lists"):
            with OpListAutocast(["bmm"], []):
                pass
        assert torch.conv1d(x[None], x[:, :, None]).dtype == FP32  # still ours, not torch's list
    assert not torch.is_autocast_enabled("cpu")


@pytest.fixture
def installs(monkeypatch):
    """How many times op-list kernels were registered with the dispatcher."""
    from optimum_gaudi.precision.autocast import _Registration

    count, install = [], _Registration._install
    monkeypatch.setattr(_Registration, "_install", lambda self: count.append(1) or install(self))
    return count


def test_kept_kernels_are_installed_once_for_many_entries_and_removed_after(installs):
    ctx, x = OpListAutocast(["softmax"], []), torch.randn(4, 4)
    with ctx.kept():
        assert not torch.is_autocast_enabled("cpu")  # kept, not entered: torch.autocast is off between entries
        for _ in range(3):
            with ctx:
                assert torch.softmax(x, -1).dtype == BF16
    assert len(installs) == 1
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutocastCPU")  # removed


def test_the_trainer_installs_the_op_list_kernels_once_per_loop(installs, tiny_gpt2, tiny_lm_data, tmp_path):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, eval_strategy="steps", eval_steps=2,
        report_to=[], save_strategy="no", gaudi_config_name="gpt2", bf16=True,
    )  # fmt: skip
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data, eval_dataset=tiny_lm_data[:16])
    trainer.train()  # 4 training forwards and 2 evaluations inside one train(): one installation
    assert len(installs) == 1
    trainer.evaluate()
    assert len(installs) == 2
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutocastCPU")  # all removed


def test_gradients_reach_fp32_parameters_and_match_eager_when_compiled():
    torch.manual_seed(0)
    model = Recorder()
    x = torch.randn(4, 8)

    def grads(fn):
        model.zero_grad()
        with OpListAutocast(["linear", "mm"], ["softmax", "layer_norm"]):
            out = fn(x)
        sum(o.float().pow(2).sum() for o in out).backward()
        return [p.grad.clone() for p in model.parameters()]

    eager = grads(model)
    compiled = grads(torch.compile(model, backend="aot_eager"))
    for e, c in zip(eager, compiled, strict=True):
        assert e.dtype == FP32 and e.abs().sum() > 0
        torch.testing.assert_close(c, e, rtol=2e-2, atol=2e-2)


def test_unknown_names_warn_once_and_known_ones_still_apply(caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi.precision.autocast"):
        ctx = OpListAutocast(["mm", "truediv_not_an_op"], [])
        OpListAutocast(["truediv_not_an_op"], [])
    assert sum("truediv_not_an_op" in r.getMessage() for r in caplog.records) == 1
    with ctx:
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == BF16


def test_op_names_resolve_to_their_non_out_overloads():
    softmax = [op.name() for op in aten_overloads("softmax")]  # torch 2.11 also has aten::softmax.Dimname
    assert "aten::softmax.int" in softmax and "int_out" in torch.ops.aten.softmax.overloads()
    assert not [name for name in softmax if name.rsplit(".", 1)[1].endswith("out")]  # .out, .int_out
    assert [op.name() for op in aten_overloads("aten::add.Tensor")] == ["aten::add.Tensor"]
    assert aten_overloads("cross_entropy") is None  # the aten op is cross_entropy_loss


def test_an_op_in_both_lists_is_an_error():
    with pytest.raises(GaudiConfigError, match="in both autocast_bf16_ops and autocast_fp32_ops"):
        GaudiConfig(autocast_bf16_ops=["linear"], autocast_fp32_ops=["linear"])
    with pytest.raises(ValueError, match="in both"):
        OpListAutocast(["mm"], ["mm"])


def test_without_lists_torch_autocast_is_used():
    seen = run(CPUDevice().autocast_factory(None, None)())
    assert seen["linear"] == BF16 and seen["conv1d"] == BF16  # torch's built-in CPU list


def test_trainer_uses_the_config_lists_inside_its_forward(tmp_path):
    config = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["softmax"], autocast_fp32_ops=["linear"])
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], bf16=True)
    trainer = GaudiTrainer(model=Recorder(), args=args, gaudi_config=config)
    assert trainer.accelerator.mixed_precision == "no"  # accelerate's fixed lists would override ours
    with trainer.compute_loss_context_manager():
        seen = dtypes(trainer.model(torch.randn(2, 8, device=trainer.args.device)))
    assert seen["softmax"] == BF16 and seen["linear"] == FP32 and seen["conv1d"] == FP32


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_habana_default_lists_apply_as_on_a_gaudi(tiny_gpt2, compiled):
    from optimum_gaudi.features.compilation import prepare_older_torch
    from optimum_gaudi.precision.op_lists import resolve_op_lists

    prepare_older_torch()  # as a compiling trainer does (torch 2.6's dynamo needs it for transformers 5)
    bf16, fp32 = resolve_op_lists(None, None)  # what a config that names no list means
    model = Recorder()
    seen = run(OpListAutocast(bf16, fp32), compiled, model)
    assert seen == dict.fromkeys(NAMES, BF16)  # all five are in Habana's bf16 list
    with OpListAutocast(bf16, fp32):
        x = torch.randn(4, 8).bfloat16()
        assert torch.exp(x).dtype == FP32 and torch.div(x, 2).dtype == FP32  # in Habana's fp32 list
    gpt2 = tiny_gpt2()
    gpt2.loss_type = "ForCausalLM"
    ids = torch.randint(0, 100, (2, 16))
    with OpListAutocast(bf16, fp32):
        explanation = torch._dynamo.explain(gpt2)(input_ids=ids, labels=ids, use_cache=False)  # as trained
    if DYNAMO_BREAKS_IN_TRANSFORMERS:  # op lists or not: the model compiles, in pieces
        assert explanation.graph_count == explanation.graph_break_count + 1 > 1
        return
    assert explanation.graph_break_count == 0
