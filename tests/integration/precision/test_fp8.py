"""--fp8 on a Llama: torchao's float8 training on CPU, Intel's Gaudi Transformer Engine on the simulated Gaudi
(tests/fakes, a test double), one line where a device cannot; losses near bf16's; saved models plain.

Tolerances, from 20 steps of the 2-layer Llama below: fp8 linear layers within 1% of bf16's losses (worst step
0.17% on CPU with torchao, 0.32% on the simulator's Transformer Engine, which rounds through fp8 with delayed
scaling); adding fp8 attention within 5% (3.8% on the simulator, which rounds q, k and v through e4m3).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import GAUDI_SOFTWARE, has_torchao
from transformers import LlamaConfig, LlamaForCausalLM

from optimum_gaudi import GaudiArgumentError, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import base, detect_device
from optimum_gaudi.devices.cuda import CUDADevice
from optimum_gaudi.precision.fp8 import eligible_linears

BOTH = pytest.mark.parametrize("gaudi_software", GAUDI_SOFTWARE, indirect=True)
VOCAB, LENGTH, STEPS = 512, 32, 20
TOLERANCE = 0.01  # relative, per logged loss
ATTENTION_TOLERANCE = 0.05  # with q, k and v rounded through e4m3 as well (3.8% seen on the simulator)


def llama(seed: int = 0) -> LlamaForCausalLM:
    """Widths that are multiples of 16 (fp8 matmuls need them); the untied output layer stays in bf16."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config)


def data(rows: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, VOCAB, (rows, LENGTH), generator=g).tolist()]


def trained(tmp_path, **flags) -> tuple[GaudiTrainer, list[float]]:
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, logging_steps=1, per_device_train_batch_size=4, learning_rate=3e-3,
        report_to=[], save_strategy="no", seed=0, disable_tqdm=True, bf16=True, **flags,
    )  # fmt: skip
    trainer = GaudiTrainer(model=llama(), args=args, train_dataset=data())
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_close_losses(fp8: list[float], bf16: list[float], tolerance: float = TOLERANCE) -> None:
    assert len(fp8) == len(bf16) == STEPS
    worst = max(abs(a - b) / b for a, b in zip(fp8, bf16, strict=True))
    assert 0 < worst < tolerance, worst  # not identical: fp8 did round


def test_the_layers_fp8_computes_are_the_linears_of_the_blocks_not_the_output_layer():
    model = llama()
    layers = eligible_linears(model)
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert model.lm_head not in layers


# ---- CPU: torchao ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not has_torchao, reason="needs the [fp8] extra (torchao)")
def test_fp8_on_cpu_trains_a_llama_in_float8_close_to_bf16(tmp_path, torchao):
    _, bf16 = trained(tmp_path / "bf16")
    trainer, fp8 = trained(tmp_path / "fp8", fp8=True)
    kinds = {type(m).__name__ for m in trainer.model.model.layers.modules() if "Linear" in type(m).__name__}
    assert kinds == {"Float8Linear"} and type(trainer.model.lm_head) is torch.nn.Linear
    assert_close_losses(fp8, bf16)


@pytest.mark.skipif(not has_torchao, reason="needs the [fp8] extra (torchao)")
def test_fp8_on_a_torch_without_an_fp8_matmul_for_the_cpu_trains_emulated(tmp_path, torchao, monkeypatch):
    """torch 2.6 and 2.7 (Gaudi 1.20-1.22) have no ``aten::_scaled_mm`` on CPU: torchao's Float8Linear raised
    NotImplementedError at step 1. There it rounds through fp8 and multiplies in higher precision, the same
    numerics; on a torch that has the kernel, the seam is told it has none, so this runs on every torch."""
    monkeypatch.setattr(base, "has_fp8_matmul", lambda device_type: False)
    _, bf16 = trained(tmp_path / "bf16")
    trainer, fp8 = trained(tmp_path / "fp8", fp8=True)
    layers = [m for m in trainer.model.model.layers.modules() if type(m).__name__ == "Float8Linear"]
    assert len(layers) == 2 * 7 and all(layer.config.emulate for layer in layers)
    assert_close_losses(fp8, bf16)


