"""--gradient_checkpointing with the Gaudi features: the same losses as the run without it. Recomputing a layer's
activations in the backward must compute what the first forward did: in fp8 on a Gaudi (inside the Transformer
Engine's context, with the forward's scales), under training graphs, compiled, with FusedSDPA's own recompute.
On CPU and on the simulated Gaudi (tests/fakes, a test double)."""

from __future__ import annotations

import pytest
import torch
from conftest import has_torchao
from transformers import LlamaConfig, LlamaForCausalLM

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

VOCAB, LENGTH, STEPS = 256, 32, 4


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH)  # fmt: skip
    return LlamaForCausalLM(config)


def data(rows: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, VOCAB, (rows, LENGTH), generator=g).tolist()]


def losses(tmp_path, checkpointing: bool, **flags) -> list[float]:
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path / f"gc{int(checkpointing)}"), max_steps=STEPS, logging_steps=1, learning_rate=3e-3,
        per_device_train_batch_size=4, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
        gradient_checkpointing=checkpointing, **flags,
    )  # fmt: skip
    trainer = GaudiTrainer(model=llama(), args=args, train_dataset=data())
    trainer.train()
    if checkpointing:  # the layers did run checkpointed
        assert all(layer.gradient_checkpointing for layer in trainer.model.model.layers)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_same_losses(tmp_path, rel: float = 1e-6, **flags) -> None:
    without, with_checkpointing = losses(tmp_path, False, **flags), losses(tmp_path, True, **flags)
    assert len(without) == STEPS
    assert with_checkpointing == pytest.approx(without, rel=rel, abs=0)


@pytest.mark.cpu
@pytest.mark.parametrize(
    "flags",
    # aot_eager: dynamo and AOTAutograd trace the checkpoint as for inductor, without inductor's slow CPU codegen
    [
        {},
        {"torch_compile": True, "torch_compile_backend": "aot_eager"},
        {"bf16": True},
        {"use_fused_linear_cross_entropy": True},
    ],
    ids=["eager", "compiled", "bf16", "fused-loss"],
)
def test_checkpointing_changes_no_loss_on_cpu(tmp_path, flags):
    assert_same_losses(tmp_path, **flags)


@pytest.mark.cpu
@pytest.mark.skipif(not has_torchao, reason="needs the [fp8] extra (torchao)")
def test_checkpointing_changes_no_loss_with_torchao_fp8(tmp_path, torchao):
    assert_same_losses(tmp_path, bf16=True, fp8=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "flags",
    [dict(bf16=True), dict(bf16=True, use_hpu_graphs_for_training=True), dict(bf16=True, torch_compile=True)],
    ids=["eager", "cuda-graphs", "compiled"],
)
def test_checkpointing_changes_no_loss_on_cuda(tmp_path, flags):
    # compiled (CUDA graphs compile too), inductor fuses the checkpointed graph's bf16 kernels otherwise than the
    # plain one's: 1.7e-5 relative on an H200 (torch 2.11); eager, the same kernels run and the losses are equal
    compiled = flags.get("torch_compile") or flags.get("use_hpu_graphs_for_training")
    assert_same_losses(tmp_path, rel=1e-4 if compiled else 1e-6, **flags)


@pytest.fixture
def gaudi(bridge, monkeypatch):
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    return bridge


@pytest.mark.parametrize(
    "flags",
    [
        dict(bf16=True),
        dict(bf16=True, use_lazy_mode=True, use_hpu_graphs_for_training=True),
        dict(bf16=True, attn_implementation="gaudi_fused_sdpa", flash_attention_recompute=True),
        dict(bf16=True, fp8=True),
        dict(bf16=True, fp8=True, use_lazy_mode=True),
    ],
    ids=["eager", "lazy-training-graphs", "fused-sdpa-recompute", "fp8", "fp8-lazy"],
)
def test_checkpointing_changes_no_loss_on_gaudi(tmp_path, gaudi, flags):
    assert_same_losses(tmp_path, use_habana=True, **flags)


def test_fp8_recomputation_runs_in_the_transformer_engine_with_the_forwards_scales(tmp_path, gaudi):
    losses(tmp_path, True, use_habana=True, bf16=True, fp8=True)
    forwards = gaudi().calls_named("te.Linear.forward")
    assert forwards and all(c.kwargs["fp8"] for c in forwards)  # the recomputation too: never a plain linear
    assert len(forwards) == 2 * STEPS * 14  # 14 linear layers, each run twice per step: forward, recomputation
