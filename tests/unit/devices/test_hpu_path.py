"""The HPU path end to end, on the simulated bridge in tests/fakes (a test double: no Gaudi here)."""

import json
import sys
from pathlib import Path

import pytest

from optimum_gaudi import GaudiArgumentError, GaudiConfig, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import HPUDevice


def hpu_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), use_habana=True, max_steps=2, logging_steps=1, report_to=[])
    defaults.update(save_strategy="no", per_device_train_batch_size=4, per_device_eval_batch_size=4)
    return GaudiTrainingArguments(**{**defaults, **kwargs})


def run(tmp_path, model, data, bridge, **kwargs):
    args = hpu_args(tmp_path, **kwargs)
    assert isinstance(args.gaudi_device, HPUDevice)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8])
    bridge().reset()
    trainer.train()
    train_calls = list(bridge().calls)
    bridge().reset()
    trainer.evaluate()
    return trainer, train_calls, list(bridge().calls)


def names(calls):
    return [c.name for c in calls]


def named(calls, name):
    return [c for c in calls if c.name == name]


def test_environment_is_set_before_the_bridge_is_imported(bridge, tmp_path):
    assert "habana_frameworks.torch" not in sys.modules
    hpu_args(tmp_path, use_lazy_mode=True, gaudi_config_name="gpt2")
    env = bridge().env_at_import
    assert env["PT_HPU_LAZY_MODE"] == "1"
    config = GaudiConfig.from_pretrained("gpt2")
    assert Path(env["PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"]).read_text().split() == config.autocast_bf16_ops
    assert Path(env["PT_HPU_AUTOCAST_FP32_OPS_LIST"]).read_text().split() == config.autocast_fp32_ops


def test_lazy_mode_full_gaudi_path(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    trainer, train_calls, eval_calls = run(
        tmp_path, tiny_gpt2(), tiny_lm_data, bridge,
        use_lazy_mode=True, pipelining_fwd_bwd=True, gaudi_config_name="gpt2",
        use_hpu_graphs_for_training=True, max_hpu_graphs=7,
        use_hpu_graphs_for_inference=True, disable_tensor_cache_hpu_graphs=True,
    )  # fmt: skip
    # one training step, in order: forward (graph-cached), mark_step after forward (pipelining),
    # mark_step after backward, fused clip, fused AdamW step (its own mark_step per param group and after
    # the update), mark_step after the optimizer step
    groups = len(trainer.optimizer.param_groups)
    step = [
        "hpu.ModuleCacher.forward",
        "core.mark_step",
        "core.mark_step",
        "hpex.normalization.FusedClipNorm.clip_norm",
        "hpex.optimizers.FusedAdamW.step",
        *["hpex.optimizers.FusedAdamW.mark_step"] * (groups + 1),
        "core.mark_step",
    ]
    # hpu.mem_get_info: the card's memory, for the run's plan before step 1 (trainers/plan_check.py)
    setup = ("hpu.memory_stats", "hpu.mem_get_info", "hpu.ModuleCacher.capture", "hpex.normalization.FusedClipNorm")
    body = [c for c in names(train_calls) if c not in setup]
    first_step = body.index("hpu.ModuleCacher.forward")
    assert body[first_step:] == step * 2
    assert body[:first_step] == [
        "hpex.optimizers.FusedAdamW",
        "hpu.ModuleCacher",
        "hpu.ModuleCacher.__call__",
        "hpu.reset_peak_memory_stats",
        "hpu.random.get_rng_state",  # one eager forward finds unused parameters, the generators put back
        "hpu.random.set_rng_state",
    ]
    assert names(train_calls).count("hpex.normalization.FusedClipNorm") == 1  # built once, at the first clip
    assert "hpu.wrap_in_hpu_graph" in names(eval_calls) and "core.mark_step" in names(eval_calls)


def test_graph_and_optimizer_arguments_reach_the_bridge(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    trainer, calls, _ = run(
        tmp_path, tiny_gpt2(), tiny_lm_data, bridge,
        use_lazy_mode=True, gaudi_config_name="gpt2", adam_epsilon=1e-6,
        use_hpu_graphs_for_training=True, max_hpu_graphs=7,
        use_hpu_graphs_for_inference=True, disable_tensor_cache_hpu_graphs=True,
    )  # fmt: skip
    (cacher,) = named(calls, "hpu.ModuleCacher")
    assert cacher.kwargs["max_graphs"] == 7
    (wrap_call,) = named(calls, "hpu.ModuleCacher.__call__")
    assert wrap_call.kwargs["inplace"] is True
    (adamw,) = named(calls, "hpex.optimizers.FusedAdamW")
    assert adamw.kwargs["eps"] == 1e-6 and adamw.kwargs["lr"] == trainer.args.learning_rate
    assert any(h.get("total_memory_available (GB)") for h in trainer.state.log_history)


def test_inference_graph_gets_the_tensor_cache_flag(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    args = hpu_args(
        tmp_path, use_lazy_mode=True, use_hpu_graphs_for_inference=True, disable_tensor_cache_hpu_graphs=True
    )
    GaudiTrainer(model=tiny_gpt2(), args=args, eval_dataset=tiny_lm_data[:8]).evaluate()
    (wrap,) = bridge().calls_named("hpu.wrap_in_hpu_graph")
    assert wrap.kwargs["disable_tensor_cache"] is True


def test_eager_mode_makes_no_mark_step(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    _, train_calls, eval_calls = run(tmp_path, tiny_gpt2(), tiny_lm_data, bridge, gaudi_config_name="gpt2")
    assert bridge().env_at_import["PT_HPU_LAZY_MODE"] == "0"
    assert "core.mark_step" not in names(train_calls + eval_calls)
    assert "hpex.optimizers.FusedAdamW.step" in names(train_calls)


def test_fused_features_off_use_torch_paths(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    _, train_calls, _ = run(tmp_path, tiny_gpt2(), tiny_lm_data, bridge, use_lazy_mode=True)
    assert not [c for c in names(train_calls) if c.startswith("hpex")]
    assert names(train_calls).count("core.mark_step") == 4  # after backward and after the optimizer step, 2 steps


def test_hpu_graphs_need_lazy_mode_on_a_gaudi(bridge, tmp_path):
    with pytest.raises(GaudiArgumentError, match="HPU Graphs need lazy mode"):
        hpu_args(tmp_path, use_hpu_graphs_for_training=True)


def test_profiler_and_memory_on_the_gaudi_path(bridge, tmp_path, tiny_gpt2, tiny_lm_data):
    args = hpu_args(tmp_path, max_steps=3, profiling_warmup_steps=1, profiling_steps=1)
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data)
    trainer.train()
    trace = json.loads((tmp_path / "profile_rank0.pt.trace.json").read_text())
    assert any(e.get("name") == "ProfilerStep#0" for e in trace["traceEvents"])
    memory = [h for h in trainer.state.log_history if "memory_allocated (GB)" in h]
    assert len(memory) == 3 and "hpu.memory_stats" in bridge().names()
    assert memory[0]["total_memory_available (GB)"] == 96.0  # the simulator's 'Limit'