def test_fp8_without_torchao_is_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    device = detect_device().type.upper()  # CPU here, CUDA on a machine with a GPU
    with pytest.raises(GaudiArgumentError, match=rf"^--fp8 on {device} uses torchao's float8 training: pip install"):
        GaudiTrainingArguments(output_dir=str(tmp_path), fp8=True, report_to=[])


def test_fp8_on_a_gpu_without_fp8_matmuls_is_one_line(monkeypatch, torchao):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    assert CUDADevice().fp8_problem() == (
        "--fp8 needs a GPU with fp8 matmuls (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
        "NVIDIA A100 has 8.0. Train with --bf16."
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert CUDADevice().fp8_problem() is None or not has_torchao


# ---- the simulated Gaudi: Intel Gaudi Transformer Engine ---------------------------------------------------


@pytest.fixture
def gaudi(bridge, monkeypatch):
    """The simulated bridge, with transformers told bf16 works (a Gaudi's answer; the simulator has no hpu device)."""
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    return bridge


@BOTH
def test_fp8_on_gaudi_with_the_fused_loss_gives_fp8s_own_losses(tmp_path, gaudi, gaudi_software):
    """The Transformer Engine computes the blocks; the fused loss the untouched bf16 output layer, in chunks."""
    flags = dict(use_habana=True, use_lazy_mode=gaudi_software == "1.19", fp8=True)
    _, fp8 = trained(tmp_path / "fp8", **flags)
    _, fused = trained(tmp_path / "fused", use_fused_linear_cross_entropy=True, **flags)
    assert len(gaudi().calls_named("te.Linear.forward", fp8=True)) == 2 * STEPS * 14  # fp8 in both runs
    # bf16 logits either way, rounded in another order: 1.05e-3 at worst over 20 steps here (fp8 vs bf16: 1%)
    assert fused == pytest.approx(fp8, rel=TOLERANCE / 4)


@BOTH
def test_fp8_on_gaudi_runs_the_transformer_engine_on_the_models_own_weights(tmp_path, gaudi):
    _, bf16 = trained(tmp_path / "bf16", use_habana=True)
    model = llama()
    weights = {name: p for name, p in model.named_parameters()}
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path / "fp8"), max_steps=STEPS, logging_steps=1, per_device_train_batch_size=4,
        learning_rate=3e-3, report_to=[], save_strategy="no", seed=0, disable_tqdm=True, bf16=True,
        use_habana=True, fp8=True, minimize_memory=True,
    )  # fmt: skip
    trainer = GaudiTrainer(model=model, args=args, train_dataset=data())
    trainer.train()
    calls = gaudi().calls_named
    built = calls("te.Linear")
    assert len(built) == 14 and all(c.kwargs["skip_weight_param_allocation"] for c in built)
    assert all(c.kwargs["minimize_memory"] for c in built)
    assert {c.kwargs["fp8_format"] for c in calls("te.fp8_autocast")} == {"HYBRID"}
    assert len(calls("te.Linear.forward", fp8=True)) == STEPS * 14 and not calls("te.Linear.forward", fp8=False)
    assert dict(model.named_parameters()).keys() == weights.keys()  # the same parameters, trained in place
    assert all(p is weights[name] for name, p in model.named_parameters())
    assert type(model.lm_head) is torch.nn.Linear
    assert_close_losses([h["loss"] for h in trainer.state.log_history if "loss" in h], bf16)

    gaudi().reset()
    trainer.evaluate(data(8))  # evaluation in the model's precision, as accelerate's fp8 leaves it
    assert calls("te.Linear.forward", fp8=False) and not calls("te.Linear.forward", fp8=True)


LOAD = """
import json, sys
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
ours = [m for m in sys.modules if m.split(".")[0] in ("optimum_gaudi", "habana_frameworks", "intel_transformer_engine")]
print(json.dumps({"class": type(model[0]).__name__, "info": {k: list(v) for k, v in model[1].items()}, "ours": ours}))
"""


