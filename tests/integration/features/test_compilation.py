"""Compile controls: regional compilation, dynamic shapes, eager first iteration, cache limit, logging."""

import logging

import pytest
import torch
import torch._dynamo
from conftest import FALLBACK_DEVICE
from torch import nn
from torch._dynamo.utils import counters
from transformers import TrainerCallback

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.features.compilation import (
    CompilationLog,
    CompileOptions,
    compile_regions,
    pin_loss_function,
    repeated_blocks,
)

NO_DROPOUT = dict(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)


def gpt2(n_layer=1, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = dict(vocab_size=100, n_layer=n_layer, n_embd=32, n_head=2, n_positions=16) | overrides
    return GPT2LMHeadModel(GPT2Config(**config))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    limit = torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.reset()


class GraphsPerStep(TrainerCallback):
    """Graphs dynamo has built by the end of each optimizer step."""

    def __init__(self):
        self.graphs = []

    def on_step_end(self, args, state, control, **kwargs):
        self.graphs.append(counters["stats"]["unique_graphs"])


def train(model, data, tmp_path, steps=4, gaudi_config=None, **kwargs):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, **kwargs,
    )  # fmt: skip
    probe = GraphsPerStep()
    trainer = GaudiTrainer(model=model, args=args, train_dataset=data, gaudi_config=gaudi_config, callbacks=[probe])
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h], probe.graphs


def test_repeated_blocks_is_the_largest_list_of_one_class():
    name, blocks = repeated_blocks(gpt2(3))
    assert name == "transformer.h" and len(blocks) == 3
    mixed = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]), nn.ModuleList([nn.Linear(2, 2)]))
    assert repeated_blocks(mixed) is None  # mixed classes, or a single block, are not repeated blocks


def eager_and_regional(data, tmp_path, backend):
    """Losses of an eager run, and (trainer, losses, graphs per step) of a regional compile from the same
    3-block GPT-2 with `backend`."""
    _, eager, _ = train(gpt2(3, **NO_DROPOUT), data, tmp_path / "eager")
    regional = train(
        gpt2(3, **NO_DROPOUT), data, tmp_path / "regional",
        torch_compile=True, torch_compile_backend=backend, use_regional_compilation=True,
    )  # fmt: skip
    return eager, regional


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_regional_compilation_compiles_the_block_once_and_the_loss_and_matches_eager(tiny_lm_data, tmp_path, backend):
    eager, (trainer, regional, graphs) = eager_and_regional(tiny_lm_data, tmp_path, backend)
    model = trainer.model
    assert all(block._compiled_call_impl is not None for block in model.transformer.h)
    assert model._compiled_call_impl is None  # the rest of the model stays eager
    assert graphs == [2, 2, 2, 2]  # one graph shared by the 3 blocks, one for the loss: never rebuilt
    assert trainer._compilation_log.graphs == 2
    model.config.use_cache = True  # (transformers >= 5 sets it from --use_cache, False by default)
    ids = torch.zeros(1, 4, dtype=torch.long, device=model.device)
    assert model(input_ids=ids).past_key_values is None  # off for the trainer
    assert model(input_ids=ids, use_cache=True).past_key_values is not None
    assert list(model.state_dict()) == list(gpt2(3).state_dict())  # no _orig_mod prefixes
    assert regional == pytest.approx(eager, abs=1e-4)


