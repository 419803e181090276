"""--use_fused_linear_cross_entropy: the model's own loss and gradients, without the [tokens, vocabulary] logits.

Each test compares against the model's own forward and loss (transformers' ForCausalLMLoss) on tiny models,
with chunks of a few tokens so that the chunking itself is exercised.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import transformers
from conftest import TORCH_RELEASE, cpu_fsdp, has_torchao
from support import SCRIPTS
from tiny import NO_DROPOUT, gpt2, lm_data
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.errors import UserError
from optimum_gaudi.features import linear_cross_entropy as fused_loss
from optimum_gaudi.features.linear_cross_entropy import FusedLinearCrossEntropy, linear_cross_entropy

VOCAB = 100


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 5 * VOCAB)  # 5-token chunks


def llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    config = LlamaConfig(**{**sizes, **overrides})
    return LlamaForCausalLM(config)


def llama_family(name: str) -> Callable[[], torch.nn.Module]:
    """A tiny model of the decoder-only families Gaudi users fine-tune, by its transformers class names."""

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        config_cls, model_cls = (getattr(transformers, f"{name}{kind}") for kind in ("Config", "ForCausalLM"))
        sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
        return model_cls(config_cls(**sizes))

    return make


def gpt2_tied() -> torch.nn.Module:
    return gpt2(**NO_DROPOUT)  # tied embeddings


def gpt2_with_head_bias() -> torch.nn.Module:
    model = gpt2_tied()
    model.lm_head.bias = torch.nn.Parameter(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)))
    return model


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt left out of the loss
    labels[2, 9:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


FAMILIES = ("Mistral", "Qwen2", "Qwen3", "Gemma")  # Gemma (1): tied embeddings, no soft cap


MODELS = [llama, gpt2_tied, gpt2_with_head_bias, *map(llama_family, FAMILIES)]
MODEL_IDS = ["llama", "gpt2-tied", "head-bias", *(f.lower() for f in FAMILIES)]
# the chunk step compiled (aot_eager: dynamo's capture and AOTAutograd without code generation, cheap; inductor's
# code is checked by test_compiled_chunk_step_with_inductor)
COMPILED = [
    pytest.param(make, True, id=f"{name}-compiled") for make, name in zip(MODELS, MODEL_IDS, strict=True)
    if name in ("llama", "gpt2-tied", "head-bias")
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "compiled"), [*(pytest.param(m, False, id=i) for m, i in zip(MODELS, MODEL_IDS, strict=True)), *COMPILED]
)
@pytest.mark.parametrize("num_items", [None, 40])
def test_loss_and_gradients_are_the_models_own(make, compiled, num_items):
    model = make()
    reference = copy.deepcopy(model)
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    expected = reference(**batch(), **kwargs)
    expected.loss.backward()
    head_shapes = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_shapes.append(out.shape))
    fused = FusedLinearCrossEntropy.of(model)
    if compiled:
        fused.compile_with({"backend": "aot_eager"})
    with fused.step():
        got = model(**batch(), **kwargs)
    got.loss.backward()
    assert head_shapes == [(3, 1, VOCAB)]  # the full logits are never computed
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


# Every op the fused loss runs besides the output layer, in the bf16 list: a user's list may name any of them
EVERY_OP_BF16 = (
    "linear mm addmm matmul mul sub add sum amax exp log gather where masked_fill scatter_add div true_divide neg "
    "clone ne eq".split()
)


@pytest.mark.parametrize("bf16_ops", [None, EVERY_OP_BF16], ids=["habana-default-lists", "every-op-bf16"])
def test_under_op_list_autocast_the_loss_is_summed_in_float32(bf16_ops):
    """Habana's default lists put ``mul`` (and ``mean``, ``softmax``) in bf16 (hpu_ops/autocast_helpers.h): the
    model's own loss is float32 cross-entropy on its bf16 logits, and so must the fused loss be, whatever else a
    list names (issue 37: its per-token sum was bf16, 3.9e-4 from an fp32 reference against the model's 4.4e-5)."""
    from optimum_gaudi.precision.autocast import OpListAutocast
    from optimum_gaudi.precision.op_lists import resolve_op_lists

    model = llama()
    reference = copy.deepcopy(model)
    lists = OpListAutocast(*resolve_op_lists(bf16_ops, [] if bf16_ops else None))
    with lists:
        expected = reference(**batch())
        with FusedLinearCrossEntropy.of(model).step():
            got = model(**batch())
    assert expected.logits.dtype == torch.bfloat16  # the head did run in bf16
    fp32_loss = ForCausalLMLoss(expected.logits.float(), batch()["labels"], VOCAB)  # of those logits, no autocast
    assert got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, fp32_loss, rtol=2e-6, atol=0)
    if bf16_ops is None:  # the model's own loss is that too
        torch.testing.assert_close(got.loss, expected.loss, rtol=2e-6, atol=0)
    expected.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=2e-2, atol=1e-4)