def test_a_model_trained_in_fp8_on_gaudi_saves_as_plain_transformers(tmp_path, gaudi):
    trainer, _ = trained(tmp_path / "run", use_habana=True, fp8=True)
    assert any(key.endswith("._extra_state") for key in trainer.model.state_dict())  # TE keeps scaling state
    trainer.save_model(str(tmp_path / "saved"))
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # neither the simulator nor optimum_gaudi
    result = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "saved")], capture_output=True, text=True,
                            env=env, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["class"] == "LlamaForCausalLM" and out["ours"] == []
    assert out["info"]["missing_keys"] == [] and out["info"]["unexpected_keys"] == []


def test_fp8_on_gaudi_without_the_transformer_engine_is_one_line(tmp_path, bridge, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_NO_TE", "1")
    with pytest.raises(GaudiArgumentError) as error:
        GaudiTrainingArguments(output_dir=str(tmp_path), use_habana=True, fp8=True, report_to=[])
    assert str(error.value) == (
        "--fp8 needs Intel's Gaudi Transformer Engine, which this Gaudi software lacks (No module named "
        "'intel_transformer_engine'). Train with --bf16."
    )


# ---- --flash_attention_fp8: the Transformer Engine's FusedAttention on a Gaudi 3 -----------------------------

ATTENTION = dict(attn_implementation="gaudi_fused_sdpa", flash_attention_recompute=True)


@BOTH
def test_flash_attention_fp8_on_gaudi3_runs_one_fused_attention_per_layer_in_fp8(tmp_path, gaudi, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_DEVICE_NAME", "GAUDI3")
    _, bf16 = trained(tmp_path / "bf16", use_habana=True, **ATTENTION)
    gaudi().reset()
    trainer, fp8 = trained(tmp_path / "fp8", use_habana=True, fp8=True, flash_attention_fp8=True, **ATTENTION)
    calls = gaudi().calls_named("te.FusedAttention", fp8=True)
    assert len(calls) == STEPS * 2 and len({c.kwargs["instance"] for c in calls}) == 2  # its own per layer
    assert all(c.kwargs["is_causal"] and not c.kwargs["mask"] and c.kwargs["recompute"] for c in calls)
    assert not gaudi().calls_named("hpex.kernels.FusedSDPA")
    assert_close_losses(fp8, bf16, ATTENTION_TOLERANCE)


def test_flash_attention_fp8_needs_a_gaudi3_and_fp8_in_one_line(tmp_path, gaudi):
    flags = dict(output_dir=str(tmp_path), use_habana=True, report_to=[], flash_attention_fp8=True, **ATTENTION)
    with pytest.raises(GaudiArgumentError, match=r"^--flash_attention_fp8 runs attention inside --fp8's"):
        GaudiTrainingArguments(**flags)
    with pytest.raises(GaudiArgumentError) as error:
        GaudiTrainingArguments(**flags, fp8=True)
    assert str(error.value) == (
        "--flash_attention_fp8 needs a Gaudi 3 (fp8 attention); this is GAUDI2. Drop it to keep --fp8 elsewhere."
    )


@pytest.mark.skipif(not has_torchao, reason="needs the [fp8] extra (torchao)")
def test_flash_attention_fp8_changes_nothing_on_cpu(tmp_path, torchao):
    _, fp8 = trained(tmp_path / "a", fp8=True, **ATTENTION)
    _, both = trained(tmp_path / "b", fp8=True, flash_attention_fp8=True, **ATTENTION)
    assert both == fp8


# ---- fp8 as a Gaudi runs it: optimum-habana's recipe, custom ops decided before import, fp8 attention modules ----


def gaudi_args(tmp_path, steps: int = 2, **flags) -> GaudiTrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path), max_steps=steps, logging_steps=1, per_device_train_batch_size=4, learning_rate=3e-3,
        report_to=[], save_strategy="no", seed=0, disable_tqdm=True, bf16=True, use_habana=True, fp8=True,
    )  # fmt: skip
    return GaudiTrainingArguments(**{**defaults, **flags})


