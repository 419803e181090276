"""TEST DOUBLE of ``habana_frameworks.torch.hpu.memory``.

Same functions and dict keys as the real API (``hpu/memory.py``). "InUse" is this process's resident
memory (there is no device memory to measure); "MaxInUse" is, as on the device, the peak since the
process started (here the process's peak resident memory) until reset_peak_memory_stats() is called, and
from then the largest value seen since the last reset. "Limit" is 96 GiB (a Gaudi 2) unless
FAKE_HPU_MEMORY_LIMIT gives a number of bytes. Counters are 0.

With the simulated device (FAKE_HPU_DEVICE=1) "InUse", "MaxInUse" and "NumAllocs" are its allocator's
bytes of live hpu tensors, their peak since the last reset and its allocation count, as on a Gaudi.
"""

import os

import habana_frameworks as _hf
from habana_frameworks import _device

_peak = None  # None: never reset, the peak is the whole process's


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _process_peak() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _check_device(device) -> int:
    """``_get_device_index(device, optional=True)`` (``hpu/_utils.py``; no index: the current device, 0), then
    ``0 <= index < device_count()`` (``hpu/memory.py``: else "Invalid device id")."""
    from ._utils import _get_device_index

    index = _get_device_index(device, optional=True)
    if index < 0 or index >= int(os.environ.get("FAKE_HPU_DEVICE_COUNT", "1")):
        raise AssertionError("Invalid device id")
    return index


def _stats(device) -> dict:
    global _peak
    _check_device(device)
    allocs = 0
    if _device.loaded():
        in_use, peak, allocs = _device.memory_counters()
    else:
        in_use = _rss()
        if _peak is not None:
            _peak = max(_peak, in_use)
        peak = max(_process_peak(), in_use) if _peak is None else _peak
    return {
        "Limit": int(os.environ.get("FAKE_HPU_MEMORY_LIMIT", 96 * 1024**3)),
        "InUse": in_use,
        "MaxInUse": peak,
        "NumAllocs": allocs,
        "NumFrees": 0,
        "ActiveAllocs": 0,
        "MaxAllocSize": 0,
        "TotalSystemAllocs": 0,
        "TotalSystemFrees": 0,
        "TotalActiveAllocs": 0,
    }


def memory_stats(device=None):
    _hf.record("hpu.memory_stats", device=device)
    return _stats(device)


def memory_allocated(device=None):
    _hf.record("hpu.memory_allocated", device=device)
    return _stats(device)["InUse"]


def max_memory_allocated(device=None):
    _hf.record("hpu.max_memory_allocated", device=device)
    return _stats(device)["MaxInUse"]


def reset_peak_memory_stats(device=None):
    global _peak
    _hf.record("hpu.reset_peak_memory_stats", device=device)
    _check_device(device)
    if _device.loaded():
        _device.reset_peak()
    _peak = _rss()


def memory_reserved(device=None):
    _hf.record("hpu.memory_reserved", device=device)
    return _stats(device)["Limit"]


def mem_get_info(device=None):
    _hf.record("hpu.mem_get_info", device=device)
    stats = _stats(device)
    return stats["Limit"] - stats["InUse"], stats["Limit"]
