"""The HPU path against the strict simulator (tests/fakes, a test double): one test per defect of issue 8.

Each defect was found by reading the real bridge (HabanaAI/gaudi-pytorch-bridge); the simulator models
the behaviour involved, so each of these tests failed before its fix.

The defects that need a fresh process: tests/integration/devices/test_hpu_strict_bridge_processes.py."""

import dataclasses
import json
import logging
import os
import sys

import pytest
import torch
from conftest import FALLBACK_DEVICE, GAUDI_SOFTWARE

from optimum_gaudi import GaudiArgumentError, GaudiConfig, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import HPUDevice

GRAPH_FORWARD = "hpu.wrap_in_hpu_graph.forward"  # the simulator's record of each graph-wrapped forward
BOTH = pytest.mark.parametrize("gaudi_software", GAUDI_SOFTWARE, indirect=True)


def hpu_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), use_habana=True, max_steps=2, logging_steps=1, report_to=[])
    defaults.update(save_strategy="no", per_device_train_batch_size=4, per_device_eval_batch_size=4)
    return GaudiTrainingArguments(**{**defaults, **kwargs})


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ---- 2. ask the bridge which mode it is in -------------------------------------------------------------------


@pytest.mark.parametrize(
    "gaudi_software, lazy_flag, advice",
    [("1.21", True, "PT_HPU_LAZY_MODE=1"), ("1.19", False, "PT_HPU_LAZY_MODE=0")],
    indirect=["gaudi_software"],
)
def test_bridge_loaded_in_the_other_mode_is_a_clear_error(bridge, tmp_path, gaudi_software, lazy_flag, advice):
    import habana_frameworks.torch  # noqa: F401  (autoload, or a script importing it: the generation's default)

    with pytest.raises(GaudiArgumentError) as excinfo:
        hpu_args(tmp_path, use_lazy_mode=lazy_flag)
    assert advice in one_line(excinfo)


# ---- 3. no inference graph on the model being trained; bounded eval graphs -----------------------------------


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_evaluation_during_training_does_not_graph_the_training_model(
    bridge, tmp_path, tiny_gpt2, tiny_lm_data, caplog
):
    common = dict(use_lazy_mode=True, max_steps=4, eval_strategy="steps", eval_steps=1, seed=0)
    common.update(use_hpu_graphs_for_training=True)
    plain = GaudiTrainer(
        model=tiny_gpt2(), args=hpu_args(tmp_path / "a", **common), train_dataset=tiny_lm_data,
        eval_dataset=tiny_lm_data[:8],
    )  # fmt: skip
    plain.train()
    graphed = GaudiTrainer(
        model=tiny_gpt2(), args=hpu_args(tmp_path / "b", use_hpu_graphs_for_inference=True, **common),
        train_dataset=tiny_lm_data, eval_dataset=tiny_lm_data[:8],
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        graphed.train()
    assert losses(graphed) == pytest.approx(losses(plain), abs=1e-6)
    assert caplog.text.count("Evaluations during training run without HPU Graphs") == 1
    graphed.evaluate()
    graphed.evaluate()  # after training: the inference graph is captured, then replayed
    names = bridge().names()
    assert names.count("hpu.wrap_in_hpu_graph") == 1 and bridge().calls_named(GRAPH_FORWARD, mode="replay")
    bridge().reset()
    graphed.train()  # training again: the model's forward is its own again, no replay in training
    assert not bridge().calls_named(GRAPH_FORWARD, training=True)
    assert all(loss == loss for loss in losses(graphed))


def test_evaluation_graphs_are_bounded(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    args = hpu_args(tmp_path, use_lazy_mode=True, use_hpu_graphs_for_inference=True, max_hpu_graphs=3)
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args)
    for length in range(4, 9):  # five evaluation shapes
        trainer.evaluate([{"input_ids": list(range(length)), "labels": list(range(length))}] * 4)
    (wrap,) = bridge().calls_named("hpu.wrap_in_hpu_graph")
    assert wrap.kwargs["max_graphs"] == 3
    assert len(bridge().calls_named(GRAPH_FORWARD, mode="capture")) == 3


# ---- 4. ModuleCacher: honest default, fast_ddp compatible ----------------------------------------------------
def test_max_hpu_graphs_default_is_the_bridge_default_and_said_so(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    from transformers import HfArgumentParser

    help_text = HfArgumentParser(GaudiTrainingArguments).format_help()
    assert "no limit" not in help_text
    args = hpu_args(tmp_path, use_lazy_mode=True, use_hpu_graphs_for_training=True)
    GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data).train()
    (cacher,) = bridge().calls_named("hpu.ModuleCacher")
    assert cacher.kwargs["max_graphs"] == 10 == args.max_hpu_graphs


def test_fast_ddp_with_hpu_graphs_graphs_the_inner_model(bridge, tmp_path, tiny_gpt2, tiny_lm_data, monkeypatch):
    from optimum_gaudi.distributed import fast_ddp

    monkeypatch.setattr(fast_ddp, "broadcast_parameters", lambda model: None)
    monkeypatch.setattr(fast_ddp.FusedGradientAllReduce, "__init__", lambda self, params, dtype=None: None)
    monkeypatch.setattr("optimum_gaudi.preparation.pipeline.broadcast_parameters", lambda model: None)
    args = hpu_args(tmp_path, use_lazy_mode=True, use_hpu_graphs_for_training=True, distribution_strategy="fast_ddp")
    args.parallel_layout = dataclasses.replace(args.parallel_layout, fast_ddp=True)  # as on several processes
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data)
    model = trainer._wrap_model(trainer.model, training=True)  # ModuleCacher asserts on a forward(*args)
    assert isinstance(model, fast_ddp.FastDDPModel)
    assert "hpu.ModuleCacher.__call__" in bridge().names()


