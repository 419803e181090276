"""TEST DOUBLE of ``habana_frameworks.torch.hpu``: device queries, memory API, dynamic shapes and, in lazy
mode only, HPU graphs.

Follows ``hpu/__init__.py``: the graph API (HPUGraph, graph, make_graphed_callables, ModuleCacher,
wrap_in_hpu_graph, from ``hpu/graphs.py``) is exported only when the bridge is in lazy mode
(``utils/internal.py`` ``is_lazy``, decided once); ``is_lazy`` itself is importable from here;
``enable_dynamic_shape`` / ``disable_dynamic_shape`` / ``get_dynamic_shape_status`` switch the bridge's
dynamic-shape support (here a flag, initially PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES=1 or not; per thread in lazy
mode, as ``backend/helpers/dynamic_shape_info.cpp`` keeps it).

FAKE_HPU_DEVICE_COUNT (default 1) sets how many Gaudis the machine has (``device_count``, the bridge's
synDeviceGetCount, closed source); 0 simulates a machine with the bridge installed but no device.

One device per process, as the bridge: the process opens one Gaudi, its module HLS_MODULE_ID, which torch
sees as hpu:0 (``backend/habana_device/HPUDevice.cpp``), so ``current_device()`` is 0 and ``set_device``
only checks and remaps the index it is given to that module, in the environment (``hpu/__init__.py``).

As the real module, it also exports the random API (``from .random import *``), ``init`` / ``_lazy_init`` /
``is_initialized``, ``is_bf16_supported`` (true where a device is) and the autocast queries; with the simulated
device (FAKE_HPU_DEVICE=1) the autocast state is torch's for device type 'hpu'.
"""

import contextlib
import os
import threading

import torch

import habana_frameworks as _hf

from ..utils.internal import is_lazy
from ._utils import (
    HABANA_VISIBLE_MODULES_VAR,
    HLS_MODULE_ID_VAR,
    _get_available_modules_from_environ,
    _get_device_index,
    _get_module_id_from_environ,
)
from .memory import (  # noqa: F401
    max_memory_allocated,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_peak_memory_stats,
)
from .random import (  # noqa: F401, E402
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    set_rng_state,
    set_rng_state_all,
)

if is_lazy():
    from .graphs import HPUGraph, ModuleCacher, graph, make_graphed_callables, wrap_in_hpu_graph  # noqa: F401

# backend/helpers/dynamic_shape_info.cpp: in lazy mode the flag is thread_local, each thread starting from
# PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES as the bridge read it, and enable/disable change the calling thread's only
# (the autograd engine runs the backward on its own device thread); in eager mode they set the process flag.
_dynamic_shapes = os.environ.get("PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", "0") == "1"
_thread = threading.local()


def _count() -> int:
    return int(os.environ.get("FAKE_HPU_DEVICE_COUNT", "1"))


def is_available() -> bool:
    _hf.record("hpu.is_available")
    return _count() > 0


def device_count() -> int:
    _hf.record("hpu.device_count")
    return _count()


def current_device() -> int:
    """``_hpu_C.current_device()``: the id of the device the process acquired, which the bridge's guard and
    allocator check to be 0 (``HPUGuardImpl.h``, ``HPUAllocator.cpp``). Asking initializes the device, as
    ``hpu/__init__.py`` does (DeviceMesh then keeps it)."""
    _hf.record("hpu.current_device")
    return _current_device()


def _current_device() -> int:
    _lazy_init()
    return 0


def get_device_name(device=None) -> str:
    _hf.record("hpu.get_device_name", device=device)
    return os.environ.get("FAKE_HPU_DEVICE_NAME", "GAUDI2")  # "GAUDI", "GAUDI2" or "GAUDI3", as the bridge's tests


def synchronize() -> None:
    _hf.record("hpu.synchronize")


_initialized = False


def _lazy_init() -> None:
    """``_hpu_C.init()`` once; it fails where there is no device."""
    global _initialized
    if not _initialized:
        if _count() < 1:
            raise RuntimeError("synStatus=8 [Device not found] Device acquire failed.")
        _initialized = True


def init() -> None:
    _lazy_init()


def is_initialized() -> bool:
    return _initialized