def test_function_matches_for_causal_lm_loss_with_shift_labels_and_no_grad():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 7, 16, generator=g), torch.randn(VOCAB, 16, generator=g)
    labels = torch.randint(0, VOCAB, (2, 7), generator=g)
    shifted = labels.roll(-1, 1)
    shifted[:, -1], shifted[1, 3] = -100, -100
    logits = torch.nn.functional.linear(hidden, weight)
    for kwargs in ({"shift_labels": shifted}, {"shift_labels": shifted, "num_items_in_batch": 9}, {}):
        expected = ForCausalLMLoss(logits, labels, VOCAB, **kwargs)
        with torch.no_grad():
            got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=3, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_compiled_chunk_step_with_inductor(bias=True):
    """The chunk step compiled by inductor (generated code): loss and the gradients of the hidden states, weight
    and bias equal those of the full logits' cross-entropy, with ignored targets and a last chunk of another
    shape."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 11, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    head_bias = torch.randn(VOCAB, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, VOCAB, (2, 11), generator=g)
    labels[0, :4] = -100
    expected = ForCausalLMLoss(torch.nn.functional.linear(hidden, weight, head_bias), labels, VOCAB)
    want = torch.autograd.grad(expected, [hidden, weight, *([head_bias] if bias else [])])
    torch._dynamo.reset()
    step = fused_loss.compiled_chunk(backend="inductor")
    got = linear_cross_entropy(hidden, weight, labels, head_bias, chunk_tokens=4, compiled_chunk=step)  # 4, 4, ..., 2
    grads = torch.autograd.grad(got, [hidden, weight, *([head_bias] if bias else [])])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_weight_gradient_is_accumulated_in_one_buffer():
    """No [vocabulary, hidden] temporary per chunk: over 6 chunks, forward and backward make one such tensor
    (the weight's float32 gradient, added into in place and scaled in place)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NewWeightShaped(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and tuple(t.shape) == (VOCAB, 16):
                    self.storages.add(t.untyped_storage().data_ptr())
            return out

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 12), generator=g)
    with NewWeightShaped() as seen:
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=4).backward()
    assert len(seen.storages - {weight.untyped_storage().data_ptr()}) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (tests/scripts/device_check.sh runs it on one)")