def test_a_parameter_unused_in_the_forward_trains_with_hpu_graphs(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    model = tiny_gpt2()
    model.unused_pooler = torch.nn.Linear(2, 2)  # trainable, never called (LayerDrop, an unused pooler)
    args = hpu_args(tmp_path, use_lazy_mode=True, use_hpu_graphs_for_training=True)
    GaudiTrainer(model=model, args=args, train_dataset=tiny_lm_data).train()
    assert bridge().calls_named("hpu.ModuleCacher.capture")


@BOTH
def test_op_lists_of_a_config_given_to_the_trainer_are_checked_against_the_bridge(
    bridge, tmp_path, tiny_gpt2, tiny_lm_data, caplog, monkeypatch
):
    from optimum_gaudi.devices import hpu

    monkeypatch.setattr(hpu, "_warned", set())
    args = hpu_args(tmp_path, use_lazy_mode=True, max_steps=1)  # no config: the bridge loads Habana's lists
    config = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["mm"], autocast_fp32_ops=["softmax"])
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data, gaudi_config=config).train()
    lower, fp32 = bridge().autocast_lists
    assert set(lower) != {"mm"} and set(fp32) != {"softmax"}  # the bridge kept its own lists...
    warned = [r.getMessage() for r in caplog.records if "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST=" in r.getMessage()]
    assert len(warned) == 1  # ...and the user is told, once, how to give it the config's


# ---- 5. graph API in eager mode ------------------------------------------------------------------------------
def test_graph_api_runs_on_an_eager_gaudi(bridge, caplog):
    import habana_frameworks.torch  # noqa: F401  (1.21: eager, the graph API is not exported)

    from optimum_gaudi.features import graphs

    device = HPUDevice()
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        assert graphs.cache_module(model, device=device) is model
        assert graphs.wrap_in_graph(model, device=device) is model
        graph = graphs.Graph(device)
        static_in = torch.randn(1, 2)
        with torch.no_grad():
            out = graph.capture(model, static_in)
            static_in.copy_(torch.ones(1, 2))
            assert torch.allclose(graph.replay(), model(torch.ones(1, 2))) and graph.outputs is out
    assert "lazy mode" in caplog.text


# ---- 6. profiler activities survive the bridge's enum replacement ----------------------------------------------


@BOTH
def test_profiler_default_activities_record_on_the_gaudi_path(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    from optimum_gaudi.features.profiling import GaudiProfilerCallback

    callback = GaudiProfilerCallback(warmup_steps=0, active_steps=1, output_dir=tmp_path)  # before the bridge
    args = hpu_args(tmp_path, max_steps=1)  # loads the bridge, which swaps torch's enum
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data, callbacks=[callback])
    trainer.train()
    trace = json.loads((tmp_path / "profile_rank0.pt.trace.json").read_text())
    assert any(e.get("name") == "ProfilerStep#0" for e in trace["traceEvents"])


# ---- 7. op lists: aten names, left-out list = Habana's default, same on every device ------------------------


