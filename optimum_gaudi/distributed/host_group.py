"""Host (gloo) groups and the timeout of every group the project makes.

The accelerator's backend (hccl on a Gaudi, nccl on CUDA) takes its own device's tensors only; the host
collectives (the save's rows, --async_save's writers, the straggler figures) are small messages a device copy
would only slow down, so they run over a gloo group of every rank, which the run's ``ParallelLayout``
(``distributed/layout.py``) makes and keeps (``layout.host_group(name)``).

Every group made there is given the run's ``--ddp_timeout``: ``torch.distributed.new_group`` without a timeout takes
torch's default of 30 minutes whatever the default group was given, so a rank that stopped would hold every other
rank that long. gloo and NCCL groups honour it; the Gaudi bridge's HCCL groups take no timeout at all (its
``_create_process_group_hccl`` drops it, ``ProcessGroupHCCL``'s ``wait`` ignores one, its barrier polls the store
with no deadline): on a Gaudi the sequence-parallel groups and the default group wait for ever, and only the
progress watchdog (``supervision/watchdog.py``) ends a stall there.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch


def honour_timeout(seconds: float | None) -> None:
    """Give the default group the run's ``--ddp_timeout`` where it was made without it: transformers passes it
    to ``init_process_group`` except when it runs on the CPU (its ``use_cpu`` branch), where a stalled rank
    then held the others for torch's default 30 minutes."""
    dist = torch.distributed
    if seconds is None:
        return
    wanted = timedelta(seconds=seconds)
    if not (dist.is_available() and dist.is_initialized()) or group_timeout(seconds) == wanted:
        return
    with contextlib.suppress(Exception):  # a private torch function; groups made here still get the timeout
        dist.distributed_c10d._set_pg_timeout(wanted)


TIMED_BACKENDS = ("gloo", "nccl")  # backends whose groups honour the timeout they are given (hccl's do not)


def group_timeout(seconds: float | None) -> timedelta | None:
    """How long a collective of a group made here may wait: the default group's own timeout where its backend
    honours one (what ``init_process_group`` was given: transformers passes ``--ddp_timeout``), else the run's
    ``seconds``, else None (torch's default). An hccl default group's timeout is never read: the bridge dropped
    it, and whatever stands in its place says nothing about how long a host group should wait."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        for device in getattr(world, "_device_types", ()):
            if _backend_of(world, device) not in TIMED_BACKENDS:
                continue
            with contextlib.suppress(Exception):  # a backend without readable options
                timeout = world._get_backend(device).options._timeout
                if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
                    return timeout
    return None if seconds is None else timedelta(seconds=seconds)


def _backend_of(group: Any, device: Any) -> str | None:
    """The backend name ``group`` was made with for ``device`` ("cpu:gloo,cuda:nccl" -> "gloo" for cpu)."""
    with contextlib.suppress(Exception):
        config = str(torch.distributed.get_backend_config(group))
        names = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
        return names.get(torch.device(device).type)
    return None
