"""The HPU path against the simulator (tests/fakes, a test double): one test per defect of issue 20 handled here
(graphs, launch, requirements, op names).

Each defect was found by reading the real bridge (HabanaAI/gaudi-pytorch-bridge 1.19.0) or accelerate; the
simulator models the behaviour involved, and each test failed before its fix.

The defects that need a launched process: tests/integration/devices/test_hpu_launch_and_lazy_mode.py."""

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from support import REPO, SCRIPTS
from tiny import PadCollator, tiny_decoder_only, tiny_t5
from transformers import GPT2Config, GPT2ForSequenceClassification

from optimum_gaudi import GaudiSeq2SeqTrainer, GaudiSeq2SeqTrainingArguments, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.trainers.seq2seq import STATIC_INPUT_MULTIPLE

GRAPH_FORWARD = "hpu.wrap_in_hpu_graph.forward"  # the simulator's record of each graph-wrapped forward


def hpu_args(tmp_path, args_class=GaudiTrainingArguments, **kwargs):
    defaults = dict(output_dir=str(tmp_path), use_habana=True, max_steps=2, logging_steps=1, report_to=[])
    defaults.update(save_strategy="no", per_device_train_batch_size=4, per_device_eval_batch_size=4)
    return args_class(**{**defaults, **kwargs})


# ---- 1. an inference graph's replay copies each batch into the tensors of its capture call -------------------


def tiny_classifier():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=60, n_layer=1, n_embd=16, n_head=2, n_positions=8, num_labels=3, pad_token_id=0)
    return GPT2ForSequenceClassification(config)


def kept_for_metrics(trainer_class, args, model, data, **kwargs):
    """The labels and inputs compute_metrics saw, and the metrics it returned."""
    per_batch = []

    def compute_metrics(prediction):
        labels, inputs = np.asarray(prediction.label_ids), np.asarray(prediction.inputs)
        per_batch.append((labels.copy(), inputs.copy()))
        return {"label_sum": float(labels.sum()), "input_sum": float(inputs.sum())}

    trainer = trainer_class(model=model, args=args, compute_metrics=compute_metrics, **kwargs)
    metrics = trainer.evaluate(data)
    return per_batch, metrics


def test_evaluation_metrics_with_inference_graphs_equal_those_without(bridge, tmp_path):
    """transformers keeps a batch's labels and inputs by reference for compute_metrics; a replay wrote the next
    batch into them (batch 0's labels read as batch 1's)."""
    rows = [{"input_ids": [i % 50 + 1] * 8, "labels": i // 4 % 3} for i in range(12)]  # 3 same-shape batches

    def evaluate(graphs):
        args = hpu_args(
            tmp_path / str(graphs), use_lazy_mode=True, use_hpu_graphs_for_inference=graphs,
            include_for_metrics=["inputs"],
        )  # fmt: skip
        return kept_for_metrics(GaudiTrainer, args, tiny_classifier(), rows)

    (plain, plain_metrics), (graphed, graphed_metrics) = evaluate(False), evaluate(True)
    assert len(bridge().calls_named(GRAPH_FORWARD, mode="replay")) == 2
    for (labels, inputs), (graphed_labels, graphed_inputs) in zip(plain, graphed, strict=True):
        assert labels.tolist() == graphed_labels.tolist() and inputs.tolist() == graphed_inputs.tolist()
    assert graphed_metrics["eval_label_sum"] == plain_metrics["eval_label_sum"]
    assert graphed_metrics["eval_input_sum"] == plain_metrics["eval_input_sum"]
    assert graphed_metrics["eval_loss"] == pytest.approx(plain_metrics["eval_loss"], abs=1e-6)


@pytest.mark.parametrize("generate", [False, True])
def test_seq2seq_labels_with_inference_graphs_equal_those_without(bridge, tmp_path, generate):
    """The Seq2Seq loss forward replays too, labels among its inputs (generating, labels as long as
    generation_max_length are kept unpadded, by reference; inputs of a bucket's length are not padded)."""
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(4, 40, (STATIC_INPUT_MULTIPLE,), generator=g).tolist()} for _ in range(12)]
    rows = [{**r, "labels": r["input_ids"][:8]} for r in rows]  # 3 batches of one shape

    def evaluate(graphs):
        args = hpu_args(
            tmp_path / str(graphs), GaudiSeq2SeqTrainingArguments, use_lazy_mode=True,
            use_hpu_graphs_for_inference=graphs, include_for_metrics=["inputs"], predict_with_generate=generate,
            generation_max_length=8,
        )  # fmt: skip
        return kept_for_metrics(GaudiSeq2SeqTrainer, args, tiny_t5(), rows, data_collator=PadCollator(0))

    (plain, plain_metrics), (graphed, graphed_metrics) = evaluate(False), evaluate(True)
    assert bridge().calls_named(GRAPH_FORWARD, mode="replay")
    (labels, inputs), (graphed_labels, graphed_inputs) = plain[-1], graphed[-1]
    assert graphed_labels.tolist() == labels.tolist() and graphed_inputs.tolist() == inputs.tolist()
    assert graphed_metrics["eval_loss"] == pytest.approx(plain_metrics["eval_loss"], abs=1e-6)