@BOTH
def test_a_bf16_only_config_means_habanas_fp32_list_on_hpu_and_cpu(bridge, tmp_path, monkeypatch):
    from optimum_gaudi.devices import CPUDevice
    from optimum_gaudi.precision.op_lists import HABANA_DEFAULT_FP32_OPS

    config = tmp_path / "bf16_only.json"
    config.write_text(json.dumps({"use_torch_autocast": True, "autocast_bf16_ops": ["linear", "matmul"]}))
    seen = {}
    monkeypatch.setattr(CPUDevice, "autocast_factory", lambda self, b, f: seen.setdefault("cpu", (b, f)))
    args = hpu_args(tmp_path, gaudi_config_name=str(config))
    GaudiTrainer(model=torch.nn.Linear(2, 2), args=args)
    lower, fp32 = bridge().autocast_lists
    assert lower == {"linear", "matmul"} and fp32 == set(HABANA_DEFAULT_FP32_OPS)
    cpu_args = GaudiTrainingArguments(
        output_dir=str(tmp_path / "cpu"), use_cpu=True, gaudi_config_name=str(config), report_to=[]
    )
    GaudiTrainer(model=torch.nn.Linear(2, 2), args=cpu_args)
    assert (set(seen["cpu"][0]), set(seen["cpu"][1])) == (lower, fp32)


def test_every_bundled_config_uses_known_op_names():
    from optimum_gaudi.configuration.gaudi_config import bundled_configs_dir
    from optimum_gaudi.precision.op_lists import KNOWN_OPS

    for path in sorted(bundled_configs_dir().glob("*.json")):
        config = GaudiConfig.from_json_file(path)
        for op in (config.autocast_bf16_ops or []) + (config.autocast_fp32_ops or []):
            assert op in KNOWN_OPS, f"{path.name}: {op}"


def test_an_unknown_op_name_warns_once_with_the_closest_known_op(caplog):
    from optimum_gaudi.precision.op_lists import resolve_op_lists

    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        for _ in range(3):
            resolve_op_lists(["linear"], ["cross_entropy"])
    warnings = [r.getMessage() for r in caplog.records if "cross_entropy" in r.getMessage()]
    assert len(warnings) == 1 and "cross_entropy_loss" in warnings[0]


def test_op_list_warnings_on_cpu_are_said_once_not_every_step(tmp_path, tiny_gpt2, tiny_lm_data, caplog):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, gaudi_config_name="gpt2", max_steps=3, report_to=[], save_strategy="no"
    )
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data).train()
    about_ops = [
        r for r in caplog.records if r.name in ("optimum_gaudi.precision.autocast", "optimum_gaudi.precision.op_lists")
    ]
    assert len(about_ops) <= 2  # at most one line from each module, whatever the number of steps


# ---- 8. bridge built for another torch -----------------------------------------------------------------------
def test_bridge_for_another_torch_is_a_clear_line_not_a_crash(bridge, monkeypatch, caplog):
    from optimum_gaudi.devices import hpu_available

    monkeypatch.setenv("FAKE_HPU_BUILT_FOR_TORCH", "2.5")
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        assert hpu_available() is False
    lines = [r.getMessage() for r in caplog.records if "2.5" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "torch" in lines[0]


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [("FAKE_HPU_STOCK_TORCH", "untagged", "AttributeError"), ("FAKE_HPU_PLUGIN_MISSING", "1", "OSError")],
)
def test_a_bridge_that_fails_to_load_falls_back_with_one_line(bridge, monkeypatch, caplog, variable, value, error):
    from optimum_gaudi.devices import detect_device, unavailable_reason

    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        assert detect_device(use_habana=True).type == FALLBACK_DEVICE
    assert error in unavailable_reason()
    lines = [r.getMessage() for r in caplog.records if "cannot load" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]


# ---- 9. FusedClipNorm built once, a scalar norm like torch's -------------------------------------------------
def test_fused_clip_norm_is_built_once_and_returns_torchs_norm(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    config = GaudiConfig(use_fused_clip_norm=True)
    trainer = GaudiTrainer(
        model=tiny_gpt2(), args=hpu_args(tmp_path, max_steps=3), train_dataset=tiny_lm_data, gaudi_config=config
    )
    trainer.train()
    assert len(bridge().calls_named("hpex.normalization.FusedClipNorm")) == 1
    assert len(bridge().calls_named("hpex.normalization.FusedClipNorm.clip_norm")) == 3
    model = trainer.model
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    norm = trainer._clip_grad_norm(model)
    assert norm.shape == () and norm.dtype == torch.float32


def test_fused_clip_norm_clips_a_parameter_frozen_when_it_was_built(bridge):
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    clip = HPUDevice().grad_clipper(model.parameters(), max_norm=1.0)
    model.bias.requires_grad_(True)  # unfrozen after the clipper was built (a later training phase)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    norm = clip()
    torch.testing.assert_close(norm, torch.tensor(54.0).sqrt())  # 4 weight + 2 bias gradients of 3
    assert float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()) == pytest.approx(1.0, abs=1e-4)