def autocast_recipes(gaudi) -> list[dict]:
    keys = ("margin", "interval", "fp8_format", "amax_history_len", "amax_compute_algo", "reduce_amax")
    return [{k: c.kwargs[k] for k in keys} for c in gaudi().calls_named("te.fp8_autocast")]


def test_fp8_on_gaudi_trains_with_optimum_habanas_recipe_unless_given_one(tmp_path, gaudi):
    GaudiTrainer(model=llama(), args=gaudi_args(tmp_path / "a"), train_dataset=data(8)).train()
    habana = dict(margin=0, interval=16, fp8_format="HYBRID", amax_history_len=1, amax_compute_algo="most_recent",
                  reduce_amax=False)  # fmt: skip
    assert autocast_recipes(gaudi) and all(r == habana for r in autocast_recipes(gaudi))
    gaudi().reset()
    recipe = tmp_path / "recipe.json"
    recipe.write_text('{"amax_history_len": 16, "amax_compute_algo": "max", "fp8_format": "e5m2"}')
    GaudiTrainer(model=llama(), args=gaudi_args(tmp_path / "b", fp8_recipe=str(recipe)), train_dataset=data(8)).train()
    given = {**habana, "amax_history_len": 16, "amax_compute_algo": "max", "fp8_format": "E5M2"}
    assert autocast_recipes(gaudi) and all(r == given for r in autocast_recipes(gaudi))


@pytest.mark.parametrize(
    "recipe, message",
    [
        (
            '{"amax_history": 4}',
            "--fp8_recipe: unknown key(s) amax_history; the keys are margin, interval, fp8_format, "
            "amax_history_len, amax_compute_algo, reduce_amax.",
        ),  # fmt: skip
        ('{"fp8_format": "E4M3"}', "--fp8_recipe: fp8_format must be one of HYBRID, E5M2, got 'E4M3'."),
        ('{"interval": 0}', "--fp8_recipe: interval must be an integer >= 1, got 0."),
        (
            "{interval: 1}",
            "--fp8_recipe is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2).",
        ),  # fmt: skip
        ("missing.json", "--fp8_recipe missing.json: no such file; pass JSON text or a JSON file of recipe keys."),
    ],
)
def test_a_bad_fp8_recipe_is_one_line_on_any_device(tmp_path, monkeypatch, recipe, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GaudiArgumentError) as error:  # no --fp8 needed: the mistake is caught wherever it is made
        GaudiTrainingArguments(output_dir=str(tmp_path), fp8_recipe=recipe, report_to=[])
    assert str(error.value) == message


@pytest.mark.skipif(not has_torchao, reason="needs the [fp8] extra (torchao)")
def test_an_fp8_recipe_is_said_to_be_ignored_by_torchao(torchao, caplog):
    from optimum_gaudi.devices.cpu import CPUDevice

    CPUDevice().fp8_plan(False, False, {"interval": 4})
    assert "--fp8_recipe sets a Gaudi's delayed scaling; torchao scales dynamically here: ignored." in caplog.text


def test_compiled_fp8_loads_the_transformer_engine_with_its_custom_ops(tmp_path, gaudi):
    gaudi_args(tmp_path, torch_compile=True)  # the arguments' check is the first import of the Transformer Engine
    assert sys.modules["intel_transformer_engine"].CUSTOM_OP and os.environ["PT_TE_CUSTOM_OP"] == "1"


def test_a_users_custom_op_setting_is_kept_and_eager_fp8_sets_none(tmp_path, gaudi, monkeypatch):
    gaudi_args(tmp_path)
    assert "PT_TE_CUSTOM_OP" not in os.environ and not sys.modules["intel_transformer_engine"].CUSTOM_OP
    del sys.modules["intel_transformer_engine"]
    monkeypatch.setenv("PT_TE_CUSTOM_OP", "0")
    gaudi_args(tmp_path, torch_compile=True)
    assert os.environ["PT_TE_CUSTOM_OP"] == "0"