# ---- 2. --bf16 with training graphs: accelerate's mixed precision rebinds ModuleCacher's forward -------------


def autocast_seen(model):
    """Whether each forward of ``model`` ran under HPU autocast (a hook on its first block)."""
    seen = []
    model.transformer.h[0].register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("hpu")))
    return seen


@pytest.mark.parametrize("gaudi_config_name", [None, "t5"])  # no autocasting config: accelerate's bf16
def test_bf16_with_training_graphs_trains_under_hpu_autocast(
    bridge, tmp_path, tiny_gpt2, tiny_lm_data, monkeypatch, gaudi_config_name
):
    """accelerate's mixed precision did ``MethodType(model.forward.__func__, model)``, binding ModuleCacher's
    forward to the model: an AttributeError at the first step. The trainer enters the HPU autocast instead."""
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)  # a Gaudi's answer
    args = hpu_args(
        tmp_path, use_lazy_mode=True, use_hpu_graphs_for_training=True, bf16=True, gaudi_config_name=gaudi_config_name
    )
    model = tiny_gpt2()
    seen = autocast_seen(model)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny_lm_data)
    trainer.train()
    assert trainer.accelerator.mixed_precision == "no"
    assert bridge().calls_named("hpu.ModuleCacher.forward", cached=True) and seen and all(seen)


def test_bf16_with_training_graphs_and_fast_ddp_runs_the_graph_under_hpu_autocast(
    bridge, tmp_path, tiny_gpt2, tiny_lm_data, monkeypatch
):
    """fast_ddp prepares the model with accelerate too (placement, and its mixed precision before the fix)."""
    from optimum_gaudi.distributed import fast_ddp

    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(fast_ddp.FusedGradientAllReduce, "__init__", lambda self, params, dtype=None: None)
    monkeypatch.setattr("optimum_gaudi.preparation.pipeline.broadcast_parameters", lambda model: None)
    args = hpu_args(
        tmp_path, use_lazy_mode=True, use_hpu_graphs_for_training=True, bf16=True, distribution_strategy="fast_ddp"
    )
    args.parallel_layout = dataclasses.replace(args.parallel_layout, fast_ddp=True)  # as on several processes
    model = tiny_gpt2()
    seen = autocast_seen(model)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny_lm_data)
    wrapped = trainer._wrap_model(trainer.model, training=True)
    assert isinstance(wrapped, fast_ddp.FastDDPModel)
    batch = {"input_ids": torch.tensor([tiny_lm_data[0]["input_ids"]])}
    with trainer.compute_loss_context_manager():
        wrapped(**batch, labels=batch["input_ids"]).loss.backward()
    assert bridge().calls_named("hpu.ModuleCacher.forward", cached=True) and seen == [True]


def test_fp16_with_training_graphs_is_one_line(bridge, tmp_path):
    from optimum_gaudi import GaudiArgumentError

    with pytest.raises(GaudiArgumentError, match="use --bf16, not --fp16"):
        hpu_args(tmp_path, use_lazy_mode=True, use_hpu_graphs_for_training=True, fp16=True)


# ---- 3. the launcher sets PT_HPU_LAZY_MODE only from what the user asked for -----------------------------------


