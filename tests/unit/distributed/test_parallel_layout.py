"""ParallelLayout (distributed/layout.py): the degrees of a run worked out once, from the arguments and the world,
and the one choice of context parallelism. The multi-process behaviour (groups, splits) is in
tests/integration/distributed/test_sequence_parallel_trainings.py and test_stalled_slow_or_diverging_ranks.py."""

from __future__ import annotations

import copy
import pickle

from optimum_gaudi import GaudiTrainingArguments
from optimum_gaudi.devices import CPUDevice, CUDADevice
from optimum_gaudi.distributed.layout import CP_ALL_TO_ALL, CP_TORCH, ParallelLayout


def arguments(tmp_path, **flags) -> GaudiTrainingArguments:
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[])
    for name, value in flags.items():
        setattr(args, name, value)
    return args


def test_the_arguments_build_one_layout_of_one_process(tmp_path):
    layout = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], ddp_timeout=7).parallel_layout
    assert layout == ParallelLayout(world_size=1, ddp_timeout=7)
    assert (layout.data_parallel_size, layout.dp_shard_size, layout.dp_replicate_size) == (1, 1, 1)
    assert layout.sequence_parallel() is None and layout.parallelism_config() is None
    assert layout.host_group() is None  # no process group: nothing to make


def test_degrees_and_the_context_parallel_choice(tmp_path):
    ddp = ParallelLayout.from_arguments(arguments(tmp_path, context_parallel_size=2), world_size=8)
    assert (ddp.cp_implementation, ddp.data_parallel_size, ddp.dp_replicate_size, ddp.dp_shard_size) == (
        CP_ALL_TO_ALL, 4, 8, 1
    )  # fmt: skip
    fast = ParallelLayout.from_arguments(arguments(tmp_path, distribution_strategy="fast_ddp"), world_size=2)
    assert fast.fast_ddp and fast.cp_implementation is None
    alone = ParallelLayout.from_arguments(arguments(tmp_path, distribution_strategy="fast_ddp"), world_size=1)
    assert not alone.fast_ddp  # one process: nothing to reduce
    fsdp = dict(fsdp="full_shard", context_parallel_size=4)
    cpu = ParallelLayout.from_arguments(arguments(tmp_path, gaudi_device=CPUDevice(), **fsdp), world_size=8)
    cuda = ParallelLayout.from_arguments(arguments(tmp_path, gaudi_device=CUDADevice(), **fsdp), world_size=8)
    assert (cpu.cp_implementation, cuda.cp_implementation) == (CP_ALL_TO_ALL, CP_TORCH)


def test_a_users_own_parallelism_config_is_torchs_context_parallelism(tmp_path):
    """transformers' parallelism_config with cp_size 2 and no --context_parallel_size: torch's path, whose divisor
    the data-parallel world counts (as transformers' get_cp_size does)."""
    from accelerate import ParallelismConfig

    given = ParallelismConfig(dp_shard_size=2, cp_size=2)
    layout = ParallelLayout.from_arguments(arguments(tmp_path, parallelism_config=given), world_size=4)
    assert (layout.cp_size, layout.cp_implementation, layout.data_parallel_size) == (2, CP_TORCH, 2)
    assert layout.sequence_parallel() is None  # not ours: no split of our own


def test_copies_of_the_arguments_carry_the_degrees_not_the_groups(tmp_path):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[])
    args.parallel_layout._groups["host"] = (object(), object())  # as if made
    for copied in (copy.deepcopy(args).parallel_layout, pickle.loads(pickle.dumps(args)).parallel_layout):
        assert copied == args.parallel_layout and copied._groups == {}