def test_regional_graphs_hold_the_block_and_the_loss_and_leave_the_embeddings_eager():
    model = gpt2(3, **NO_DROPOUT).train()
    ids = torch.randint(0, 100, (2, 8))
    expected = model(input_ids=ids, labels=ids).loss
    seen = []

    def recording_backend(graph_module, example_inputs):
        seen.append({str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"})
        return graph_module.forward

    pin_loss_function(model)  # as the trainer does: transformers' one-time loss warning stays out of the graph
    assert compile_regions(model, CompileOptions(backend=recording_backend, regional=True)) == "transformer.h"
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    block, loss_graph = seen  # built once for the 3 blocks, then once for the loss
    assert any("scaled_dot_product_attention" in t for t in block)
    assert any("cross_entropy" in t for t in loss_graph)
    assert not any("embedding" in t for t in block | loss_graph)  # the embeddings run eagerly
    torch.testing.assert_close(loss, expected)


def test_whole_model_compile_under_the_op_lists_has_no_graph_break(tiny_lm_data, tmp_path):
    config = GaudiConfig.from_pretrained("gpt2")
    _, eager, _ = train(gpt2(**NO_DROPOUT), tiny_lm_data, tmp_path / "eager", gaudi_config=config, bf16=True)
    _, compiled, graphs = train(
        gpt2(**NO_DROPOUT), tiny_lm_data, tmp_path / "compiled", gaudi_config=config, bf16=True,
        torch_compile=True, torch_compile_backend="inductor",
    )  # fmt: skip
    assert graphs == [1, 1, 1, 1]  # one graph for the whole forward: no graph break, no recompilation
    assert not counters["graph_break"]
    assert compiled == pytest.approx(eager, abs=0.02)


@pytest.mark.skipif(FALLBACK_DEVICE != "cpu", reason="the CPU device's fallback_random; this run trains on a GPU")
def test_compiled_training_on_cpu_draws_the_dropout_masks_eager_draws(tiny_lm_data, tmp_path):
    """CPUDevice compiles with inductor's fallback_random: compiled code takes its random numbers from
    torch's generator, so dropout (on here) follows the eager run's masks instead of another stream."""
    _, eager, _ = train(gpt2(2), tiny_lm_data, tmp_path / "eager")
    _, compiled, graphs = train(gpt2(2), tiny_lm_data, tmp_path / "compiled", torch_compile=True)
    assert graphs == [1, 1, 1, 1]
    assert compiled == pytest.approx(eager, abs=1e-4)


def test_compile_from_second_iteration_runs_the_first_step_eagerly(tiny_lm_data, tmp_path):
    _, _, graphs = train(
        gpt2(), tiny_lm_data, tmp_path, steps=3,
        torch_compile=True, torch_compile_backend="aot_eager", compile_from_sec_iteration=True,
        throughput_warmup_steps=2,
    )  # fmt: skip
    assert graphs[0] == 0 and graphs[1] >= 1


def test_compile_dynamic_and_cache_size_limit_reach_torch(tmp_path):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), report_to=[], torch_compile=True, compile_dynamic=True, cache_size_limit=3
    )
    trainer = GaudiTrainer(model=gpt2(), args=args)
    plugin = trainer.accelerator.state.dynamo_plugin
    assert plugin.dynamic is True and plugin.backend.value == "INDUCTOR"
    assert torch._dynamo.config.recompile_limit == 3


def test_a_new_shape_that_recompiles_is_logged_once_with_its_shape(caplog):
    log = CompilationLog()
    fn = torch.compile(lambda x: x.sin() + 1, backend="eager", dynamic=False)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi.features.compilation"):
        for step, shape in enumerate([(2, 8), (2, 8), (2, 5), (2, 8)]):
            inputs = {"input_ids": torch.zeros(shape)}
            with log.watch(inputs, step):
                fn(inputs["input_ids"])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and log.graphs == 2
    assert "input_ids=(2, 8)" in messages[0] and "step 0" in messages[0]
    assert "input_ids=(2, 5)" in messages[1] and "step 2" in messages[1]


def test_regional_compile_leaves_the_saved_config_as_it_is():
    model = gpt2(2)
    assert compile_regions(model, CompileOptions(backend="eager", regional=True)) == "transformer.h"
    assert model.config.use_cache is True


def test_regional_compile_without_repeated_blocks_returns_none():
    assert compile_regions(nn.Linear(2, 2), CompileOptions(backend="eager", regional=True)) is None


def test_compile_flags_without_torch_compile_warn_and_bad_limit_fails(tmp_path, caplog):
    from optimum_gaudi.trainers.training_args import GaudiArgumentError

    with caplog.at_level(logging.WARNING):
        GaudiTrainingArguments(output_dir=str(tmp_path), use_regional_compilation=True, report_to=[])
    assert "--use_regional_compilation only act with --torch_compile" in caplog.text
    with pytest.raises(GaudiArgumentError, match="--cache_size_limit must be >= 1"):
        GaudiTrainingArguments(output_dir=str(tmp_path), torch_compile=True, cache_size_limit=0, report_to=[])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        GaudiTrainingArguments(output_dir=str(tmp_path), torch_compile=True, report_to=[])
    assert "which --throughput_warmup_steps 0 counts in the throughput: pass --throughput_warmup_steps 1" in caplog.text


def test_regional_compilation_on_the_simulated_gaudi_uses_hpu_backend_for_the_block_and_the_loss(
    tiny_lm_data, tmp_path, bridge
):
    trainer, losses, graphs = train(
        gpt2(3, **NO_DROPOUT), tiny_lm_data, tmp_path, steps=2, use_habana=True,
        torch_compile=True, use_regional_compilation=True,
    )  # fmt: skip
    assert trainer.args.torch_compile_backend == "hpu_backend"
    assert len(bridge().calls_named("dynamo.hpu_backend")) == 2  # one graph for the 3 blocks, one for the loss
    assert graphs == [2, 2] and len(losses) == 2
