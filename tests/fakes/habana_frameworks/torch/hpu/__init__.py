"""TEST DOUBLE of ``habana_frameworks.torch.hpu``: device queries, memory API and, in lazy mode, HPU graphs.

FAKE_HPU_DEVICE_COUNT (default 1) sets how many Gaudis the simulator reports; 0 simulates a machine
with the bridge installed but no device. As in the real module, the graph API (ModuleCacher,
wrap_in_hpu_graph, HPUGraph, graph, make_graphed_callables) is only exported when the module is imported
in lazy mode (PT_HPU_LAZY_MODE unset or not "0").
"""

import os

import habana_frameworks as _hf

from .memory import (  # noqa: F401
    max_memory_allocated,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_peak_memory_stats,
)

if _hf.is_lazy():
    from .graphs import HPUGraph, ModuleCacher, graph, make_graphed_callables, wrap_in_hpu_graph  # noqa: F401


def _count() -> int:
    return int(os.environ.get("FAKE_HPU_DEVICE_COUNT", "1"))


def is_available() -> bool:
    _hf.record("hpu.is_available")
    return _count() > 0


def device_count() -> int:
    _hf.record("hpu.device_count")
    return _count()


def current_device() -> int:
    _hf.record("hpu.current_device")
    return 0


def get_device_name(device=None) -> str:
    _hf.record("hpu.get_device_name", device=device)
    return "GAUDI2 (simulated)"


def synchronize() -> None:
    _hf.record("hpu.synchronize")