def set_device(device) -> None:
    """``hpu/__init__.py``: nothing moves (the process has one Gaudi); the index is checked against the visible
    modules and, with HLS_MODULE_ID set, taken as that module whatever it was; without HLS_MODULE_ID or
    HABANA_VISIBLE_MODULES on a machine of fewer than 8 Gaudis only index 0 is allowed, else the module is
    exported as HLS_MODULE_ID. The index is kept for ``device``'s context."""
    index = _get_device_index(device, optional=True)
    _hf.record("hpu.set_device", index=index)
    available = _get_available_modules_from_environ()
    if index not in available and index > len(available):
        raise AssertionError(f"Trying to open device with idx={index} when only {available} are avaliable)")
    module = _get_module_id_from_environ()
    if module >= 0:
        for position in range(device_count()):
            if available[position] == module:
                index = position
                break
        assert available[index] == module, (
            f"Requested module_id={available[index]} is different from current_module_id={module} "
            "which was previously set."
        )
    if module == -1 and HABANA_VISIBLE_MODULES_VAR not in os.environ and device_count() < 8:
        assert index == 0, f"As {HABANA_VISIBLE_MODULES_VAR} is not provided, the only supported device idx is 0."
    else:
        os.environ[HLS_MODULE_ID_VAR] = str(available[index])
    set_device.current_device_idx = index


set_device.current_device_idx = -1


class device:
    """``hpu/__init__.py``'s context manager (torch.load with an hpu ``map_location`` and torch's checkpointing
    enter it): a process opens one Gaudi, so an index other than 0 must be the process's own module
    (HLS_MODULE_ID), else AssertionError; entering selects that module with ``set_device``."""

    def __init__(self, device) -> None:
        index = _get_device_index(device, optional=True)
        module = _get_module_id_from_environ()
        if index != 0 and index != module:
            raise AssertionError(f"Requested device_id={index} is different from env_device_id={module}")
        self.idx, self.prev_idx = module, -1

    def __enter__(self):
        self.prev_idx = set_device.current_device_idx
        if self.idx != -1 and self.idx != self.prev_idx:
            set_device(self.idx)

    def __exit__(self, *exc) -> bool:
        if self.prev_idx not in (-1, self.idx):
            set_device(self.idx)  # sic: the bridge selects its own module again, not the previous index
        return False


class Stream(torch.Stream):
    """``hpu/streams.py``'s stream class (torch's dynamo lists ``torch.hpu.Stream`` as an in-graph class
    whenever ``torch.hpu`` exists); the simulated device has one synchronous stream."""


class Event(torch.Event):
    """``hpu/events.py``'s event class (also listed by dynamo); events on the simulated device are complete."""


# hpu/streams.py: current_stream / default_stream (optional device), stream(s) as a context that makes s current,
# set_stream. FSDP2 runs its collectives on streams of its own through these. The simulated device runs everything
# at once on its one stream: each call answers that stream, and the context has nothing to switch.


def current_stream(device=None) -> Stream:
    from .memory import _check_device

    _check_device(device)
    return Stream(device=torch.device("hpu", 0))


default_stream = current_stream


def set_stream(stream) -> None:
    if stream is not None and stream.device.type != "hpu":
        raise RuntimeError(f"set_stream: expected a stream on hpu, got one on {stream.device}")


@contextlib.contextmanager
def stream(stream):
    set_stream(stream)
    yield


def record_stream(tensor, stream) -> None:
    """``hpu/streams.py`` -> ``hpu/csrc/bindings.cpp``: keep ``tensor``'s memory until the work queued on ``stream``
    is done (DeepSpeed's ZeRO-3 frees a partitioned parameter after this); the stream is rebuilt as an HPUStream,
    whose constructor refuses any other device type (``backend/habana_device/HPUStream.h``). The simulated device
    has done all work when a call returns."""
    if stream.device.type != "hpu":
        raise RuntimeError(f"record_stream: expected a stream on hpu, got one on {stream.device}")
    _hf.record("hpu.record_stream")


def is_bf16_supported() -> bool:
    return is_available()


def is_autocast_hpu_enabled() -> bool:
    return torch.is_autocast_enabled("hpu")


def get_autocast_hpu_dtype():
    return torch.get_autocast_dtype("hpu")


def _set_dynamic_shapes(enabled: bool) -> None:
    global _dynamic_shapes
    if is_lazy():
        _thread.dynamic_shapes = enabled
    else:
        _dynamic_shapes = enabled


def enable_dynamic_shape():
    _hf.record("hpu.enable_dynamic_shape", thread=threading.current_thread().name)
    _set_dynamic_shapes(True)


def disable_dynamic_shape():
    _hf.record("hpu.disable_dynamic_shape", thread=threading.current_thread().name)
    _set_dynamic_shapes(False)


def get_dynamic_shape_status() -> bool:
    """The calling thread's flag in lazy mode, the process's in eager mode."""
    return getattr(_thread, "dynamic_shapes", _dynamic_shapes) if is_lazy() else _dynamic_shapes
