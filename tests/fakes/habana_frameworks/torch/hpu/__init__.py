"""TEST DOUBLE of ``habana_frameworks.torch.hpu``: device queries, memory API, dynamic shapes and, in lazy
mode only, HPU graphs.

Follows ``hpu/__init__.py``: the graph API (HPUGraph, graph, make_graphed_callables, ModuleCacher,
wrap_in_hpu_graph, from ``hpu/graphs.py``) is exported only when the bridge is in lazy mode
(``utils/internal.py`` ``is_lazy``, decided once); ``is_lazy`` itself is importable from here;
``enable_dynamic_shape`` / ``disable_dynamic_shape`` / ``get_dynamic_shape_status`` switch the bridge's
dynamic-shape support (here a flag, initially PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES=1 or not).

FAKE_HPU_DEVICE_COUNT (default 1) sets how many Gaudis the simulator reports; 0 simulates a machine
with the bridge installed but no device.
"""

import os

import habana_frameworks as _hf

from ..utils.internal import is_lazy
from .memory import (  # noqa: F401
    max_memory_allocated,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_peak_memory_stats,
)

if is_lazy():
    from .graphs import HPUGraph, ModuleCacher, graph, make_graphed_callables, wrap_in_hpu_graph  # noqa: F401

_dynamic_shapes = os.environ.get("PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", "0") == "1"


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
    return os.environ.get("FAKE_HPU_DEVICE_NAME", "GAUDI2")  # "GAUDI", "GAUDI2" or "GAUDI3", as the bridge's tests


def synchronize() -> None:
    _hf.record("hpu.synchronize")


def enable_dynamic_shape():
    global _dynamic_shapes
    _hf.record("hpu.enable_dynamic_shape")
    _dynamic_shapes = True


def disable_dynamic_shape():
    global _dynamic_shapes
    _hf.record("hpu.disable_dynamic_shape")
    _dynamic_shapes = False


def get_dynamic_shape_status() -> bool:
    return _dynamic_shapes