@pytest.mark.parametrize("chunk_step", ["eager", "inductor"])
def test_on_cuda_under_bf16_autocast_the_weight_gradient_is_added_into_float32_in_place(chunk_step):
    """torch's CUDA addmm writes a bf16 product into the float32 gradient (out_dtype): probed once, then used for
    every chunk; loss and gradients those of the full logits under the same autocast."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 64, generator=g).cuda().requires_grad_()
    weight = torch.randn(VOCAB, 64, generator=g).cuda().requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 24), generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight)
    expected = ForCausalLMLoss(logits.float(), labels, VOCAB)
    want = torch.autograd.grad(expected, [hidden, weight])
    step = fused_loss.compiled_chunk(backend="inductor") if chunk_step == "inductor" else None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=16, compiled_chunk=step)
    grads = torch.autograd.grad(got, [hidden, weight])
    assert fused_loss._MIXED_ADDMM.get("cuda") is True
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("chunk_step", ["eager", "compiled"])
def test_compiles_without_graph_breaks(chunk_step):
    """The whole model, its hooks and the fused loss, forward and backward, in one graph (a break raises): no break
    between the last block and the loss; a compiled chunk step is traced into the model's graph. Where dynamo
    breaks in transformers' own wrappers around a Llama (torch 2.6; 2.7 at its per-layer config view's iterator),
    none of the breaks is in the package's code."""
    from optimum_gaudi.features.compilation import prepare_older_torch

    prepare_older_torch()  # as a compiling trainer does (torch 2.6's dynamo needs it for transformers 5)
    breaks_in_transformers = TORCH_RELEASE < (2, 8)
    model, reference = llama(), llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=not breaks_in_transformers, backend="eager")
    kwargs = {**batch(), "num_items_in_batch": torch.tensor(23)}
    expected = reference(**kwargs).loss
    expected.backward()
    fused = FusedLinearCrossEntropy.of(model)
    if chunk_step == "compiled":
        fused.compile_with({"backend": "eager"})
    with fused.step():
        got = compiled(**kwargs)
    got.loss.backward()
    assert got.logits.shape[1] == 1
    torch.testing.assert_close(got.loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    if breaks_in_transformers:
        torch._dynamo.reset()
        with fused.step():
            explanation = torch._dynamo.explain(model)(**kwargs)
        assert explanation.graph_break_count > 0  # transformers' wrappers
        stacks = [reason.user_stack for reason in explanation.break_reasons]
        assert not [frame for stack in stacks for frame in stack if "optimum_gaudi" in frame.filename]


def padded_rows(rows: int = 16) -> list[dict]:
    """lm_data's rows with a different number of padded (-100) label positions each: num_items_in_batch
    differs between the batches of one accumulated step."""
    data = lm_data(rows)
    for i, row in enumerate(data):
        row["labels"] = row["labels"][: 16 - i % 7] + [-100] * (i % 7)
    return data


def train(model, tmp_path, fused: bool, **kwargs) -> tuple[GaudiTrainer, list[float]]:
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        logging_steps=1, report_to=[], seed=0, save_strategy="no", use_fused_linear_cross_entropy=fused, **kwargs,
    )  # fmt: skip
    trainer = GaudiTrainer(model=model, args=args, train_dataset=padded_rows())
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_losses_match_under_gradient_accumulation(tmp_path):
    ref_trainer, expected = train(llama(), tmp_path / "a", fused=False)
    model, head_outputs = llama(), []
    model.lm_head.register_forward_hook(lambda m, a, out: head_outputs.append(tuple(out.shape)))
    trainer, got = train(model, tmp_path / "b", fused=True)
    assert head_outputs == [(2, 1, VOCAB)] * 6  # one position a row: no full logits in any step
    assert len(got) == 3
    assert got == pytest.approx(expected, rel=1e-5)
    for p, q in zip(trainer.model.parameters(), ref_trainer.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_a_short_batch_padded_in_the_forward_gives_the_models_own_losses(bridge, tmp_path, monkeypatch):
    """A lazy-mode Gaudi (simulated) pads an epoch's short last batch. Where padding the labels with -100 is not
    shown inert (forced here), the forward runs padded and the loss function is given the real rows only: the
    fused loss cuts the hidden states it took from the output layer alike (it had the padded rows: a shape
    error)."""
    from optimum_gaudi.features.static_batches import StaticRows

    monkeypatch.setattr(StaticRows, "_masked_is_inert", lambda self, *args: False)

    def run(out, fused, **kwargs):
        args = GaudiTrainingArguments(
            output_dir=str(tmp_path / out), num_train_epochs=1, per_device_train_batch_size=4, logging_steps=1,
            report_to=[], seed=0, save_strategy="no", use_fused_linear_cross_entropy=fused, **kwargs,
        )  # fmt: skip
        model, rows = llama(), []
        model.model.embed_tokens.register_forward_pre_hook(lambda module, inputs: rows.append(inputs[0].size(0)))
        trainer = GaudiTrainer(model=model, args=args, train_dataset=padded_rows(10))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], rows

    expected, _ = run("cpu", fused=False, use_cpu=True, use_lazy_mode=True)  # sets PT_HPU_LAZY_MODE=1 as the Gaudi's
    got, rows = run("hpu", fused=True, use_habana=True, use_lazy_mode=True)
    assert rows[-1] == 4  # the short batch (2 rows) ran padded
    assert len(got) == 3 and got == pytest.approx(expected, rel=1e-5)


@pytest.mark.cpu
@pytest.mark.skipif(not has_torchao, reason="needs the [fp8] extra (torchao)")
def test_with_fp8_the_fused_loss_gives_fp8s_own_losses(tmp_path, torchao):
    """--fp8 converts the layers, not the output layer: the fused loss computes the same bf16 head (torchao here)."""
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    _, expected = train(llama(**sizes), tmp_path / "a", fused=False, bf16=True, fp8=True)
    trainer, got = train(llama(**sizes), tmp_path / "b", fused=True, bf16=True, fp8=True)
    assert type(trainer.model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"  # fp8 did convert them
    assert len(got) == 3 and got == pytest.approx(expected, rel=1e-3)


@pytest.mark.cpu
def test_with_regional_compilation_the_loss_is_compiled_beside_the_blocks(tmp_path):
    """--torch_compile compiles the fused loss's chunk step with the model's backend, here beside the regionally
    compiled blocks (--use_regional_compilation also compiles the model's loss_function before the first step: the
    fused loss still recognises transformers' causal LM loss under it). A model compiled whole traces the loss into
    its own graph (test_compiles_without_graph_breaks). Losses equal the model's own with gradient accumulation
    and padded labels."""
    _, expected = train(llama(num_hidden_layers=2), tmp_path / "a", fused=False)
    compiled = dict(torch_compile=True, use_regional_compilation=True, torch_compile_backend="aot_eager")
    trainer, got = train(llama(num_hidden_layers=2), tmp_path / "b", fused=True, **compiled)
    inner = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    assert inner.model.layers[0]._compiled_call_impl is not None  # the blocks were compiled regionally
    assert FusedLinearCrossEntropy.of(inner).compiled_chunk is not None
    assert len(got) == 3 and got == pytest.approx(expected, rel=1e-4)


def test_gaudi_config_key_and_evaluation_keep_the_logits(tmp_path):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], save_strategy="no")
    trainer = GaudiTrainer(
        model=llama(),
        args=args,
        train_dataset=padded_rows(),
        gaudi_config=GaudiConfig(use_fused_linear_cross_entropy=True),
    )
    trainer.train()
    assert FusedLinearCrossEntropy.of(trainer.model).checked  # the fused loss ran
    predictions = trainer.predict(padded_rows(4))
    assert predictions.predictions.shape == (4, 16, VOCAB)
    assert predictions.metrics["test_loss"] == pytest.approx(trainer.evaluate(padded_rows(4))["eval_loss"], rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs the [peft] extra")
def test_lora_with_a_frozen_head(tmp_path):
    from peft import LoraConfig, get_peft_model

    def lora():
        return get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    _, expected = train(lora(), tmp_path / "a", fused=False, learning_rate=1e-2)
    trainer, got = train(lora(), tmp_path / "b", fused=True, learning_rate=1e-2)
    assert not trainer.model.get_base_model().lm_head.weight.requires_grad
    assert got == pytest.approx(expected, rel=1e-5)
    compiled = dict(torch_compile=True, use_regional_compilation=True, torch_compile_backend="aot_eager")
    trainer, got = train(lora(), tmp_path / "c", fused=True, learning_rate=1e-2, **compiled)
    assert FusedLinearCrossEntropy.of(trainer.model).compiled_chunk is not None
    assert got == pytest.approx(expected, rel=1e-4)


def gemma2() -> Gemma2ForCausalLM:
    torch.manual_seed(0)
    return Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            head_dim=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            final_logit_softcapping=30.0,
        )  # fmt: skip
    )


