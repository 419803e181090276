import logging
import os

import pytest
from conftest import CPU_FSDP
from transformers import HfArgumentParser, TrainingArguments

from optimum_gaudi import GaudiArgumentError, GaudiConfigError, GaudiTrainingArguments

GAUDI_FLAGS = [
    "use_habana",
    "use_lazy_mode",
    "gaudi_config_name",
    "use_hpu_graphs_for_training",
    "use_hpu_graphs_for_inference",
    "max_hpu_graphs",
    "disable_tensor_cache_hpu_graphs",
    "distribution_strategy",
    "throughput_warmup_steps",
    "pipelining_fwd_bwd",
    "non_blocking_data_copy",
    "half_precision_backend",
    "profiling_warmup_steps",
    "profiling_steps",
    "profiling_record_shapes",
    "profiling_with_stack",
]


def make(tmp_path, **kwargs):
    return GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


def parse(tmp_path, *argv):
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", *argv]
    )
    return args


def test_every_gaudi_flag_is_in_help():
    try:
        HfArgumentParser(TrainingArguments).format_help()
    except TypeError:  # transformers 5.2.0: an unescaped '%' in use_liger_kernel's help
        pytest.skip("this transformers release's own --help fails")
    help_text = HfArgumentParser(GaudiTrainingArguments).format_help()
    for flag in GAUDI_FLAGS:
        assert f"--{flag}" in help_text


def test_cli_parsing_of_gaudi_flags(tmp_path):
    args = parse(
        tmp_path,
        *("--use_habana", "--use_lazy_mode", "--gaudi_config_name", "Habana/gpt2"),
        *("--use_hpu_graphs_for_inference", "--disable_tensor_cache_hpu_graphs"),
        *("--distribution_strategy", "fast_ddp", "--throughput_warmup_steps", "3", "--pipelining_fwd_bwd"),
        *("--non_blocking_data_copy", "--half_precision_backend", "cpu_amp", "--bf16"),
        *("--profiling_warmup_steps", "2", "--profiling_steps", "4", "--profiling_record_shapes"),
    )
    assert args.use_habana and args.use_lazy_mode and args.pipelining_fwd_bwd
    assert args.gaudi_config.use_fused_adam
    assert args.distribution_strategy == "fast_ddp"
    assert (args.throughput_warmup_steps, args.profiling_warmup_steps, args.profiling_steps) == (3, 2, 4)
    assert args.half_precision_backend == "cpu_amp"
    assert args.accelerator_config.non_blocking is True


def test_defaults_leave_every_gaudi_feature_off(tmp_path):
    args = make(tmp_path)
    assert not any(getattr(args, f) for f in GAUDI_FLAGS if isinstance(getattr(args, f), bool))
    assert args.gaudi_config is None and args.distribution_strategy == "ddp"


def test_cli_rejects_unknown_strategy(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse(tmp_path, "--distribution_strategy", "turbo")
    assert "invalid choice: 'turbo'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"distribution_strategy": "turbo"}, "--distribution_strategy must be one of ddp, fast_ddp, got 'turbo'"),
        ({"half_precision_backend": "apex"}, "--half_precision_backend must be one of auto, hpu_amp, cpu_amp"),
        ({"throughput_warmup_steps": -1}, "--throughput_warmup_steps must be a whole number >= 0"),
        ({"profiling_warmup_steps": -2}, "--profiling_warmup_steps must be"),
        ({"profiling_steps": -3}, "--profiling_steps must be"),
        ({"max_hpu_graphs": 0}, "--max_hpu_graphs must be >= 1"),
        (
            {"distribution_strategy": "fast_ddp", "deepspeed": {"zero_optimization": {"stage": 2}}},
            "fast_ddp.*--deepspeed",
        ),
        ({"distribution_strategy": "fast_ddp", "fsdp": "full_shard"}, "fast_ddp.*--fsdp"),
        ({"pipelining_fwd_bwd": True}, "--pipelining_fwd_bwd .*add --use_lazy_mode"),
        ({"fast_ddp_dtype": "int8"}, "--fast_ddp_dtype must be one of auto, float32, bfloat16"),
        (
            {"torch_compile": True, "use_hpu_graphs_for_training": True},
            "--torch_compile cannot be combined with HPU Graphs",
        ),
        ({"torch_compile": True, "use_hpu_graphs_for_inference": True}, "--torch_compile cannot be combined"),
        ({"torch_compile": True, "use_lazy_mode": True}, "--torch_compile needs eager mode"),
    ],
)
def test_invalid_values_and_combinations_fail_at_construction(tmp_path, kwargs, match):
    with pytest.raises(GaudiArgumentError, match=match) as excinfo:
        make(tmp_path, **kwargs)
    assert "\n" not in str(excinfo.value)


def test_bad_gaudi_config_name_fails_at_construction(tmp_path):
    with pytest.raises(GaudiConfigError, match="does not exist"):
        make(tmp_path, gaudi_config_name=str(tmp_path / "nope.json"))


