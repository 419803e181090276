"""optimum-habana's GaudiTrainingArguments fields parse here with the same names and meanings: each one acts, or
says in one line (or one argument error) what it does not do here. docs/optimum-habana.md lists them all."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from support import REPO
from transformers import HfArgumentParser

from optimum_gaudi import GaudiArgumentError, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.features.metrics import Throughput


def parse(tmp_path, *argv):
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", *argv]
    )
    return args


def test_defaults_change_nothing(tmp_path):
    args = parse(tmp_path)
    assert (args.context_parallel_size, args.adjust_throughput, args.ignore_eos) == (1, False, False)
    assert (args.profiling_warmup_steps_eval, args.profiling_steps_eval) == (0, 0)
    assert not (args.use_hpu_graphs or args.use_compiled_autograd or args.use_zero3_leaf_promotion)
    assert args.inline_inbuilt_nn_modules is None and args.allow_unspec_int_on_nn_module is None


def test_use_hpu_graphs_is_a_deprecated_alias_of_the_inference_graphs(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse(tmp_path, "--use_hpu_graphs")
    future = [w for w in caught if issubclass(w.category, FutureWarning) and "use_hpu_graphs" in str(w.message)]
    assert len(future) == 1
    assert args.use_hpu_graphs_for_inference and not args.use_hpu_graphs_for_training


def test_context_parallel_size_above_the_process_count_is_one_line(tmp_path):
    assert parse(tmp_path, "--context_parallel_size", "1").context_parallel_size == 1
    with pytest.raises(GaudiArgumentError, match=r"^--context_parallel_size 2 splits each sequence over 2 processes"):
        parse(tmp_path, "--context_parallel_size", "2")
    with pytest.raises(GaudiArgumentError, match="must be >= 1"):
        parse(tmp_path, "--context_parallel_size", "0")


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        ("--ignore_eos", "--ignore_eos does nothing here"),
        ("--use_zero3_leaf_promotion", "apply_zero3_leaf_promotion(model)"),
    ],
)
def test_flags_that_do_not_act_here_say_so_once(tmp_path, caplog, flag, said):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        parse(tmp_path, flag)
    assert len([r for r in caplog.records if said in r.message]) == 1


def test_ignore_eos_false_as_optimum_habana_scripts_pass_it_is_silent(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        assert parse(tmp_path, "--ignore_eos", "False").ignore_eos is False
    assert not [r for r in caplog.records if "ignore_eos" in r.message]


@pytest.mark.parametrize("name", ["inline_inbuilt_nn_modules", "allow_unspec_int_on_nn_module"])
def test_dynamo_config_flags_set_torch_dynamo_config_when_given(tmp_path, caplog, name):
    config = torch._dynamo.config
    if not hasattr(config, name):  # torch 2.6 (Gaudi 1.20, 1.21) has no allow_unspec_int_on_nn_module
        with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
            parse(tmp_path, f"--{name}", "True").prepare_process()  # where the run starts: the trainer's constructor
        assert [r.message for r in caplog.records if "does nothing" in r.message and name in r.message]
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = getattr(config, name)
    # torch's own patch() restores the value afterwards: monkeypatching the config module leaves the name
    # "does not exist" for every later torch.compile in the process
    with config.patch({name: before}):
        parse(tmp_path).prepare_process()  # unset: torch's own value is kept
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert getattr(config, name) == before
        with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
            parse(tmp_path, f"--{name}", str(not before)).prepare_process()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            now = getattr(config, name)
    retired = [r for r in caplog.records if "retired" in r.message]
    # torch 2.13 retired inline_inbuilt_nn_modules (always True): then the run says so instead of acting
    assert now == (not before) or len(retired) == 1


def test_compiled_autograd_needs_torch_compile_and_is_said_not_to_apply(tmp_path, caplog):
    with pytest.raises(GaudiArgumentError, match="--use_compiled_autograd .* add --torch_compile"):
        parse(tmp_path, "--use_compiled_autograd")
    with caplog.at_level(logging.WARNING):
        parse(tmp_path, "--use_compiled_autograd", "--torch_compile", "--throughput_warmup_steps", "1")
    assert any("--use_compiled_autograd is not applied" in r.getMessage() for r in caplog.records)
    assert torch._dynamo.config.compiled_autograd is False  # nothing process-wide changed


@pytest.mark.parametrize("name", ["profiling_warmup_steps_eval", "profiling_steps_eval"])
def test_eval_profiling_counts_must_not_be_negative(tmp_path, name):
    with pytest.raises(GaudiArgumentError, match=f"--{name} must be a whole number >= 0"):
        parse(tmp_path, f"--{name}", "-1")


# ---- the eval profiler ---------------------------------------------------------------------------------------


def test_profiling_steps_eval_profiles_the_evaluation_batches_of_the_window(tiny_gpt2, tiny_lm_data, tmp_path):
    seen = []

    def hook(module, inputs, output):
        seen.append(torch.autograd._profiler_enabled())

    model = tiny_gpt2()
    model.register_forward_hook(hook)
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        per_device_eval_batch_size=4,
        profiling_warmup_steps_eval=1,
        profiling_steps_eval=2,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trainer = GaudiTrainer(model=model, args=args, eval_dataset=tiny_lm_data[:20])
    trainer.evaluate()
    assert seen == [False, True, True, False, False]  # batches 2 and 3 of 5
    path = tmp_path / "profile_eval_rank0.pt.trace.json"
    assert trainer._eval_profiler.trace_file == path
    names = {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"aten::mm", "aten::addmm", "aten::linear"} & names
    trainer.evaluate(metric_key_prefix="test")  # a second loop profiles again, under its own name
    assert (tmp_path / "profile_test_rank0.pt.trace.json").is_file()
    assert seen[5:] == [False, True, True, False, False]


def test_an_evaluation_shorter_than_the_window_writes_what_it_recorded(tiny_gpt2, tiny_lm_data, tmp_path):
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), report_to=[], per_device_eval_batch_size=4, profiling_steps_eval=10
    )
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, eval_dataset=tiny_lm_data[:8])
    trainer.evaluate()
    assert (tmp_path / "profile_eval_rank0.pt.trace.json").is_file()
    assert not torch.autograd._profiler_enabled()


# ---- adjust_throughput ---------------------------------------------------------------------------------------


def test_throughput_leaves_out_excluded_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("optimum_gaudi.features.metrics.time.time", lambda: now[0])
    meter = Throughput(warmup_steps=0)
    meter.train_begin(0)
    meter.count_batch({"input_ids": torch.zeros(4, 8)}, 4)
    now[0] += 10.0
    meter.exclude(6.0)  # e.g. an evaluation
    assert meter.totals(1)["seconds"] == pytest.approx(4.0)
    assert meter.interval(1, world_size=1)["interval_samples_per_second"] == pytest.approx(1.0)


def _train_with_slow_evals(model, data, tmp_path, adjust: bool):
    def slow_metrics(eval_pred):
        import time

        time.sleep(0.3)
        return {}

    args = GaudiTrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        max_steps=4,
        per_device_train_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=2,
        save_strategy="no",
        adjust_throughput=adjust,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trainer = GaudiTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data[:4], compute_metrics=slow_metrics
    )
    trainer.train()
    return trainer


def test_adjust_throughput_leaves_the_evaluations_out(tiny_gpt2, tiny_lm_data, tmp_path):
    adjusted = _train_with_slow_evals(tiny_gpt2(), tiny_lm_data, tmp_path / "a", adjust=True)
    assert adjusted._throughput._excluded >= 0.6  # two evaluations of >= 0.3 s each
    plain = _train_with_slow_evals(tiny_gpt2(), tiny_lm_data, tmp_path / "p", adjust=False)
    assert plain._throughput._excluded == 0.0
    final = [h for h in adjusted.state.log_history if "train_runtime" in h][0]
    assert (
        final["train_samples_per_second"]
        > [h for h in plain.state.log_history if "train_runtime" in h][0]["train_samples_per_second"]
    )


# ---- transformers 4's arguments that transformers 5 removed -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--warmup_ratio", "0.03"], {"warmup_steps": 0.03}),
        (["--include_tokens_per_second", "True"], {"include_num_input_tokens_seen": "all"}),
        (["--group_by_length"], {"train_sampling_strategy": "group_by_length"}),
        (["--adafactor"], {"optim": "adafactor"}),
        (["--push_to_hub_model_id", "m"], {"hub_model_id": "m"}),
        (["--push_to_hub_model_id", "m", "--push_to_hub_organization", "org"], {"hub_model_id": "org/m"}),
        (["--push_to_hub_token", "tok"], {"hub_token": "tok"}),
        (["--per_gpu_train_batch_size", "3"], {"per_device_train_batch_size": 3}),
        (["--per_gpu_eval_batch_size", "5"], {"per_device_eval_batch_size": 5}),
        (["--no_cuda"], {"use_cpu": True}),
        (["--include_inputs_for_metrics"], {"include_for_metrics": ["inputs"]}),
        (["--torchdynamo", "inductor", "--throughput_warmup_steps", "1"], {"torch_compile_backend": "inductor"}),
    ],
)
def test_a_removed_argument_becomes_its_transformers_5_equivalent_with_one_line(tmp_path, caplog, argv, expected):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        args = parse(tmp_path, *argv)
    assert {name: getattr(args, name) for name in expected} == expected
    said = [r.message for r in caplog.records if "removed in transformers 5" in r.message]
    assert len(said) == len([a for a in argv if a.startswith("--") and a != "--throughput_warmup_steps"]) - (
        1 if "--push_to_hub_organization" in argv else 0
    )


def test_logging_dir_becomes_the_tensorboard_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    parse(tmp_path, "--logging_dir", str(tmp_path / "tb")).prepare_process()  # where the run starts
    import os

    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tb")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")


def test_warmup_ratio_trains_with_the_same_schedule_as_warmup_steps_ratio(tmp_path):
    ratio = parse(tmp_path, "--warmup_ratio", "0.5", "--max_steps", "4", "--learning_rate", "1e-3")
    steps = parse(tmp_path, "--warmup_steps", "0.5", "--max_steps", "4", "--learning_rate", "1e-3")
    assert ratio.get_warmup_steps(4) == steps.get_warmup_steps(4) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--warmup_ratio", "0.1", "--warmup_steps", "5"], "both set the warm-up"),
        (["--warmup_ratio", "1.0"], r"a ratio in \[0, 1\)"),
        (["--save_safetensors", "False"], "always saves safetensors"),
        (["--jit_mode_eval"], "use --torch_compile"),
        (["--past_index", "2"], "--past_index 2 was removed"),
        (["--fsdp_min_num_params", "100"], '"min_num_params": 100'),
        (["--fsdp_transformer_layer_cls_to_wrap", "GPT2Block"], '"transformer_layer_cls_to_wrap": \\["GPT2Block"\\]'),
        (["--tpu_num_cores", "8"], "--tpu_num_cores was removed"),
        (["--use_legacy_prediction_loop"], "was removed in transformers 5"),
    ],
)
def test_a_removed_argument_without_an_equivalent_is_refused_in_one_line(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message) as error:
        parse(tmp_path, *argv)
    assert "\n" not in str(error.value)


def test_removed_arguments_at_their_old_defaults_say_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        args = parse(tmp_path, "--adafactor", "False", "--save_safetensors", "True", "--warmup_ratio", "0")
    assert not [r for r in caplog.records if "removed in transformers 5" in r.message]
    assert args.optim != "adafactor" and args.warmup_steps == 0
    assert "warmup_ratio" not in args.gaudi_flags()


# ---- the docs table --------------------------------------------------------------------------------------------

# The 43 fields optimum-habana's GaudiTrainingArguments declares (optimum/habana/transformers/training_args.py).
OPTIMUM_HABANA_FIELDS = """use_habana gaudi_config_name use_lazy_mode use_hpu_graphs use_hpu_graphs_for_inference
use_hpu_graphs_for_training use_compiled_autograd compile_from_sec_iteration compile_dynamic use_zero3_leaf_promotion
cache_size_limit use_regional_compilation inline_inbuilt_nn_modules allow_unspec_int_on_nn_module
disable_tensor_cache_hpu_graphs max_hpu_graphs distribution_strategy context_parallel_size minimize_memory
throughput_warmup_steps adjust_throughput pipelining_fwd_bwd ignore_eos non_blocking_data_copy profiling_warmup_steps
profiling_steps profiling_warmup_steps_eval profiling_steps_eval profiling_record_shapes profiling_with_stack optim
adam_epsilon logging_nan_inf_filter ddp_bucket_cap_mb ddp_find_unused_parameters half_precision_backend
attn_implementation flash_attention_recompute flash_attention_fast_softmax flash_attention_causal_mask
flash_attention_fp8 sdp_on_bf16 fp8""".split()


def test_every_optimum_habana_field_parses_and_is_in_the_docs_table(tmp_path):
    import dataclasses
    import re

    assert len(OPTIMUM_HABANA_FIELDS) == 43
    ours = {f.name for f in dataclasses.fields(GaudiTrainingArguments)}
    assert set(OPTIMUM_HABANA_FIELDS) <= ours
    doc = (REPO / "docs" / "optimum-habana.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \|", doc.split("## The fields", 1)[1].split("## ", 1)[0], flags=re.M)
    assert rows == OPTIMUM_HABANA_FIELDS


# ---- DDP settings: optimum-habana's speed defaults on a Gaudi only (issue 22, point 2) -------------------------


def _ddp_handler_after_wrap(tmp_path, **flags):
    from accelerate.utils import DistributedDataParallelKwargs

    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], save_strategy="no", **flags)
    trainer = GaudiTrainer(model=torch.nn.Linear(2, 2), args=args)
    if trainer.accelerator.ddp_handler is None:  # transformers 4.57 makes it in _wrap_model, under DDP only
        given = {"bucket_cap_mb": args.ddp_bucket_cap_mb} if args.ddp_bucket_cap_mb is not None else {}
        trainer.accelerator.ddp_handler = DistributedDataParallelKwargs(**given)
    find_unused = trainer.accelerator.ddp_handler.find_unused_parameters
    trainer._preparation.use_device_ddp_defaults()
    assert trainer.accelerator.ddp_handler.find_unused_parameters == find_unused  # transformers' choice stays
    return trainer.accelerator.ddp_handler


def test_on_a_gaudi_ddp_gets_bigger_buckets_and_bucket_views_unless_the_user_set_them(bridge, tmp_path):
    handler = _ddp_handler_after_wrap(tmp_path, use_habana=True)
    assert (handler.bucket_cap_mb, handler.gradient_as_bucket_view) == (230, True)
    handler = _ddp_handler_after_wrap(tmp_path, use_habana=True, ddp_bucket_cap_mb=50)
    assert (handler.bucket_cap_mb, handler.gradient_as_bucket_view) == (50, True)


def test_elsewhere_ddp_keeps_transformers_settings(tmp_path):
    handler = _ddp_handler_after_wrap(tmp_path, use_habana=True)  # no Gaudi here: the CPU
    assert (handler.bucket_cap_mb, handler.gradient_as_bucket_view) == (25, False)


# ---- --optim paged_adamw_32bit, on optimum-habana's TRL command lines -----------------------------------------


def test_paged_adamw_32bit_without_bitsandbytes_is_adamw_with_one_line(tmp_path, caplog, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a)
    )
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        args = parse(tmp_path, "--optim", "paged_adamw_32bit")
    assert args.optim == "adamw_torch"
    assert len([r for r in caplog.records if "paged_adamw_32bit needs bitsandbytes" in r.message]) == 1
