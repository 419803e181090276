"""The LLM path's kernels through transformers' own extension points: ``gaudi_fused_sdpa`` in the attention
registry, fused RMSNorm / rotary embedding swapped without forking a model class, and saved models that plain
transformers loads. On CPU, against transformers' sdpa; on the simulated Gaudi (tests/fakes, a test double),
against the calls the bridge's kernels receive."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import GAUDI_SOFTWARE, ON_DEVICE
from tiny import LENGTH, train_losses
from tiny import LLM_VOCAB as VOCAB
from tiny import llm_args as args
from tiny import llm_data as full_data
from tiny import llm_llama as llama
from transformers import LlamaForCausalLM

from optimum_gaudi import GaudiArgumentError, GaudiConfig, GaudiTrainer
from optimum_gaudi.devices import hpu as hpu_device
from optimum_gaudi.features import attention, kernels

BOTH = pytest.mark.parametrize("gaudi_software", GAUDI_SOFTWARE, indirect=True)


def padded_data(rows: int = 16) -> list[dict]:
    """Right-padded rows of random lengths: the padding mask matters, labels -100 on the pads."""
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(rows):
        n = int(torch.randint(LENGTH // 2, LENGTH + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        pad = LENGTH - n
        data.append(
            {
                "input_ids": ids + [0] * pad,
                "attention_mask": [1] * n + [0] * pad,
                "labels": ids + [-100] * pad,
            }
        )
    return data


# ---- CPU: gaudi_fused_sdpa is transformers' sdpa, call for call -------------------------------------------------


@pytest.mark.cpu
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("data", [padded_data, full_data], ids=["padding", "no-padding"])
def test_gaudi_fused_sdpa_trains_exactly_like_sdpa_on_cpu(tmp_path, bf16, data):
    reference = train_losses(llama(dropout=0.1), args(tmp_path / "sdpa", bf16=bf16), data())
    fused_args_flags = dict(flash_attention_recompute=True, flash_attention_fast_softmax=True)
    fused_args = args(tmp_path / "fused", bf16=bf16, attn_implementation="gaudi_fused_sdpa", **fused_args_flags)
    model = llama(dropout=0.1)
    assert train_losses(model, fused_args, data()) == reference  # the Gaudi-only modes change nothing here
    assert model.config._attn_implementation == "gaudi_fused_sdpa"


def test_the_attention_function_matches_sdpa_with_padding_and_grouped_heads():
    attention.register()
    batch = padded_data(4)
    inputs = {k: torch.tensor([row[k] for row in batch]) for k in ("input_ids", "attention_mask")}
    sdpa, fused = llama(), llama(attn_implementation="gaudi_fused_sdpa")
    torch.testing.assert_close(fused(**inputs).logits, sdpa(**inputs).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (dict(flash_attention_recompute=True), "--flash_attention_recompute set the modes of --attn_implementation"),
        (
            dict(attn_implementation="gaudi_fused_sdpa", flash_attention_fp8=True),
            "runs attention inside --fp8's Transformer Engine",
        ),
    ],
)
def test_attention_flags_without_their_implementation_are_one_line(tmp_path, flags, words):
    with pytest.raises(GaudiArgumentError) as excinfo:
        args(tmp_path, **flags)
    assert words in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_sdp_on_bf16_sets_torchs_math_sdpa_switch(tmp_path):
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        args(tmp_path, sdp_on_bf16=True).prepare_process()  # where the run starts: the trainer's constructor
        assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)


@pytest.mark.cpu
def test_fused_norm_and_rope_swap_nothing_on_cpu(tmp_path):
    config = GaudiConfig(use_fused_rms_norm=True, use_fused_rope=True)
    reference = train_losses(llama(), args(tmp_path / "a"), full_data())
    model = llama()
    assert train_losses(model, args(tmp_path / "b"), full_data(), gaudi_config=config) == reference
    assert not any("forward" in vars(m) for m in model.modules())


# ---- the swap itself: by code, not by class name ----------------------------------------------------------------


def test_only_llama_style_norms_and_rotary_functions_are_swapped():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    assert kernels.is_llama_rms_norm(MistralRMSNorm(8))
    assert not kernels.is_llama_rms_norm(GemmaRMSNorm(8))  # normalizes with (1 + weight)
    model = llama()
    seen = []
    assert kernels.fuse_rms_norms(model, lambda h, w, eps: seen.append(h.shape) or h) == 5  # 2 layers x 2 + final
    assert kernels.fuse_rms_norms(model, lambda h, w, eps: h) == 0  # once per module
    assert set(model.state_dict()) == set(llama().state_dict())


# ---- the simulated Gaudi: the bridge's kernels get the calls ---------------------------------------------------


def hpu_losses(tmp_path, bridge, data, gaudi_config=None, **flags):
    bridge_losses = train_losses(llama(), args(tmp_path, use_habana=True, **flags), data, gaudi_config)
    return bridge_losses, bridge().calls_named


@BOTH
def test_fused_sdpa_on_gaudi_takes_grouped_heads_and_the_causal_mode(tmp_path, bridge):
    reference = train_losses(llama(), args(tmp_path / "ref"), full_data())
    losses, calls = hpu_losses(tmp_path / "hpu", bridge, full_data(), attn_implementation="gaudi_fused_sdpa")
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    sdpa = calls("hpex.kernels.FusedSDPA")
    assert len(sdpa) == 3 * 2  # steps x layers
    call = sdpa[0].kwargs
    assert (call["q_heads"], call["kv_heads"]) == (4, 2)  # not repeated: the kernel groups the heads itself
    assert call["mask"] is None and call["is_causal"] and call["requires_backward"]
    assert call["recompute"] is False and call["softmax_mode"] == "none"


@BOTH
def test_fused_sdpa_on_gaudi_with_padding_gets_the_mask_or_the_causal_mode(tmp_path, bridge):
    reference = train_losses(llama(), args(tmp_path / "ref"), padded_data())
    losses, calls = hpu_losses(tmp_path / "mask", bridge, padded_data(), attn_implementation="gaudi_fused_sdpa")
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    call = calls("hpex.kernels.FusedSDPA")[0].kwargs
    assert call["mask"] == "torch.bool" and not call["is_causal"]

    flags = dict(attn_implementation="gaudi_fused_sdpa", flash_attention_causal_mask=True)
    flags.update(flash_attention_recompute=True, flash_attention_fast_softmax=True)
    bridge().reset()
    losses, calls = hpu_losses(tmp_path / "causal", bridge, padded_data(), **flags)
    # right padding: the real tokens never attend to the pads after them, so the causal mode is exact for them
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    call = calls("hpex.kernels.FusedSDPA")[0].kwargs
    assert call["mask"] is None and call["is_causal"] and call["recompute"] and call["softmax_mode"] == "fast"


def test_fast_softmax_with_a_padding_mask_falls_back_once_instead_of_the_bridges_assert(
    tmp_path, bridge, caplog, monkeypatch
):
    monkeypatch.setattr(hpu_device, "_warned", set())  # said once per process: an earlier test may have said it
    flags = dict(attn_implementation="gaudi_fused_sdpa", flash_attention_recompute=True)
    with caplog.at_level(logging.WARNING):
        hpu_losses(tmp_path, bridge, padded_data(), flash_attention_fast_softmax=True, **flags)
    modes = {c.kwargs["softmax_mode"] for c in bridge().calls_named("hpex.kernels.FusedSDPA")}
    assert modes == {"none"}
    assert sum("fast softmax only in causal mode" in r.getMessage() for r in caplog.records) == 1


@BOTH
def test_fused_rms_norm_and_rope_on_gaudi_keep_the_model_and_its_losses(tmp_path, bridge):
    reference = train_losses(llama(), args(tmp_path / "ref"), full_data())
    model = llama()
    config = GaudiConfig(use_fused_rms_norm=True, use_fused_rope=True)
    losses = train_losses(model, args(tmp_path / "hpu", use_habana=True), full_data(), config)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    calls = bridge().calls_named
    assert len(calls("hpex.normalization.FusedRMSNorm")) == 3 * 5  # steps x norms
    assert len(calls("hpex.kernels.RotaryPosEmbeddingHelperV1")) == 3 * 2 * 2  # steps x layers x (q, k)
    attention_layers = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    assert all("forward" in vars(m) for m in attention_layers) and len(attention_layers) == 2
    assert type(model) is LlamaForCausalLM and set(model.state_dict()) == set(llama().state_dict())


@BOTH
def test_fused_linear_cross_entropy_on_gaudi_trains_as_the_models_own_loss(tmp_path, bridge, gaudi_software):
    """The chunked loss on the Gaudi path (lazy mode under 1.19, eager under 1.21, and on hpu tensors in the pytest
    process on the simulated device also eager + torch.compile): the losses of the full logits, and the head never
    computes them."""
    gaudi = dict(use_habana=True, use_lazy_mode=gaudi_software == "1.19")
    reference = train_losses(llama(), args(tmp_path / "full", **gaudi), padded_data())
    model, head_rows = llama(), []
    model.lm_head.register_forward_hook(lambda module, inputs, out: head_rows.append(out.shape[1]))
    losses = train_losses(model, args(tmp_path / "fused", use_fused_linear_cross_entropy=True, **gaudi), padded_data())
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    assert head_rows == [1] * 3  # one position a row, each step
    if gaudi_software == "1.21" and ON_DEVICE:  # eager + torch.compile (hpu_backend): the chunk step compiled too
        from optimum_gaudi.features.linear_cross_entropy import FusedLinearCrossEntropy

        model, compiled = llama(), dict(torch_compile=True, use_regional_compilation=True)
        flags = args(tmp_path / "compiled", use_fused_linear_cross_entropy=True, **gaudi, **compiled)
        losses = train_losses(model, flags, padded_data())
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
        assert FusedLinearCrossEntropy.of(model).compiled_chunk is not None
        assert bridge().calls_named("dynamo.hpu_backend")  # compiled by the Gaudi's backend


@BOTH
@pytest.mark.skipif(not ON_DEVICE, reason="the bridge's autocast casts hpu tensors: run on the simulated device")
def test_fused_linear_cross_entropy_sums_in_float32_under_the_bridges_default_lists(tmp_path, bridge, gaudi_software):
    """use_torch_autocast with no lists: the bridge's defaults (hpu_ops/autocast_helpers.h), where ``mul`` is bf16.
    The first step's loss (same weights, same batch) with the fused loss is the model's own: float32
    cross-entropy of the head's bf16 logits (it was bf16-rounded: issue 37)."""
    gaudi = dict(use_habana=True, use_lazy_mode=gaudi_software == "1.19", max_steps=1)
    losses = {}
    for fused in (False, True):
        model, seen = llama(), []

        def record(module, inputs, out, seen=seen):  # the training step's forward (a Gaudi run also checks the batch)
            if module.training:
                seen.append((out.loss.detach(), out.logits.dtype))

        model.register_forward_hook(record)
        flags = args(tmp_path / str(fused), use_fused_linear_cross_entropy=fused, **gaudi)
        train_losses(model, flags, padded_data(), GaudiConfig(use_torch_autocast=True))
        assert len(seen) == 1
        losses[fused] = seen[0]
    (own, own_dtype), (got, _) = losses[False], losses[True]
    assert own_dtype == torch.bfloat16 and own.device.type == "hpu"  # the bridge's autocast did cast the head
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, own, rtol=2e-6, atol=0)