def test_launch_environment_leaves_lazy_mode_to_the_user(bridge, tmp_path):
    from optimum_gaudi.launch.environment import launch_environment
    from optimum_gaudi.precision.op_lists import BF16_LIST_ENV

    assert "PT_HPU_LAZY_MODE" not in launch_environment(["--output_dir", "out"], environ={})  # not forced to "0"
    assert launch_environment(["--use_lazy_mode"], environ={})["PT_HPU_LAZY_MODE"] == "1"
    assert launch_environment(["--use_lazy_mode", "false"], environ={})["PT_HPU_LAZY_MODE"] == "0"
    assert "PT_HPU_LAZY_MODE" not in launch_environment([], environ={"PT_HPU_LAZY_MODE": "1"})  # exported: kept
    arguments = tmp_path / "args.json"  # HfArgumentParser.parse_json_file scripts take one .json argument
    arguments.write_text('{"output_dir": "out", "use_lazy_mode": true, "gaudi_config_name": "gpt2"}')
    env = launch_environment([str(arguments)], environ={})
    assert env["PT_HPU_LAZY_MODE"] == "1" and BF16_LIST_ENV in env
    with pytest.raises(ValueError, match="PT_HPU_LAZY_MODE=0 is exported"):
        launch_environment([str(arguments)], environ={"PT_HPU_LAZY_MODE": "0"})


