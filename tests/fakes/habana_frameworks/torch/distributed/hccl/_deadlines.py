"""TEST DOUBLE: what the bridge's HCCL group does not give a job that stalls (HabanaAI/gaudi-pytorch-bridge 1.19.0).

- No timeout: ``distributed/hccl/__init__.py`` ``_create_process_group_hccl`` builds ``ProcessGroupHCCL`` from the
  store, rank, size and group name, dropping the options' timeout; ``ProcessGroupHCCL.cpp`` ``WorkHCCL::wait`` and
  ``process_group_hccl_base.cpp`` ``CoalescedWorkHCCL::wait`` ignore theirs. The simulated group moves its data
  through gloo, given :data:`NO_DEADLINE` here.
- ``barrier`` is ``hostBarrier()`` (``process_group_hccl_base.cpp``): every rank adds one to a store key and polls
  it until it reaches the group's size, with no deadline; three keys in turn, rank 0 deleting the previous one.
- No collective count: ``getSequenceNumberForGroup`` returns ``seqCollective_``, which nothing increments, and
  torch's ``ProcessGroup._get_sequence_number_for_group`` refuses a custom backend before asking it anyway.
- No flight record: nothing in the bridge calls torch's ``FlightRecorder``. The simulated group's gloo transport
  records its collectives there; :func:`keep_out_of_the_flight_recorder` takes them out of torch's dump.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

# gloo needs a timeout: one no test outlives (a year in milliseconds fits gloo's clock arithmetic)
NO_DEADLINE = timedelta(days=365)
_BARRIER_KEYS = 3  # process_group_hccl_base.cpp kNumBarrierKeys
# the bridge polls every millisecond; the simulator backs off to 50 ms (same outcome, less of two shared CPU cores)
_POLL_SECONDS = (0.001, 0.05)


def _barrier_key(count: int, size: int) -> str:
    return f"{count}HOST_BARRIER:{size}"


def host_barrier(store: Any, rank: int, size: int, count: int) -> int:
    """``ProcessGroupHcclBase::hostBarrier``: wait, with no deadline, until every rank of the group arrived.
    Returns the next barrier's counter."""
    key = _barrier_key(count, size)
    arrived = store.add(key, 1)
    if arrived > size:
        raise RuntimeError("Host barrier Key error")
    pause = _POLL_SECONDS[0]
    while store.add(key, 0) != size:  # add(key, 0) reads without the store's wait (and its timeout)
        time.sleep(pause)
        pause = min(2 * pause, _POLL_SECONDS[1])
    if rank == 0:
        store.delete_key(_barrier_key((count - 1) % _BARRIER_KEYS, size))
    return (count + 1) % _BARRIER_KEYS


def _without_transport(dump: dict) -> dict:
    """The dump less the simulated groups' gloo transport, whose groups torch never named (name and
    description empty: every group torch makes has a name)."""
    ours = {e.get("pg_id") for e in dump.get("entries", []) if list(e.get("process_group") or []) == ["", ""]}
    dump["entries"] = [e for e in dump.get("entries", []) if list(e.get("process_group") or []) != ["", ""]]
    dump.get("pg_config", {}).pop("", None)
    for pg_id in ours:
        dump.get("pg_status", {}).pop(str(pg_id), None)
    return dump


def keep_out_of_the_flight_recorder() -> Callable[[], None]:
    """Filter torch's JSON flight-recorder dump (``_dump_fr_trace_json``, what the watchdog reads) so that the
    simulated HCCL group's collectives are not in it, as the bridge's are not. Returns how to take it back."""
    c10d = torch._C._distributed_c10d
    original = getattr(c10d, "_dump_fr_trace_json", None)
    if original is None:
        return lambda: None

    def dump_json(*args: Any, **kwargs: Any) -> str:
        return json.dumps(_without_transport(json.loads(original(*args, **kwargs))))

    c10d._dump_fr_trace_json = dump_json

    def undo() -> None:
        c10d._dump_fr_trace_json = original

    return undo