def test_host_groups_wait_the_runs_timeout_not_what_an_hccl_default_group_holds(bridge, tmp_path):
    """The bridge's hccl drops the timeout it is given (``distributed/hccl/__init__.py``): the host groups made
    beside it take the run's --ddp_timeout, never whatever the hccl group holds (the simulated one: a year), nor
    the value handed to it. A gloo default group's own timeout is still what they take."""
    from datetime import timedelta

    import habana_frameworks.torch.distributed.hccl  # noqa: F401
    import torch
    import torch.distributed as dist

    from optimum_gaudi.distributed.host_group import group_timeout

    for backend, expected in (("hccl", 7), ("gloo", 5)):
        dist.init_process_group(backend, init_method=f"file://{tmp_path / backend}", rank=0, world_size=1,
                                timeout=timedelta(seconds=5))  # fmt: skip
        try:
            assert group_timeout(7) == timedelta(seconds=expected), backend
            layout = ParallelLayout(world_size=1, ddp_timeout=7)
            made = layout.host_group()._get_backend(torch.device("cpu")).options._timeout
            assert made == timedelta(seconds=expected), backend
        finally:
            dist.destroy_process_group()


def test_the_layout_checks_its_own_degrees():
    """As torchtitan's ParallelDims: a split that is not a whole number of ranks, or that does not divide the world,
    is a problem of the layout itself (the arguments raise the first, before any device or process group)."""
    assert ParallelLayout(world_size=8, cp_size=2).problems() == []
    assert ParallelLayout(world_size=1, cp_size=0).problems() == ["--context_parallel_size must be >= 1, got 0."]
    (indivisible,) = ParallelLayout(world_size=6, cp_size=4).problems()
    assert indivisible.startswith("--context_parallel_size 4 splits each sequence over 4 processes and this run has 6")


def test_the_layout_describes_itself_in_one_line(tmp_path):
    assert str(ParallelLayout()) == ParallelLayout().describe() == "1 process: no data or context parallelism"
    assert ParallelLayout(world_size=8).describe() == "8 processes = 8 data-parallel; DDP, gradients averaged over 8"
    fast = ParallelLayout.from_arguments(arguments(tmp_path, distribution_strategy="fast_ddp"), world_size=2)
    assert fast.describe() == "2 processes = 2 data-parallel; fast_ddp, one fused gradient all-reduce over 2"
    split = ParallelLayout.from_arguments(arguments(tmp_path, context_parallel_size=2), world_size=8)
    assert split.describe() == (
        "8 processes = 4 data-parallel x 2 context-parallel (ours, all-to-all); DDP, gradients averaged over 8"
    )
    fsdp = dict(fsdp="full_shard", context_parallel_size=4, gaudi_device=CUDADevice())
    ring = ParallelLayout.from_arguments(arguments(tmp_path, **fsdp), world_size=8)
    assert ring.describe() == (
        "8 processes = 2 data-parallel x 4 context-parallel (torch's ring attention); FSDP, parameters sharded over 2"
    )
    engine = ParallelLayout.from_arguments(arguments(tmp_path, deepspeed={"zero_optimization": {}}), world_size=4)
    assert engine.describe() == "4 processes = 4 data-parallel; DeepSpeed's engine"


def test_host_groups_wait_an_nccl_default_groups_own_timeout(tmp_path, monkeypatch):
    """NCCL's groups honour the timeout they are given (host_group.TIMED_BACKENDS; torch's ProcessGroupNCCL.cpp: its
    watchdog aborts a collective past it, read there, no NCCL here): a default group read as NCCL's (a gloo group of
    one standing in, its backend named "nccl") gives the host groups its own timeout, as a gloo one does, where an
    hccl one gives the run's --ddp_timeout."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from optimum_gaudi.distributed import host_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=5))  # fmt: skip
    try:
        for backend, expected in (("nccl", 5), ("hccl", 7)):
            monkeypatch.setattr(host_group, "_backend_of", lambda group, device, name=backend: name)
            assert host_group.group_timeout(7) == timedelta(seconds=expected), backend
            layout = ParallelLayout(world_size=1, ddp_timeout=7)
            made = layout.host_group()._get_backend(torch.device("cpu")).options._timeout
            assert made == timedelta(seconds=expected), backend
    finally:
        dist.destroy_process_group()
