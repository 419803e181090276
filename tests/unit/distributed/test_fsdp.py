"""FSDP (FSDP2, ``fully_shard``) with each Gaudi feature: on 2 CPU processes over gloo against DDP and one process,
on 2 simulated Gaudis over 'hccl' with sharded checkpoints, and the settings optimum-habana's users pass.

The trainings run in tests/scripts/fsdp_features.py, several in one launch (sharded and replicated in the same
processes), at the same global batch of 8 rows a step.

The trainings on several processes: tests/integration/distributed/test_fsdp_trainings.py."""

import pytest
import tiny
from support import DATA, REPO

from optimum_gaudi import GaudiTrainingArguments
from optimum_gaudi.distributed.fsdp import FsdpConfigError, fsdp2_config, read_fsdp_config, wrap_this_models_layers
from optimum_gaudi.trainers.training_args import GaudiArgumentError

HABANA_FSDP_CONFIG = DATA / "optimum_habana_fsdp_config.json"


# ---- what optimum-habana's users pass -------------------------------------------------------------------------


def test_optimum_habanas_fsdp_config_means_the_same_under_fsdp2():
    config = fsdp2_config(read_fsdp_config(str(HABANA_FSDP_CONFIG)))
    assert config["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and config["reshard_after_forward"] is True
    assert config["cpu_offload"] is False and "sharding_strategy" not in config
    assert config["transformer_layer_cls_to_wrap"] == "GaudiLlamaDecoderLayer"
    assert fsdp2_config({"fsdp_sharding_strategy": "SHARD_GRAD_OP"})["reshard_after_forward"] is False
    assert fsdp2_config({"fsdp_sharding_strategy": 2, "fsdp_offload_params": True})["cpu_offload"] is True
    assert fsdp2_config({"version": 1, "sharding_strategy": 3})["sharding_strategy"] == 3  # FSDP1's own file


def test_the_example_fsdp_config_is_optimum_habanas_with_sharded_checkpoints():
    """The README's 70B command passes examples/language-modeling/fsdp_config.json: the same settings, except that
    checkpoints are sharded (optimum-habana's gathers each on rank 0)."""
    example = REPO / "examples" / "language-modeling" / "fsdp_config.json"
    ours, theirs = (fsdp2_config(read_fsdp_config(str(path))) for path in (example, HABANA_FSDP_CONFIG))
    assert ours.pop("state_dict_type") == "SHARDED_STATE_DICT" and theirs.pop("state_dict_type") == "FULL_STATE_DICT"
    assert ours == theirs


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fsdp_sharding_strategy": 3}, r"^fsdp_config sharding_strategy 3 \(NO_SHARD\) has no FSDP2 equivalent here: "
                                        r"use 1 \(FULL_SHARD\) or 2 \(SHARD_GRAD_OP\), or train without --fsdp"),
        ({"sharding_strategy": "HYBRID_SHARD"}, r"^fsdp_config sharding_strategy 'HYBRID_SHARD' \(HYBRID_SHARD\) has no"),
        ("missing.json", r"^--fsdp_config missing.json: no such file; pass a JSON file or a JSON object\.$"),
        ("{not json", r"^--fsdp_config \{not json: not JSON"),
    ],
)  # fmt: skip
def test_an_fsdp_config_that_cannot_work_is_one_line(config, message, tmp_path):
    with pytest.raises(FsdpConfigError, match=message) as caught:
        GaudiTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", fsdp_config=config)
    assert "\n" not in str(caught.value)


def test_layer_classes_are_taken_as_this_model_names_them():
    model = tiny.llama()
    plugin = type("Plugin", (), {"transformer_cls_names_to_wrap": ["GaudiLlamaDecoderLayer", "LlamaRMSNorm"]})()
    wrap_this_models_layers(plugin, model)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer", "LlamaRMSNorm"]
    plugin.transformer_cls_names_to_wrap = ["GPT2Block"]
    with pytest.raises(FsdpConfigError, match=r"^fsdp_config transformer_layer_cls_to_wrap names GPT2Block, which "
                                              r"LlamaForCausalLM does not have; its repeated layers: LlamaDecoderLayer\.$"):  # fmt: skip
        wrap_this_models_layers(plugin, model)


