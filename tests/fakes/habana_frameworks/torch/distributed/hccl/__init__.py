"""TEST DOUBLE of ``habana_frameworks.torch.distributed.hccl``.

Follows ``distributed/hccl/__init__.py``: importing it calls ``initialize_distributed_hpu()``, which

- unless RANK, WORLD_SIZE and LOCAL_RANK are all set, copies OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK
  into them when all three Open MPI variables are there;
- sets MASTER_ADDR=localhost and MASTER_PORT=12345 when they are missing;
- sets HLS_MODULE_ID (the card this process opens) from LOCAL_RANK when there are several processes,
  through HABANA_VISIBLE_MODULES when set, unless HLS_MODULE_ID is already set;
- sets ID to the rank;

then registers the 'hccl' torch.distributed backend. Here 'hccl' is an alias of gloo on CPU, so
``init_process_group(backend="hccl")`` works in a CPU test.
"""

import os

import torch.distributed as dist

import habana_frameworks as _hf

_MPI_TO_TORCH = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK": "RANK",
}


def _environment_from_mpi():
    if all(name in os.environ for name in _MPI_TO_TORCH.values()):
        return
    if all(name in os.environ for name in _MPI_TO_TORCH):
        for mpi_name, torch_name in _MPI_TO_TORCH.items():
            os.environ[torch_name] = os.environ[mpi_name]
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12345")


def _module_id(local_rank, world_size):
    if "HLS_MODULE_ID" in os.environ or local_rank == -1 or world_size == 1:
        return
    visible = os.environ.get("HABANA_VISIBLE_MODULES")
    if visible is not None:
        modules = visible.split(",")
        assert local_rank < len(modules), "There is not enough devices available for training."
        os.environ["HLS_MODULE_ID"] = modules[local_rank]
    else:
        os.environ["HLS_MODULE_ID"] = str(local_rank)


def initialize_distributed_hpu(world_size=None, rank=None, local_rank=None):
    """Returns (world_size, rank, local_rank): the given values (then exported), else those of the environment."""
    _hf.record("distributed.hccl.initialize_distributed_hpu", world_size=world_size, rank=rank, local_rank=local_rank)
    if None not in (world_size, rank, local_rank):
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(local_rank))
    else:
        _environment_from_mpi()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", -1))
    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    _module_id(local_rank, world_size)
    if rank != -1:
        os.environ["ID"] = str(rank)
    return world_size, rank, local_rank


initialize_distributed_hpu()


def _create_process_group_hccl(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if dist.is_available() and hasattr(dist, "ProcessGroupGloo"):
    dist.Backend.register_backend("hccl", _create_process_group_hccl, devices=["cpu"])
    _hf.record("distributed.hccl.register", backend="hccl", alias_of="gloo")
else:
    _hf.record("distributed.hccl.register", backend="hccl", alias_of=None)