# ---- 10. use_dynamic_shapes reaches the bridge -----------------------------------------------------------------


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_shapes_follow_the_config(bridge, tmp_path, tiny_gpt2, dynamic, monkeypatch):
    monkeypatch.delenv(
        "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", raising=False
    )  # exported, it decides (test_hpu_user_settings)
    GaudiTrainer(model=tiny_gpt2(), args=hpu_args(tmp_path), gaudi_config=GaudiConfig(use_dynamic_shapes=dynamic))
    import habana_frameworks.torch.hpu as hthpu

    assert hthpu.get_dynamic_shape_status() is dynamic
    assert bridge().calls_named("hpu.enable_dynamic_shape" if dynamic else "hpu.disable_dynamic_shape")


# ---- 11. peak memory is the run's, not the process's ---------------------------------------------------------
def test_peak_memory_is_reset_when_training_starts(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    trainer = GaudiTrainer(model=tiny_gpt2(), args=hpu_args(tmp_path, max_steps=1), train_dataset=tiny_lm_data)
    spike = torch.ones(96 * 1024 * 1024 // 4)  # 96 MiB touched, then freed: the process peak, not the run's
    peak_before = HPUDevice().memory_stats()["max_memory_allocated (GB)"]
    del spike
    bridge().reset()
    trainer.train()
    names = bridge().names()
    assert names.index("hpu.reset_peak_memory_stats") < names.index("hpu.memory_stats")
    logged = [h["max_memory_allocated (GB)"] for h in trainer.state.log_history if "max_memory_allocated (GB)" in h]
    assert logged and logged[0] < peak_before


# ---- 12. mark_step is a no-op in eager mode: the trainer never relies on it there ----------------------------


@BOTH
def test_eager_runs_make_no_mark_step_and_lazy_runs_make_effective_ones(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    for lazy in (False, True):
        if "habana_frameworks.torch" in sys.modules:
            bridge().unload()
        os.environ.pop("PT_HPU_LAZY_MODE", None)
        trainer = GaudiTrainer(
            model=tiny_gpt2(), args=hpu_args(tmp_path / str(lazy), use_lazy_mode=lazy), train_dataset=tiny_lm_data
        )
        bridge().reset()
        trainer.train()
        names = bridge().names()
        assert "core.mark_step.noop" not in names
        assert (names.count("core.mark_step") == 4) is lazy


@BOTH
def test_a_lazy_run_never_meets_an_eager_bridge(bridge, tmp_path, tiny_gpt2, tiny_lm_data, gaudi_software):
    import habana_frameworks.torch  # noqa: F401  (the generation's default: 1.21 autoloads an eager bridge)

    if gaudi_software == "1.21":  # the "lazy" run would silently run eager (mark_step a no-op): refused
        with pytest.raises(GaudiArgumentError, match="PT_HPU_LAZY_MODE=1"):
            hpu_args(tmp_path, use_lazy_mode=True)
        return
    GaudiTrainer(model=tiny_gpt2(), args=hpu_args(tmp_path, use_lazy_mode=True), train_dataset=tiny_lm_data).train()
    names = bridge().names()
    assert "core.mark_step" in names and "core.mark_step.noop" not in names


# ---- 13. inference graphs replay into the same output tensors: predictions must not alias them ---------------
def test_predictions_with_inference_graphs_equal_those_without(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    def predict(graphs):
        args = hpu_args(tmp_path / str(graphs), use_lazy_mode=True, use_hpu_graphs_for_inference=graphs)
        return GaudiTrainer(model=tiny_gpt2(), args=args).predict(tiny_lm_data[:12])  # three same-shape batches

    plain, graphed = predict(False), predict(True)
    assert len(bridge().calls_named(GRAPH_FORWARD, mode="replay")) == 2
    assert graphed.predictions == pytest.approx(plain.predictions, abs=1e-6)
    assert graphed.metrics["test_loss"] == pytest.approx(plain.metrics["test_loss"], abs=1e-6)