@pytest.mark.parametrize("graphs", ["use_hpu_graphs_for_training", "use_hpu_graphs_for_inference"])
def test_hpu_graphs_with_fsdp_are_refused_in_one_line(graphs, tmp_path):
    with pytest.raises(GaudiArgumentError, match=rf"^--{graphs} cannot be combined with --fsdp: FSDP gathers"):
        GaudiTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", **{graphs: True})


def test_lazy_mode_with_fsdp_is_refused_in_one_line(tmp_path):
    with pytest.raises(GaudiArgumentError, match=r"^--use_lazy_mode cannot be combined with --fsdp: FSDP frees") as e:
        GaudiTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", use_lazy_mode=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("plugin", "flags", "message"),
    [
        ({"activation_checkpointing": True}, {"activation_checkpointing": True}, "^fsdp_config activation_checkpointing"),
        ({}, {"save_only_model": True, "load_best_model_at_end": True}, "^--fsdp with --save_only_model cannot"),
        ({"state_dict_type": "SHARDED_STATE_DICT"}, {"save_only_model": True}, "^--save_only_model needs whole weights"),
    ],
)  # fmt: skip
def test_what_transformers_checks_once_fsdp_is_on_is_one_line_for_cpu_processes_too(plugin, flags, message):
    """A CPU run turned to FSDP after transformers' own checks gets them again, as one line each."""
    from types import SimpleNamespace

    from optimum_gaudi.distributed.fsdp import check_fsdp_arguments

    fsdp_plugin = SimpleNamespace(**{"activation_checkpointing": False, "state_dict_type": "FULL_STATE_DICT", **plugin})
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=fsdp_plugin))
    args = SimpleNamespace(**{"save_only_model": False, "load_best_model_at_end": False, **flags})
    with pytest.raises(FsdpConfigError, match=message) as caught:
        check_fsdp_arguments(accelerator, args)
    assert "\n" not in str(caught.value)


def test_fp8_layers_fsdp_does_not_shard_are_one_line():
    """The Gaudi's fp8 (the Transformer Engine's te.Linear) under FSDP is refused when the trainer is built; torchao's
    Float8Linear, tested above against DDP, passes."""
    from optimum_gaudi.distributed.fsdp import check_fp8_under_fsdp
    from optimum_gaudi.precision.fp8 import Fp8Plan

    check_fp8_under_fsdp(None)
    check_fp8_under_fsdp(Fp8Plan("torchao Float8Linear", lambda model, layers: None))
    with pytest.raises(FsdpConfigError, match=r"^--fp8 with --fsdp: te.Linear layers are not sharded") as caught:
        check_fp8_under_fsdp(Fp8Plan("te.Linear", lambda model, layers: None, shards_with_fsdp=False))
    assert "\n" not in str(caught.value)


def test_fsdp_on_a_gaudi_with_a_torch_that_cannot_sum_is_one_line(monkeypatch):
    """FSDP2 reduces float32 / bf16 gradients with ReduceOp.AVG unless told to sum (torch >= 2.8); HCCL takes no AVG.
    Devices whose collectives average are not asked."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule

    from optimum_gaudi.devices.hpu import HPUDevice
    from optimum_gaudi.distributed.fsdp import check_sum_reductions

    check_sum_reductions(HPUDevice())  # torch >= 2.8's switch, or (2.6, 2.7) the op each unit's group holds
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms", raising=False)  # as torch 2.6 and 2.7
    check_sum_reductions(HPUDevice())
    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_divide_factor", raising=False)  # as torch < 2.6
    check_sum_reductions(SimpleNamespace(collectives_average=True, type="cpu"))
    with pytest.raises(FsdpConfigError, match=r"^--fsdp on HPU: its collectives take no ReduceOp.AVG, and this torch "):
        check_sum_reductions(HPUDevice())


def test_fsdp_where_the_devices_streams_record_no_events_is_one_line(monkeypatch, tmp_path):
    """FSDP2 records events on the device module's streams; torch 2.6's CPU streams have no ``record_event`` (an
    AttributeError at step 1 on each rank). Here told so on any torch; on 2.6 the real streams answer it."""
    import torch

    if hasattr(torch.cpu.Stream, "record_event"):
        monkeypatch.setattr(torch.cpu, "Stream", type("Stream", (), {}))
    with pytest.raises(GaudiArgumentError, match=r"^--fsdp on CPU needs torch 2.7 or newer \(FSDP2 records") as e:
        GaudiTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", report_to=[])
    assert "\n" not in str(e.value)
