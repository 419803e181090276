"""Collectives counted by the project itself, per group, where the backend keeps no count (issue 46, point 4).

The progress watchdog tells a rank in an endless loop, or in a collective the others never join, from ranks that
merely wait by the number of collectives each issued: the ranks waiting went on to the next collective, the rank
stuck did not. torch keeps that number in each group (``_get_sequence_number_for_group``) for its own backends;
for a custom one, such as the Gaudi bridge's HCCL, it raises, so every rank would read alike. There, and only while
the watchdog runs, this module counts (also where torch's flight recorder cannot name the collective a rank waits
in: gloo on torch 2.6 and 2.7):

- every collective called through torch.distributed's Python functions (the trainer's own, fast_ddp's, FSDP2's,
  accelerate's, transformers', torch.distributed.checkpoint's, DeepSpeed's ``deepspeed.comm``): the functions of
  ``torch.distributed`` and ``torch.distributed.distributed_c10d`` are replaced by ones that count, per group,
  and remember the collective and its call site (the caller's file, line and function), then call torch's;
- DDP's gradient buckets, which its C++ reducer all-reduces out of Python's sight: through a DDP communication
  hook that counts, then does what the reducer does without one (it scales each gradient by 1 / group size as it
  copies it into the bucket, then all-reduces the bucket with SUM): the same operations on the same values, so the
  same bits (``test_collective_count.py`` compares gradients with and without it).

What it cannot see is said where it matters (docs/collectives.md): collectives traced into a compiled graph (a
functional collective, ``torch.ops._c10d_functional``, as DTensor's and torch.compile's), those C++ issues of its
own (DDP's initial broadcast and unused-parameter bookkeeping), and Python code that took a reference to torch's
function before the count began. Each is issued alike on every rank, so the counts still agree on ranks that keep
pace. The cost is a few attribute reads and a dictionary increment per collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..launch.ranks import FLIGHT_RECORDER_ENV, NCCL_FLIGHT_RECORDER_ENV

logger = logging.getLogger(__name__)

# name -> position of its ``group`` argument: the collectives of torch.distributed's Python API (not send / recv,
# which pair two ranks and count differently on each)
COLLECTIVES = {
    "all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3, "reduce_scatter": 3,
    "broadcast": 2, "all_to_all_single": 4, "all_to_all": 2, "gather": 3, "scatter": 3, "reduce": 3, "barrier": 0,
    "all_gather_object": 2, "broadcast_object_list": 2, "gather_object": 3, "scatter_object_list": 3,
    "all_reduce_coalesced": 2, "_all_gather_base": 2, "_reduce_scatter_base": 3, "monitored_barrier": 0,
}  # fmt: skip
DEFAULT = "default"  # the key of the default group
_MODULES = (dist, dist.distributed_c10d)


@dataclass(slots=True)
class Issued:
    """The last collective a group saw from this rank."""

    collective: str
    number: int  # its place in the group's count
    code: Any  # the caller's code object and line (None: DDP's reducer), formatted only when a report reads them
    line: int
    at: float  # time.monotonic() when issued
    returned: bool = False  # a blocking call that came back (an asynchronous one is never known to)

    @property
    def site(self) -> str:
        if self.code is None:
            return _DDP_SITE
        path = self.code.co_filename.replace("\\", "/").split("/site-packages/", 1)[-1]
        return f"{path}:{self.line} ({self.code.co_name})"


class CollectiveCount:
    """The counts of one process, per group (``DEFAULT`` for the default group, else the group's name)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last: dict[str, Issued] = {}

    def issued(self, collective: str, group: Any, code: Any = None, line: int = 0) -> Issued:
        key = DEFAULT if group is None or group is dist.GroupMember.WORLD else group_key(group)
        number = self.counts.get(key, 0) + 1
        self.counts[key] = number
        record = self.last[key] = Issued(collective, number, code, line, time.monotonic())
        return record

    def default_count(self) -> int:
        return self.counts.get(DEFAULT, 0)

    def waiting_in(self) -> str | None:
        """The collective this rank waits in: the newest that did not come back, else the newest issued."""
        if not self.last:
            return None
        pending = [(key, r) for key, r in self.last.items() if not r.returned] or list(self.last.items())
        key, record = max(pending, key=lambda item: item[1].at)
        group = "the default group" if key == DEFAULT else f"group {key}"
        return (
            f"{record.collective} on {group} (its collective {record.number}, issued "
            f"{time.monotonic() - record.at:.1f} s ago, from {record.site}; optimum-gaudi's count)"
        )


_active: CollectiveCount | None = None
_users = 0  # the start()s not yet stopped: a trainer training inside another's train() shares the count
_originals: dict[str, Any] = {}  # torch's functions, while replaced


class _Depth(threading.local):
    n = 0  # an object collective calls others: only the outermost call counts


_depth = _Depth()


def group_key(group: Any) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return DEFAULT
    return str(getattr(group, "group_name", id(group)))


def backend_counts(group: Any = None) -> bool:
    """Whether the group's backend numbers its collectives (torch's own backends do; a custom one, HCCL, not)."""
    group = group if group is not None else dist.GroupMember.WORLD
    try:
        group._get_sequence_number_for_group()
    except Exception:
        return False
    return True


def flight_record_dump(backend: str | None = None) -> Callable[[bool, bool], str] | None:
    """torch's JSON dump of the flight recorder that holds ``backend``'s collectives (the default group's when None),
    where it records them: NCCL into a recorder of its own (``_dump_nccl_trace_json``, on every torch the project
    supports), gloo into the generic one (``_dump_fr_trace_json``, torch 2.8 and later); None where torch records
    nothing of the backend (a custom one: HCCL) or its recorder was left off (its buffer size, read from the
    environment when the first group is made: launch/ranks.py's ``enable_flight_recorder``)."""
    c10d = torch._C._distributed_c10d
    backend = _default_backend() if backend is None else backend
    if "nccl" in backend:
        dump = getattr(c10d, "_dump_nccl_trace_json", None)
        sizes = (
            (FLIGHT_RECORDER_ENV, NCCL_FLIGHT_RECORDER_ENV)
            if generic_flight_recorder()
            else (NCCL_FLIGHT_RECORDER_ENV,)
        )
    elif "gloo" in backend:
        dump, sizes = getattr(c10d, "_dump_fr_trace_json", None), (FLIGHT_RECORDER_ENV, NCCL_FLIGHT_RECORDER_ENV)
    else:
        return None
    size = next((os.environ[name] for name in sizes if name in os.environ), "0")  # the one torch reads
    with contextlib.suppress(ValueError):
        return dump if int(size) > 0 else None
    return None


def generic_flight_recorder() -> bool:
    """Whether this torch has the flight recorder every backend may record into (torch 2.8's
    ``_dump_fr_trace_json``); before, only NCCL records, into its own."""
    return hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")


def flight_recorder_names_collectives(backend: str | None = None) -> bool:
    """Whether torch's flight recorder can name the collective a rank of ``backend`` (the default group's) waits in:
    gloo's from torch 2.8 (Gaudi 1.20-1.22 ship 2.6 and 2.7), NCCL's on every torch, a custom backend's never."""
    return flight_record_dump(backend) is not None


def _default_backend() -> str:
    """The default group's backend, as torch names it ("gloo", "nccl", "cpu:gloo,cuda:nccl", "hccl"), or ""."""
    with contextlib.suppress(Exception):
        return str(dist.get_backend())
    return ""


def active() -> CollectiveCount | None:
    return _active


def start(ddp_model: Any = None) -> CollectiveCount | None:
    """Count from now, where the default group's backend keeps no count or torch's flight recorder cannot say what a
    rank waits in; None (nothing done) where both can. A start while a count runs (a second trainer's train() inside
    the first's, transformers' training loop begun again by ``--auto_find_batch_size``) shares that count and still
    hooks its own DDP module; each start that returned a count is ended by one :func:`stop`."""
    global _active, _users
    if _active is None:
        if not dist.is_initialized() or backend_counts() and flight_recorder_names_collectives():
            return None
        _active = CollectiveCount()
        _replace_torch_functions()
    _users += 1
    if ddp_model is not None:
        count_ddp_reductions(ddp_model)
    return _active


def _replace_torch_functions() -> None:
    for name, position in COLLECTIVES.items():
        original = getattr(dist.distributed_c10d, name, None)
        if original is None:  # not in this torch release
            continue
        _originals[name] = original
        counting = _counting(name, position, original)
        for module in _MODULES:
            if getattr(module, name, None) is original:
                setattr(module, name, counting)


def stop() -> None:
    """End one :func:`start`'s share; with the last, put torch's functions back (code that took a counting one keeps
    it, which then only calls torch's). A DDP module keeps the counting hook (DDP cannot remove one): without a
    count it only reduces, as the reducer does."""
    global _active, _users
    _users = max(0, _users - 1)
    if _users:
        return
    for name, original in _originals.items():
        for module in _MODULES:
            if getattr(getattr(module, name, None), "__wrapped__", None) is original:
                setattr(module, name, original)
    _originals.clear()
    _active = None


def _counting(name: str, position: int, original: Any) -> Any:
    compiling = torch.compiler.is_compiling

    def counting(*args: Any, **kwargs: Any) -> Any:
        count = _active
        if compiling() or count is None or _depth.n:  # first: dynamo folds it and traces torch's own function
            return original(*args, **kwargs)
        group = kwargs.get("group", args[position] if len(args) > position else None)
        caller = sys._getframe(1)
        record = count.issued(name, group, caller.f_code, caller.f_lineno)
        _depth.n = 1
        try:
            result = original(*args, **kwargs)
        finally:
            _depth.n = 0
        if not kwargs.get("async_op", False):
            record.returned = True
        return result

    counting.__wrapped__ = original
    counting.__name__ = counting.__qualname__ = name
    counting.__doc__ = original.__doc__
    return counting


# ---- DDP's reducer ---------------------------------------------------------------------------------------------


def ddp_hook_is_exact(gradient_as_bucket_view: bool, group_size: int) -> bool:
    """Whether the counting hook gives the reducer's bits. Without a hook the reducer multiplies each gradient by
    1 / size as it copies it into the bucket, but divides it by the size where the gradient already is the bucket's
    view (``gradient_as_bucket_view``, from the second step on); the hook sees the bucket only and multiplies.
    Both give the same bits where the size is a power of two (x * 2^-k is exact); elsewhere only without views."""
    return not gradient_as_bucket_view or group_size & (group_size - 1) == 0


def count_ddp_reductions(model: Any) -> bool:
    """Install the counting hook on a DDP module (once; not over a hook of the user's). Returns whether it is on."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    hooks = getattr(model, "_comm_hooks", None)
    if hooks is None or any(hook is _count_and_reduce for hook, _ in hooks):
        return hooks is not None
    group = model.process_group
    if hooks or not ddp_hook_is_exact(model.gradient_as_bucket_view, group.size()):
        why = "a communication hook is already registered"
        if not hooks:
            why = "gradients are bucket views and the group size is not a power of two: a hook would change bits"
        logger.info(
            "DDP's gradient reductions are not counted for the progress watchdog (%s): a rank stuck in its "
            "forward or backward is told from the others by its step only.",
            why,
        )
        return False
    model.register_comm_hook(group, _count_and_reduce)
    return True


_DDP_SITE = "DDP's reducer (a gradient bucket, during backward)"


def _count_and_reduce(group, bucket):  # noqa: ANN001, ANN202 (DDP's check reads the annotations: none here)
    """The reducer's own reduction without a hook, counted: scale by 1 / size, all-reduce with SUM."""
    count = _active
    if count is not None:
        count.issued("all_reduce", group)
    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())
    reduce = _originals.get("all_reduce", dist.distributed_c10d.all_reduce)
    work = reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])