def test_fp8_attention_is_a_module_of_each_layer_with_the_models_dropout(tmp_path, gaudi, monkeypatch):
    """Built from the model's attention dropout, not from the first call's: an evaluation first (dropout 0 there)
    must not leave training without dropout."""
    monkeypatch.setenv("FAKE_HPU_DEVICE_NAME", "GAUDI3")
    model = llama()
    model.config.attention_dropout = 0.25
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.25
    args = gaudi_args(tmp_path, flash_attention_fp8=True, **ATTENTION)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=data(8), eval_dataset=data(4))
    trainer.evaluate()
    trainer.train()
    te = sys.modules["intel_transformer_engine"]
    attentions = [layer.self_attn.get_submodule("gaudi_fp8_attention") for layer in model.model.layers]
    assert all(isinstance(a, te.FusedAttention) and a.attention_dropout == 0.25 for a in attentions)
    dropouts = [c.kwargs["dropout"] for c in gaudi().calls_named("te.FusedAttention.dropout")]
    assert dropouts[:2] == [0.0, 0.0] and set(dropouts[2:]) == {0.25}  # evaluation, then every training step
    assert any(k.endswith("gaudi_fp8_attention._extra_state") for k in model.state_dict())


def test_fp8_scaling_state_is_resumed_exactly(tmp_path, gaudi, monkeypatch):
    """The Transformer Engine's amax history travels in the checkpoint (not in the saved weights): the resumed
    steps scale as the uninterrupted run's did, so their losses are the same."""
    monkeypatch.setenv("FAKE_HPU_DEVICE_NAME", "GAUDI3")
    flags = dict(steps=6, save_strategy="steps", save_steps=3, flash_attention_fp8=True, **ATTENTION)
    whole = GaudiTrainer(model=llama(), args=gaudi_args(tmp_path / "whole", **flags), train_dataset=data(24))
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / "fp8_scaling_state.pt").is_file()
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.endswith("_extra_state")]
    resumed = GaudiTrainer(model=llama(), args=gaudi_args(tmp_path / "resumed", **flags), train_dataset=data(24))
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def losses(trainer):
        return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > 3]

    assert len(losses(resumed)) == 3 and losses(resumed) == losses(whole)


class _Scaled(torch.nn.Module):
    """A module with Transformer Engine-like extra state: a tensor, or an io.BytesIO (the two forms TE uses)."""

    def __init__(self, value: float, as_bytes: bool) -> None:
        super().__init__()
        self.value, self.as_bytes = value, as_bytes

    def get_extra_state(self):
        import io

        if not self.as_bytes:
            return torch.tensor([self.value])
        buffer = io.BytesIO()
        torch.save(self.value, buffer)
        return buffer

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor):
            self.value = float(state[0])
        else:
            state.seek(0)
            self.value = torch.load(state)


@pytest.mark.parametrize("as_bytes", [False, True])
def test_fp8_scaling_state_files_are_per_rank_and_a_missing_rank_takes_rank_0s(tmp_path, as_bytes, caplog):
    from optimum_gaudi.precision.fp8 import load_scaling_state, save_scaling_state

    for rank, value in ((0, 1.5), (1, 2.5)):
        save_scaling_state(torch.nn.Sequential(_Scaled(value, as_bytes)), str(tmp_path), rank, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8_scaling_state.rank0.pt", "fp8_scaling_state.rank1.pt"]
    for rank, value in ((0, 1.5), (1, 2.5)):
        model = torch.nn.Sequential(_Scaled(0.0, as_bytes))
        assert load_scaling_state(model, str(tmp_path), rank, 2) and model[0].value == value
    model = torch.nn.Sequential(_Scaled(0.0, as_bytes))  # resumed on 4 ranks: rank 3 has no file of its own
    assert load_scaling_state(model, str(tmp_path), 3, 4) and model[0].value == 1.5
    assert "no scaling state of rank 3" in caplog.text
