"""The parallel layout of a run: every degree, checked once, the one choice of context parallelism, and every
process group the project makes.

Built once from the training arguments and the launched world (``ParallelLayout.from_arguments``, when the
arguments are made; they keep it as ``args.parallel_layout``), as torchtitan's ``ParallelDims`` is: the trainer,
the sampler's sharding, the throughput figures and FSDP's context parallelism ask it rather than work the
degrees out again.

``--context_parallel_size N`` runs one of two implementations, chosen here only:

- ``"torch"``: torch's context parallelism (ring attention) through accelerate, where FSDP2 runs and torch has a
  sharding rule for the device's SDPA kernels (``Device.torch_context_parallel``: CUDA), or where the user gave
  transformers' ``parallelism_config`` itself. accelerate's ``ParallelismConfig`` expresses that layout (FSDP over
  world / N, cp N) and the arguments hand it to transformers;
- ``"all_to_all"``: ours (``distributed/sequence_parallel.py``, Ulysses all-to-all around the attention registry),
  everywhere else. accelerate's ``sp_size`` names DeepSpeed's Ulysses only, so ``ParallelismConfig`` does not
  express it, and none is made.

The layout holds no training state: each trainer gets its own ``SequenceParallel`` (its model's local kernel,
the step being split), so two trainers of one process never share a split. The process groups, which depend on
the ranks only, are made once per layout (and per default group), each with the run's ``--ddp_timeout``, and
destroyed when the layout is collected (with the arguments that hold it), so a process that builds many runs does
not keep every run's groups.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .host_group import group_timeout
from .sequence_parallel import LOCAL_KERNELS, SequenceParallel

CP_ALL_TO_ALL = "all_to_all"  # ours: distributed/sequence_parallel.py
CP_TORCH = "torch"  # torch's context parallelism through accelerate's ParallelismConfig


def argument_problem(args: Any, world_size: int) -> str | None:
    """Why ``--context_parallel_size`` cannot run with these arguments, in one line; None when it can. The degrees
    are the layout's own to check (:meth:`ParallelLayout.problems`); the rest is how they meet the other flags."""
    size = args.context_parallel_size
    degrees = ParallelLayout(world_size=world_size, cp_size=size).problems()
    if degrees:
        return degrees[0]
    if size == 1:
        return None
    flag = f"--context_parallel_size {size}"
    from transformers import Trainer, __version__

    if not hasattr(Trainer, "get_cp_size"):  # where the trainer scales the loss and batch size by the split
        return f"{flag} needs a transformers release whose Trainer has get_cp_size (5.x); this is {__version__}."
    config = getattr(args, "parallelism_config", None)
    if config is not None and (config.cp_size, config.sp_size) != (size, 1):
        return f"{flag} and transformers' parallelism_config split the sequences differently; give one of them."
    if args.attn_implementation is not None and args.attn_implementation not in LOCAL_KERNELS:
        return f"{flag} runs attention with sdpa, eager or gaudi_fused_sdpa, not {args.attn_implementation}."
    if args.label_smoothing_factor:
        return f"{flag} cannot be combined with --label_smoothing_factor (it reads the slice's own labels); drop one."
    if args.use_hpu_graphs_for_training:  # a replayed graph would not run the all-to-all's collective
        return f"{flag} cannot be combined with --use_hpu_graphs_for_training yet (its all-to-all runs eagerly); drop one of them."  # fmt: skip
    return None


# Backends whose group is destroyed by each rank alone. Not the Gaudi's: ProcessGroupHCCL::destroy (the bridge's
# python_packages/habana_frameworks/torch/distributed/hccl/ProcessGroupHCCL.cpp) starts with hostBarrier(), a store
# poll with no deadline, so a rank collecting its layout before the others would wait for them forever.
_DESTROYED_ALONE = ("gloo",)