def scaled_head() -> LlamaForCausalLM:
    """A head that does more than its linear layer, with no Llama config key saying so."""
    model = llama()
    model.lm_head.register_forward_hook(lambda m, a, out: out * 0.125)
    return model


@pytest.mark.parametrize(
    ("make", "says"),
    [(gemma2, "final_logit_softcapping=30.0"), (scaled_head, "scales or caps")],
    ids=["softcap", "scale"],
)
def test_a_head_that_does_more_is_refused_in_one_line(make, says, tmp_path):
    with pytest.raises(UserError, match=says) as raised:
        train(make(), tmp_path, fused=True)
    assert "\n" not in str(raised.value)


class OwnLoss(GaudiTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize(
    ("trainer_cls", "extra", "says"),
    [(OwnLoss, {}, "OwnLoss overrides compute_loss"), (GaudiTrainer, {"label_smoothing_factor": 0.1}, "smooths")],
)
def test_what_needs_the_logits_is_refused_when_the_trainer_is_built(trainer_cls, extra, says, tmp_path):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], use_fused_linear_cross_entropy=True, **extra)
    with pytest.raises(UserError, match=says):
        trainer_cls(model=llama(), args=args, train_dataset=padded_rows())


def test_the_gaudi_config_key_steps_aside_where_it_cannot_serve(tmp_path, caplog):
    """The bundled configs turn the key on: a trainer or model it cannot serve trains with the full logits,
    after one warning, where the flag is an error."""
    on = GaudiConfig(use_fused_linear_cross_entropy=True)
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], max_steps=1, save_strategy="no")
    with caplog.at_level("WARNING", logger="optimum_gaudi"):
        assert not OwnLoss(model=llama(), args=args, gaudi_config=on)._fused_loss
        trainer = GaudiTrainer(model=gemma2(), args=args, train_dataset=padded_rows(), gaudi_config=on)
        trainer.train()
    assert "OwnLoss overrides compute_loss" in caplog.text
    assert "final_logit_softcapping=30.0" in caplog.text
    assert FusedLinearCrossEntropy.of(trainer.model, strict=False) is None


@cpu_fsdp
def test_fsdp_sharded_heads_give_the_models_own_losses(tmp_path):
    """FSDP2 on 2 processes, an untied Llama: the output layer in the root unit, and as a unit of its own (resharded
    after its forward, so the loss gathers it again and FSDP reduce-scatters its gradient), also with the chunk
    step compiled (regional compilation)."""
    script = SCRIPTS / "fused_loss_fsdp.py"
    out = tmp_path / "out.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(port), str(script), str(out)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert all(run["head_is_sharded"] for run in runs.values())
    assert runs["root_fused"]["losses"] == pytest.approx(runs["root"]["losses"], rel=1e-5)
    assert runs["own_unit_fused"]["losses"] == pytest.approx(runs["root"]["losses"], rel=1e-5)
    assert runs["own_unit_fused_compiled"]["chunk_compiled"]
    assert runs["own_unit_fused_compiled"]["losses"] == pytest.approx(runs["root"]["losses"], rel=1e-4)
