"""TEST DOUBLE of ``habana_frameworks.torch.distributed.hccl``.

Importing the real module registers the 'hccl' torch.distributed backend. Here 'hccl' is registered as
an alias of gloo on CPU, so ``init_process_group(backend="hccl")`` works in a CPU test, and the
registration is recorded. The real module also fills in MASTER_ADDR/MASTER_PORT and other variables
from MPI ones when they are missing; this fake leaves the environment alone.
"""

import os

import torch.distributed as dist

import habana_frameworks as _hf


def _create_process_group_hccl(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def initialize_distributed_hpu(world_size=None, rank=None, local_rank=None):
    """Returns (world_size, rank, local_rank): the given values, else those of the environment."""
    _hf.record("distributed.hccl.initialize_distributed_hpu", world_size=world_size, rank=rank, local_rank=local_rank)
    if None in (world_size, rank, local_rank):
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        rank = int(os.environ.get("RANK", -1))
        local_rank = int(os.environ.get("LOCAL_RANK", -1))
    return world_size, rank, local_rank


if dist.is_available() and hasattr(dist, "ProcessGroupGloo"):
    dist.Backend.register_backend("hccl", _create_process_group_hccl, devices=["cpu"])
    _hf.record("distributed.hccl.register", backend="hccl", alias_of="gloo")
else:
    _hf.record("distributed.hccl.register", backend="hccl", alias_of=None)