def _destroy_groups(groups: dict[str, tuple[Any, Any]]) -> None:
    """A collected layout's gloo groups destroyed, those of the default group they were made under only: destroying
    the default group destroys every group made beside it. Groups of a backend whose destroy waits for every rank
    (hccl) stay in torch's registry to the end of the process, as every group did before."""
    dist = torch.distributed
    for world, group in groups.values():
        if dist.is_available() and dist.is_initialized() and dist.group.WORLD is world:
            with contextlib.suppress(ValueError):  # "Invalid process group": its user destroyed it already
                if str(dist.get_backend(group)) in _DESTROYED_ALONE:
                    dist.destroy_process_group(group)
    groups.clear()


@dataclass(frozen=True)
class ParallelLayout:
    """The degrees of one run. ``world_size`` processes; each sequence split over ``cp_size`` of them by
    ``cp_implementation`` (None: no split); model sharded by FSDP (``fsdp``), left to DeepSpeed's engine
    (``deepspeed``) or replicated (DDP, ``fast_ddp``)."""

    world_size: int = 1
    cp_size: int = 1
    cp_implementation: str | None = None
    fsdp: bool = False
    fast_ddp: bool = False  # one fused gradient all-reduce instead of DDP (several processes only)
    deepspeed: bool = False  # DeepSpeed's engine holds the model and reduces its gradients (--deepspeed)
    ddp_timeout: float | None = None  # how long a collective of a group made here may wait (--ddp_timeout)
    # not an argument: a layout made by dataclasses.replace starts with no groups, as a copy does (__getstate__)
    _groups: dict[str, tuple[Any, Any]] = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def from_arguments(cls, args: Any, world_size: int) -> ParallelLayout:
        """The layout the arguments ask for on ``world_size`` processes; ``argument_problem`` has said None."""
        given = getattr(args, "parallelism_config", None)  # transformers' own: its cp_size is the flag's, or 1
        size = args.context_parallel_size
        if size == 1 and given is not None:
            size = given.cp_size
        implementation = None
        if size > 1:
            torch_cp = bool(args.fsdp) and args.gaudi_device.torch_context_parallel
            implementation = CP_TORCH if torch_cp or given is not None else CP_ALL_TO_ALL
        return cls(
            world_size=world_size,
            cp_size=size,
            cp_implementation=implementation,
            fsdp=bool(args.fsdp),
            fast_ddp=args.distribution_strategy == "fast_ddp" and world_size > 1,
            deepspeed=bool(args.deepspeed),
            ddp_timeout=args.ddp_timeout,
        )

    # ---- the degrees -------------------------------------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches: the ranks splitting one sequence train (and count) one batch."""
        return self.world_size // self.cp_size

    @property
    def dp_shard_size(self) -> int:
        """Ranks a model's parameters are sharded over: FSDP's mesh (world / N under torch's context parallelism,
        whose ring shares the shards; the whole world under ours, whose ranks hold the same model); 1 without FSDP."""
        if not self.fsdp:
            return 1
        return self.data_parallel_size if self.cp_implementation == CP_TORCH else self.world_size

    @property
    def dp_replicate_size(self) -> int:
        """Ranks holding whole replicas whose gradients are averaged (DDP, fast_ddp): 1 under FSDP."""
        return 1 if self.fsdp else self.world_size

    def parallelism_config(self) -> Any:
        """accelerate's ``ParallelismConfig`` for torch's context parallelism (FSDP over world / N, cp N), the
        layout transformers and accelerate run it from; None for every other layout (none of them needs one)."""
        if self.cp_implementation != CP_TORCH:
            return None
        from accelerate import ParallelismConfig

        return ParallelismConfig(dp_shard_size=self.data_parallel_size, cp_size=self.cp_size)

    # ---- its own check and its line in the log -----------------------------------------------------------------

    def problems(self) -> list[str]:
        """What cannot run in these degrees, one line each; empty when they can. torchtitan's ``ParallelDims``
        checks its degrees in ``__post_init__``; here the arguments ask (``argument_problem``) and raise the first
        as their one-line error, before a device or a process group exists."""
        size = self.cp_size
        if not isinstance(size, int) or size < 1:
            return [f"--context_parallel_size must be >= 1, got {size!r}."]
        if self.world_size % size:
            return [
                f"--context_parallel_size {size} splits each sequence over {size} processes and this run has "
                f"{self.world_size}: launch a multiple of {size} (optimum-gaudi launch --world_size {size} ...)."
            ]
        return []

    def describe(self) -> str:
        """The layout in one line, for the run's log: the processes, how they divide into data- and
        context-parallel ranks, and what keeps their weights in step."""
        if self.world_size == 1 and not (self.fsdp or self.deepspeed):
            return "1 process: no data or context parallelism"
        processes = (
            f"{self.world_size} process{'es' if self.world_size > 1 else ''} = {self.data_parallel_size} data-parallel"
        )
        if self.cp_size > 1:
            how = "ours, all-to-all" if self.cp_implementation == CP_ALL_TO_ALL else "torch's ring attention"
            processes += f" x {self.cp_size} context-parallel ({how})"
        if self.fsdp:
            weights = f"FSDP, parameters sharded over {self.dp_shard_size}"
        elif self.deepspeed:
            weights = "DeepSpeed's engine"
        elif self.fast_ddp:
            weights = f"fast_ddp, one fused gradient all-reduce over {self.dp_replicate_size}"
        else:
            weights = f"DDP, gradients averaged over {self.dp_replicate_size}"
        return f"{processes}; {weights}"

    def __str__(self) -> str:
        return self.describe()

    # ---- the process groups ------------------------------------------------------------------------------------

    def new_group(self, ranks: list[int] | None = None, backend: str | None = None) -> Any:
        """``torch.distributed.new_group`` with the run's timeout (a collective: every rank calls it)."""
        return torch.distributed.new_group(ranks, timeout=group_timeout(self.ddp_timeout), backend=backend)

    def _made(self, name: str, make: Any) -> Any:
        """The group ``name``, made once per default group (destroyed and made again: a new one beside it). The
        layout's groups are destroyed when it is collected; torch's registry would keep them to the end of the
        process otherwise."""
        world = torch.distributed.group.WORLD
        made = self._groups.get(name)
        if made is None or made[0] is not world:
            if not self._groups:  # the first group of this layout (a copy starts with none of its own)
                weakref.finalize(self, _destroy_groups, self._groups).atexit = False
            made = self._groups[name] = (world, make())
        return made[1]

    def host_group(self, name: str = "host") -> Any:
        """A gloo group of every rank for collectives on host tensors (``distributed/host_group.py``), made once
        under ``name``; None where no process group is initialised. Made on first use, a collective: every rank
        asks at the same point. Users that run at the same time on other threads (--async_save's writers) each
        take a name of their own."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return self._made(name, lambda: self.new_group(backend="gloo"))

    def sequence_group(self) -> Any:
        """This rank's group of ``cp_size`` consecutive ranks, which split one sequence. Every rank makes every
        group, in the same order (``new_group`` is a collective)."""

        def make() -> Any:
            rank, mine = torch.distributed.get_rank(), None
            for index in range(self.data_parallel_size):
                group = self.new_group(list(range(index * self.cp_size, (index + 1) * self.cp_size)))
                if index == rank // self.cp_size:
                    mine = group
            return mine

        return self._made("sequence_parallel", make)

    def sequence_parallel(self) -> Any:
        """A new ``SequenceParallel`` for one trainer where the split is ours (its own model's kernel and steps,
        the layout's groups); None otherwise. Called once the default group exists."""
        if self.cp_implementation != CP_ALL_TO_ALL:
            return None
        index = torch.distributed.get_rank() // self.cp_size
        return SequenceParallel(self.cp_size, self.sequence_group(), self.data_parallel_size, index)

    def __getstate__(self) -> dict[str, Any]:
        """Copied or pickled with the arguments: the degrees, not the process groups (made again on first use)."""
        return {**self.__dict__, "_groups": {}}