def test_launch_refuses_an_exported_lazy_mode_the_arguments_contradict(bridge, tmp_path, monkeypatch, capsys):
    from optimum_gaudi.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    assert main(["launch", "--dry_run", str(script), "--use_lazy_mode"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: PT_HPU_LAZY_MODE=0 is exported")


# ---- 5. the accelerate floor: the first release transformers runs a Gaudi with ----------------------------------


def test_setup_requires_the_accelerate_release_transformers_needs_for_a_gaudi():
    """Below it transformers' is_torch_hpu_available() answers False (HPU support came in accelerate 1.5.0):
    the model stays on the CPU while the bridge runs."""
    import inspect
    import re

    from packaging.version import Version
    from transformers.utils import import_utils

    source = inspect.getsource(import_utils.is_torch_hpu_available)
    needed = re.search(r'torch_hpu_min_accelerate_version = "([\d.]+)"', source).group(1)
    setup = (REPO / "setup.py").read_text()
    floor = re.search(r'"accelerate>=([\d.]+)"', setup).group(1)
    assert Version(floor) >= Version(needed)


# ---- 9. op names: the running torch's aten ops, not a code-generator fixture of an older torch --------------


def test_op_names_of_the_running_torch_are_accepted_and_a_typo_is_not(caplog, monkeypatch):
    """rms_norm (aten since torch 2.4) was reported as casting nothing on any device; it is an aten op the
    bridge of a torch that has it registers for autocast (``scripts/gen_op.py``), and CPU and CUDA cast it too."""
    import logging

    from optimum_gaudi.precision import op_lists

    monkeypatch.setattr(op_lists, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        op_lists.resolve_op_lists(["rms_norm", "scaled_dot_product_attention", "linear"], ["softmax"])
    assert not [r for r in caplog.records if "Autocast op" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        op_lists.resolve_op_lists(["rms_nrom"], None)
    (warning,) = [r.getMessage() for r in caplog.records if "rms_nrom" in r.getMessage()]
    assert "did you mean 'rms_norm'?" in warning
    assert {"truediv", "cross_entropy_loss"} <= op_lists.KNOWN_OPS  # Habana's default lists stay valid
    assert not {"add_", "mm_out", "cudnn_convolution", "native_layer_norm_backward"} & op_lists.KNOWN_OPS


# ---- 10. generation under an inference graph: decoding steps are not replayed ----------------------------------


@pytest.mark.parametrize("make_model", [tiny_t5, tiny_decoder_only], ids=["t5", "llama"])
def test_decoding_under_an_inference_graph_scores_as_without_it(make_model, bridge, tmp_path):
    """A replay runs the device ops of its capture and none of the forward's Python. T5's first decoding step
    (its decoder input has the shape of every later one) fills the static cross-attention cache and flags it
    done, in Python; replayed for the second step, it filled the cache again (on CPU tensors past its end)."""
    args = hpu_args(tmp_path, use_lazy_mode=True)  # loads the bridge in lazy mode, where graphs exist
    device = args.gaudi_device
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(4, 40, (2, 6), generator=g).to(args.device) for _ in range(2)]

    def scores(model):
        model.to(args.device).eval()
        generate = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", output_scores=True)
        return [
            torch.stack(model.generate(input_ids=ids, return_dict_in_generate=True, **generate).scores).cpu()
            for ids in batches
        ]

    reference = scores(make_model())
    graphed = scores(device.wrap_for_inference(make_model(), disable_tensor_cache=False))
    assert all(torch.equal(a, b) for a, b in zip(graphed, reference, strict=True))


# ---- 11. FusedAdamW counts steps per param group, torch's AdamW per parameter ---------------------------------


def _optimizer_after_steps(trainer, steps):
    optimizer = trainer.create_optimizer()
    for _ in range(steps):
        trainer.model.zero_grad()
        trainer.model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
    return optimizer


def _trainer(tmp_path, name, fused):
    torch.manual_seed(0)
    args = hpu_args(tmp_path / name, use_habana=fused, weight_decay=0.1)
    return GaudiTrainer(model=torch.nn.Linear(3, 2), args=args, gaudi_config={"use_fused_adam": fused})


def test_a_fused_adamw_checkpoint_resumes_on_torch_adamw_with_its_step_count_and_back(bridge, tmp_path, caplog):
    """hpex/optimizers/FusedAdamW.py keeps group["step"] and leaves state["step"] at 0: loaded as it is, torch's
    AdamW restarted its bias correction at step 1 (and FusedAdamW from a torch checkpoint likewise)."""
    fused = _optimizer_after_steps(_trainer(tmp_path, "gaudi", fused=True), 3)
    assert type(fused).__name__ == "FusedAdamW" and fused.param_groups[0]["step"] == 3
    plain = _trainer(tmp_path, "cpu", fused=False).create_optimizer()
    assert isinstance(plain, torch.optim.AdamW)
    plain.load_state_dict(fused.state_dict())
    assert {float(s["step"]) for s in plain.state.values()} == {3.0}
    assert "step" not in plain.param_groups[0]
    assert "moved to where AdamW keeps it" in caplog.text

    torch_state = _optimizer_after_steps(_trainer(tmp_path, "cpu2", fused=False), 5).state_dict()
    fused_again = _trainer(tmp_path, "gaudi2", fused=True).create_optimizer()
    fused_again.load_state_dict(torch_state)
    assert fused_again.param_groups[0]["step"] == 5


# ---- 11. training again after evaluate() under DDP: the inference graph comes off the model --------------------


def test_a_second_train_under_ddp_takes_the_inference_graph_off_the_model(bridge, tmp_path, monkeypatch):
    """transformers hands _wrap_model the DDP wrapper of the first train() (model_wrapped); the graph was put on
    the model inside it by evaluate(), and stayed: the next training forwards replayed an inference graph."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rows = [{"input_ids": [i % 50 + 1] * 8, "labels": i % 3} for i in range(8)]
    args = hpu_args(tmp_path, use_lazy_mode=True, use_hpu_graphs_for_inference=True)
    trainer = GaudiTrainer(model=tiny_classifier(), args=args)
    own_forward = trainer.model.forward
    trainer.evaluate(rows)
    assert trainer.model.forward != own_forward  # the inference graph's forward
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    on_device = next(trainer.model.parameters()).device.type == "hpu"  # the simulated device: hccl as on a Gaudi
    dist.init_process_group("hccl" if on_device else "gloo", rank=0, world_size=1)
    try:
        trainer._wrap_model(DistributedDataParallel(trainer.model), training=True)
    finally:
        dist.destroy_process_group()
    assert trainer.model.forward == own_forward


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 11. unused parameters under training graphs: no gradient, as in eager training ---------------------------


class WithUnusedHead(torch.nn.Module):
    """A causal LM with a trainable head its forward never uses (as an unused pooler or a LayerDrop layer)."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.unused_head = lm, torch.nn.Linear(8, 8)

    def forward(self, input_ids, labels=None):
        return self.lm(input_ids=input_ids, labels=labels)


def test_a_parameter_the_forward_does_not_use_is_not_decayed_under_training_graphs(
    bridge, tmp_path, tiny_gpt2, tiny_lm_data
):
    """The bridge's training graphs give it a zero gradient every step (materialize_grads): AdamW's weight decay
    then shrank it, where eager training (CPU, CUDA, a Gaudi without graphs) leaves it alone."""

    def trained(**flags):
        torch.manual_seed(0)
        model = WithUnusedHead(tiny_gpt2())
        args = hpu_args(tmp_path / str(len(flags)), weight_decay=0.1, learning_rate=0.05, **flags)
        GaudiTrainer(model=model, args=args, train_dataset=tiny_lm_data).train()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    eager = trained(use_lazy_mode=True)
    graphs = trained(use_lazy_mode=True, use_hpu_graphs_for_training=True)
    assert bridge().calls_named("hpu.ModuleCacher.forward", cached=True)
    torch.manual_seed(0)
    initial = WithUnusedHead(tiny_gpt2()).unused_head.weight
    assert torch.equal(eager["unused_head.weight"], initial)
    assert torch.equal(graphs["unused_head.weight"], initial)
    assert all(torch.equal(graphs[name], eager[name]) for name in eager)


# ---- the simulator, round 3: the bridge registers hpu_backend only when it loads in eager mode ----------------


@pytest.mark.parametrize("gaudi_software", ["1.19", "1.21"], indirect=True)
def test_torch_compile_in_lazy_mode_is_one_line(bridge, gaudi_software, tmp_path, monkeypatch):
    """``core/__init__.py`` imports ``dynamo.compile_backend`` (which registers hpu_backend) only outside lazy
    mode, so a lazy-mode run could not compile: the arguments already refuse the pair in one line."""
    from optimum_gaudi import GaudiArgumentError

    with pytest.raises(GaudiArgumentError, match="--torch_compile needs eager mode; drop --use_lazy_mode"):
        hpu_args(tmp_path, use_lazy_mode=True, torch_compile=True)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    import habana_frameworks.torch.core  # noqa: F401

    assert "hpu_backend" not in torch._dynamo.list_backends(exclude_tags=())
    bridge().unload()  # the same bridge loaded eager registers it
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    import habana_frameworks.torch.core  # noqa: F401, F811

    assert "hpu_backend" in torch._dynamo.list_backends(exclude_tags=())


def test_fused_adamw_cuts_its_step_into_graphs_in_lazy_mode(bridge, tmp_path):
    """``hpex/optimizers/FusedAdamW.py``: a mark_step at each param group's update and after the step (lazy only);
    the trainer's own mark_steps (after backward, after the optimizer step) stay as they were."""
    trainer = GaudiTrainer(
        model=tiny_classifier(), args=hpu_args(tmp_path, use_lazy_mode=True, gaudi_config_name="gpt2"),
        train_dataset=[{"input_ids": [i + 1] * 8, "labels": i % 3} for i in range(8)],
    )  # fmt: skip
    trainer.train()
    names = bridge().names()
    groups = len(trainer.optimizer.param_groups)
    assert names.count("hpex.optimizers.FusedAdamW.mark_step") == 2 * (groups + 1)
    assert names.count("core.mark_step") == 2 * 2


def test_an_exported_tensor_cache_setting_wins_over_the_argument_and_is_said(bridge, tmp_path, monkeypatch, caplog):
    """``hpu/graphs.py`` reads PT_HPUGRAPH_DISABLE_TENSOR_CACHE over the argument, as the bridge reads
    PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES over the config: one line says which decides."""
    monkeypatch.setenv("PT_HPUGRAPH_DISABLE_TENSOR_CACHE", "1")
    args = hpu_args(tmp_path, use_lazy_mode=True, use_hpu_graphs_for_inference=True)
    data = [{"input_ids": [i + 1] * 8, "labels": i % 3} for i in range(8)]
    with caplog.at_level("WARNING"):
        GaudiTrainer(model=tiny_classifier(), args=args).evaluate(data)
    assert bridge().calls_named("hpu.wrap_in_hpu_graph")[0].kwargs["disable_tensor_cache"] is True
    said = [r.message for r in caplog.records if "PT_HPUGRAPH_DISABLE_TENSOR_CACHE=1" in r.message]
    assert len(said) == 1 and "--disable_tensor_cache_hpu_graphs" in said[0]


def test_dynamic_shapes_reach_the_backwards_thread_in_lazy_mode(bridge, tmp_path, monkeypatch):
    """``backend/helpers/dynamic_shape_info.cpp``: in lazy mode the flag is per thread, each starting from
    PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES as the bridge read it; enable_dynamic_shape() from the main thread left
    the autograd engine's device thread (the backward) without dynamic shapes."""
    import json
    import threading

    monkeypatch.delenv("PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", raising=False)
    config = tmp_path / "gaudi_config.json"
    config.write_text(json.dumps({"use_fused_adam": False, "use_dynamic_shapes": True}))
    args = hpu_args(tmp_path, use_lazy_mode=True, gaudi_config_name=str(config))
    GaudiTrainer(model=tiny_classifier(), args=args)
    import habana_frameworks.torch.hpu as hthpu

    seen = []
    worker = threading.Thread(target=lambda: seen.append(hthpu.get_dynamic_shape_status()))
    worker.start()
    worker.join()
    assert hthpu.get_dynamic_shape_status() and seen == [True]


def test_the_bridges_profiler_takes_its_own_fixed_arguments(bridge, tmp_path):
    """``activity_profiler.py`` replaces torch.profiler.profile with a class of fixed keyword-only arguments: one
    torch added later (``acc_events``) is a TypeError there, so the profiling feature passes none of them."""
    args = hpu_args(tmp_path, use_lazy_mode=True, profiling_steps=1, profiling_warmup_steps=0)
    import habana_frameworks.torch  # noqa: F401  (loaded by the arguments; patches torch.profiler.profile)

    with pytest.raises(TypeError):
        torch.profiler.profile(acc_events=True)
    data = [{"input_ids": [i + 1] * 8, "labels": i % 3} for i in range(8)]
    GaudiTrainer(model=tiny_classifier(), args=args, train_dataset=data).train()
    assert bridge().calls_named("activity_profiler.profile")


@pytest.mark.parametrize("value", ["1", "true"])
def test_the_bridges_markstep_adam_swap_cuts_torch_adamw_per_group_and_changes_no_loss(
    bridge, tmp_path, monkeypatch, value
):
    """``torch/__init__.py`` ``overwrite_torch_optimizers``: PT_HPU_REPLACE_ADAM_ADAMW puts MarkstepAdam(W)'s step in
    torch's Adam and AdamW, two mark_steps per param group; the trainer's torch AdamW (no fused AdamW) takes it
    and trains to the same losses and weights."""
    data = [{"input_ids": [i + 1] * 8, "labels": i % 3} for i in range(8)]

    def run(directory):
        model = tiny_classifier()
        trainer = GaudiTrainer(model=model, args=hpu_args(directory, use_lazy_mode=True), train_dataset=data)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer, losses, [p.detach().cpu().clone() for p in model.parameters()]

    _, reference, reference_weights = run(tmp_path / "torch")
    bridge().unload()
    monkeypatch.setenv("PT_HPU_REPLACE_ADAM_ADAMW", value)
    marks_before = bridge().names().count("core.mark_step")  # the log outlives an unload: count the second run's
    trainer, losses, weights = run(tmp_path / "markstep")
    assert inspect.unwrap(type(trainer.optimizer.optimizer).step).bridge_markstep
    groups = len(trainer.optimizer.param_groups)
    trainer_marks = 2 * 2  # after backward and after the optimizer step, 2 steps
    assert bridge().names().count("core.mark_step") - marks_before == trainer_marks + 2 * 2 * groups
    assert losses == reference and all(torch.equal(a, b) for a, b in zip(weights, reference_weights, strict=True))


# ---- each fix matters: tests/scripts/without_the_fixes.py -------------------------------------------------------


def test_each_fix_the_undo_script_takes_out_is_still_where_it_names_it():
    """The script undoes each fix of this issue and runs its test, which must then fail (by hand: it edits the work
    tree, and takes a few minutes). Here only that each fix's text and each test it names are still there."""
    import runpy

    script = runpy.run_path(str(SCRIPTS / "without_the_fixes.py"))
    assert {undo.point for undo in script["UNDOS"]} >= {str(point) for point in range(1, 12)}
    for undo in script["UNDOS"]:
        for file, fixed, _ in undo.edits:
            assert (script["REPO"] / file).read_text().count(fixed) == 1, (undo.label, file)
        for test in undo.tests:
            file, _, name = test.partition("::")
            name = name.partition("[")[0]  # a parametrized test's function
            assert not name or f"def {name}(" in (script["TESTS"] / file).read_text(), (undo.label, test)
