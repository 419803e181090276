"""A gloo group for collectives on host (CPU) tensors: the accelerator's backend (hccl on a Gaudi, nccl on CUDA)
takes its own device's tensors only, and these are small messages a device copy would only slow down."""

from __future__ import annotations

from typing import Any

import torch

_groups: dict[str, tuple[Any, Any]] = {}  # name -> (the default group it was made beside, the gloo group)


def host_group(name: str = "host") -> Any:
    """A gloo group of every rank, made once per process (and per default group) under ``name``; None where no
    process group is initialised. ``new_group`` is a collective: every rank asks at the same point. Users that
    run at the same time on other threads (--async_save's writers) each take a name of their own."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    made = _groups.get(name)
    if made is None or made[0] is not world:  # a new default group (destroyed and made again): a new one beside it
        made = _groups[name] = (world, dist.new_group(backend="gloo"))
    return made[1]