def test_ignored_flags_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        make(tmp_path, max_hpu_graphs=4, disable_tensor_cache_hpu_graphs=True)
    text = caplog.text
    assert "--max_hpu_graphs is ignored" in text and "--disable_tensor_cache_hpu_graphs is ignored" in text


def test_hpu_amp_without_a_gaudi_warns_where_autocast_runs(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        args = make(tmp_path, half_precision_backend="hpu_amp")
    assert "--half_precision_backend hpu_amp: no Gaudi here, autocast runs on cpu." in caplog.text
    assert args.use_cpu  # the CPU device trains in host memory: transformers' --use_cpu


def test_lazy_mode_environment_is_set_for_the_bridge(tmp_path, monkeypatch):
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    make(tmp_path, use_lazy_mode=True)
    import os

    assert os.environ["PT_HPU_LAZY_MODE"] == "1"
    make(tmp_path)
    assert os.environ["PT_HPU_LAZY_MODE"] == "0"


def test_bf16_is_accepted_on_cpu(tmp_path):
    args = make(tmp_path, bf16=True, use_habana=True)
    assert args.device.type == args.gaudi_device.type
    # transformers 4.57 hands the precision to accelerate through its environment instead
    assert (getattr(args, "mixed_precision", None) or os.environ["ACCELERATE_MIXED_PRECISION"]) == "bf16"


def test_arguments_pickle_with_their_device(tmp_path):
    import pickle

    args = make(tmp_path, gaudi_config_name="gpt2")
    clone = pickle.loads(pickle.dumps(args))
    assert clone.gaudi_config == args.gaudi_config and clone.gaudi_device.type == args.gaudi_device.type


def test_torch_compile_backend_follows_the_device(tmp_path):
    assert make(tmp_path, torch_compile=True).torch_compile_backend == "inductor"  # no Gaudi yet: CPU


def test_torch_compile_uses_hpu_backend_on_a_gaudi(tmp_path, bridge):
    args = make(tmp_path, torch_compile=True, use_habana=True)
    assert args.gaudi_device.type == "hpu" and args.torch_compile_backend == "hpu_backend"


def test_deepspeed_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real_find_spec(n, *a))
    config = tmp_path / "ds.json"
    config.write_text("{}")
    with pytest.raises(GaudiArgumentError, match="--deepspeed needs DeepSpeed: pip install deepspeed"):
        make(tmp_path, deepspeed=str(config))


def test_deepspeed_config_path_must_exist(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
    with pytest.raises(GaudiArgumentError, match="no such file"):
        make(tmp_path, deepspeed=str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    "integration, words",
    [
        ("tensorboard", "--report_to tensorboard needs tensorboard, which is not installed: pip install "
         "'optimum-gaudi[tensorboard]' (or: pip install tensorboard)."),
        ("nosuch", "nosuch is not supported, only "),  # transformers' own words first, then ours
    ],
    ids=["not-installed", "unknown"],
)  # fmt: skip
def test_report_to_what_is_not_here_fails_where_transformers_does(tmp_path, monkeypatch, integration, words):
    """transformers lets such arguments exist (they build and serialize) and fails when the trainer is built;
    so do we, with one line."""
    import json

    import tiny
    import transformers.integrations
    from transformers import Trainer

    from optimum_gaudi import GaudiTrainer

    available = [n for n in transformers.integrations.get_available_reporting_integrations() if n != "tensorboard"]
    monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", lambda: available)
    args = GaudiTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[integration])
    assert json.loads(args.to_json_string())["report_to"] == [integration]
    with pytest.raises(GaudiArgumentError) as refused:
        GaudiTrainer(model=tiny.gpt2(), args=args, train_dataset=tiny.lm_data())
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()
    if integration not in transformers.integrations.integration_utils.get_available_reporting_integrations():
        plain = TrainingArguments(output_dir=str(tmp_path / "plain"), report_to=[integration])
        with pytest.raises((RuntimeError, ValueError)):  # transformers' own failure, at the same point
            Trainer(model=tiny.gpt2(), args=plain, train_dataset=tiny.lm_data())


def test_fsdp_on_transformers_4_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    """transformers 4.57's FSDP stops a CPU run inside accelerate ("There are currently no available devices found")
    and its final save lacks 5.x's helpers: refused when the arguments are built, on every device (make test-compat
    runs this on 4.57.1 as it is)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        monkeypatch.setattr(transformers, "__version__", "5.0.0")  # the same check, passing
    if CPU_FSDP:  # the arguments refuse --fsdp on torch 2.6's CPU (tests/conftest.py)
        GaudiTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard")
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(GaudiArgumentError) as caught:
        GaudiTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard")
    assert str(caught.value) == (
        "--fsdp needs transformers 5 here (this is 4.57.1): pip install -U 'transformers>=5', or train without --fsdp "
        "(DDP, or --deepspeed)."
    )
