"""configuration_problems (trainers/configuration_problems.py): every concern checks itself, one function asks them
in one documented order, and the arguments raise the first; the world size is read once; what the arguments change
process-wide waits for their checks and happens where the run starts, the trainer's constructor (prepare_process)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from tiny import tiny_decoder_only

from optimum_gaudi import GaudiArgumentError, GaudiConfigError, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import CPUDevice
from optimum_gaudi.trainers import removed_args
from optimum_gaudi.trainers.configuration_problems import configuration_problems


def make(tmp_path, **kwargs) -> GaudiTrainingArguments:
    return GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


def problems_of(args, world_size=1, device=None, **flags) -> list[str]:
    for name, value in flags.items():
        setattr(args, name, value)
    return list(configuration_problems(args, world_size, device))


class RefusingDevice(CPUDevice):
    """The CPU device, refusing whatever it is asked to run."""

    def argument_problem(self, args):
        return "this device refuses the arguments."

    def fp8_problem(self, compiling=False):
        return "this device refuses fp8."


def test_built_arguments_have_no_problem_left_device_included(tmp_path):
    args = make(tmp_path, bf16=True, torch_compile=True, throughput_warmup_steps=1)
    assert problems_of(args, args.parallel_layout.world_size, args.gaudi_device) == []


def test_problems_come_in_the_documented_order(tmp_path):
    """Values, supervision, execution, compilation, attention, precision, layout, optimum-habana's flags,
    transformers' flags; the device's last, and only once there is one."""
    args = make(tmp_path)
    found = problems_of(
        args,
        4,
        RefusingDevice(),
        per_device_train_batch_size=0,  # transformers' flags
        use_compiled_autograd=True,  # optimum-habana's
        context_parallel_size=3,  # the layout, on 4 processes
        fp8_recipe='{"nope": 1}',  # precision
        fp8=True,
        flash_attention_causal_mask=True,  # attention
        cache_size_limit=0,  # compilation
        max_hpu_graphs=0,  # execution
        hang_long_timeout=0,  # supervision
        distribution_strategy="turbo",  # the flags' own values
    )
    assert [problem.split(" ", 1)[0] for problem in found] == [
        "--distribution_strategy",
        "--hang_long_timeout",
        "--max_hpu_graphs",
        "--cache_size_limit",
        "--flash_attention_causal_mask",
        "--fp8_recipe:",
        "--context_parallel_size",
        "--use_compiled_autograd",
        "--per_device_train_batch_size",
        "this",  # the device: its arguments, then fp8 on it
        "this",
    ]
    assert found[-2:] == ["this device refuses the arguments.", "this device refuses fp8."]
    assert "this device refuses the arguments." not in problems_of(args, 4)  # no device yet: not asked


def test_the_arguments_raise_the_first_problem_in_that_order(tmp_path):
    with pytest.raises(GaudiArgumentError) as caught:
        make(tmp_path, max_hpu_graphs=0, hang_long_timeout=0)
    assert str(caught.value) == "--hang_long_timeout must be > 0 seconds, got 0."


def test_the_world_size_is_read_once_with_mpiruns_own_variable(tmp_path, monkeypatch):
    """The context-parallel check sees the world the layout gets: under mpirun without WORLD_SIZE, its own
    OMPI_COMM_WORLD_SIZE (as the bridge's hccl module and accelerate read it)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(GaudiArgumentError, match="^--context_parallel_size 3 splits each sequence over 3 processes "
                       "and this run has 4:"):  # fmt: skip
        make(tmp_path, context_parallel_size=3)
    monkeypatch.setenv("WORLD_SIZE", "6")  # a launcher's own variable comes first
    with pytest.raises(GaudiArgumentError, match="and this run has 6:"):
        make(tmp_path, context_parallel_size=4)


def test_nothing_process_wide_changes_until_the_checks_pass(tmp_path):
    """A configuration refused late (its Gaudi config is missing) leaves torch's math-SDPA switch as it was: it is
    prepare_process's to set, where the run starts (the trainer's constructor), never the arguments'."""
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
        with pytest.raises(GaudiConfigError):
            make(tmp_path, sdp_on_bf16=True, gaudi_config_name=str(tmp_path / "missing.json"))
        assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
        args = make(tmp_path, sdp_on_bf16=True)  # built: its device set up, nothing else of the process changed
        assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
        args.prepare_process()  # where they are applied, again if need be
        assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)


def test_building_the_arguments_changes_nothing_of_the_process_and_the_trainer_applies_the_runs_settings(
    tmp_path, monkeypatch
):
    """Issue 47: ``__post_init__`` parses and checks. Dynamo's options, torch's math-SDPA switch and TensorBoard's
    variable change when a trainer is built (before the parent Trainer's callbacks read the variable); only the
    collectives' backend is set up with the device, before the default process group that needs it."""
    config, name = torch._dynamo.config, "allow_unspec_int_on_nn_module"
    dynamo = hasattr(config, name)  # torch 2.7+
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    sdp = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    flags = {"sdp_on_bf16": True, "logging_dir": str(tmp_path / "tb"), **({name: True} if dynamo else {})}
    with config.patch({name: False} if dynamo else {}):
        try:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
            args = make(tmp_path, **flags)
            assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
            assert not (dynamo and getattr(config, name)) and "TENSORBOARD_LOGGING_DIR" not in os.environ
            GaudiTrainer(model=tiny_decoder_only(), args=args)
            assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
            assert not dynamo or getattr(config, name) is True
            if "logging_dir" in removed_args._MISSING:  # transformers 5 reads --logging_dir from the variable
                assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tb")
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(sdp)


def test_ignored_flags_are_said_once_and_only_for_a_run_that_can_start(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        with pytest.raises(GaudiArgumentError):
            make(tmp_path, minimize_memory=True, max_hpu_graphs=0)
        assert "--minimize_memory only acts with --fp8" not in caplog.text
        make(tmp_path, minimize_memory=True)
    assert caplog.text.count("--minimize_memory only acts with --fp8") == 1
