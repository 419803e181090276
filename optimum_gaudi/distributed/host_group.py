"""A gloo group for collectives on host (CPU) tensors: the accelerator's backend (hccl on a Gaudi, nccl on CUDA)
takes its own device's tensors only, and these are small messages a device copy would only slow down.

Every group made here (and the sequence-parallel groups) waits as long as the default group does, the run's
``--ddp_timeout``: ``torch.distributed.new_group`` without a timeout takes torch's default of 30 minutes whatever
the default group was given, so a rank that stopped would hold every other rank that long.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch

_groups: dict[str, tuple[Any, Any]] = {}  # name -> (the default group it was made beside, the gloo group)
_timeout: timedelta | None = None  # the run's --ddp_timeout, where the default group does not say its own


def set_group_timeout(seconds: float | None) -> None:
    """The run's ``--ddp_timeout``, for groups made when the default group's own timeout cannot be read."""
    global _timeout
    _timeout = None if seconds is None else timedelta(seconds=seconds)


def honour_timeout(seconds: float) -> None:
    """Give the default group the run's ``--ddp_timeout`` where it was made without it: transformers passes it
    to ``init_process_group`` except when it runs on the CPU (its ``use_cpu`` branch), where a stalled rank
    then held the others for torch's default 30 minutes."""
    set_group_timeout(seconds)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or group_timeout() == _timeout:
        return
    with contextlib.suppress(Exception):  # a private torch function; groups made here still get the timeout
        dist.distributed_c10d._set_pg_timeout(_timeout)


def group_timeout() -> timedelta | None:
    """How long a collective of a group made here may wait: the default group's own timeout (what
    ``init_process_group`` was given: transformers passes ``--ddp_timeout``), else the run's setting, else None
    (torch's default)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        for device in getattr(world, "_device_types", ()):
            with contextlib.suppress(Exception):  # a backend without readable options (the Gaudi bridge's hccl)
                timeout = world._get_backend(device).options._timeout
                if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
                    return timeout
    return _timeout


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> Any:
    """``torch.distributed.new_group`` with the run's timeout (a collective: every rank calls it)."""
    return torch.distributed.new_group(ranks, timeout=group_timeout(), backend=backend)


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
        made = _groups[name] = (world, new_group(backend="gloo"))
    return made[1]