# ---- portable artifacts -----------------------------------------------------------------------------------------

LOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.arange(1, 17).reshape(1, 16)
ours = [m for m in sys.modules if m.split(".")[0] in ("optimum_gaudi", "habana_frameworks")]
print(json.dumps({"class": type(model).__name__, "gaudi": ours, "logits": model(ids).logits[0, -1, :4].tolist()}))
"""


def test_a_model_trained_with_every_llm_feature_loads_in_plain_transformers(tmp_path, bridge):
    model = llama()
    config = GaudiConfig(use_fused_rms_norm=True, use_fused_rope=True)
    flags = dict(attn_implementation="gaudi_fused_sdpa", flash_attention_causal_mask=True)
    trainer = GaudiTrainer(
        model=model, args=args(tmp_path, use_habana=True, **flags), train_dataset=full_data(), gaudi_config=config
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]
    assert "gaudi" not in json.dumps(saved).lower()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no simulator, no optimum_gaudi
    result = subprocess.run(
        [sys.executable, "-c", LOAD, str(tmp_path / "saved")], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["class"] == "LlamaForCausalLM" and out["gaudi"] == []
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"), attn_implementation="sdpa")
    expected = plain(torch.arange(1, 17).reshape(1, 16)).logits[0, -1, :4].tolist()
    torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-6)
