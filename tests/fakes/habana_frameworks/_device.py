"""TEST DOUBLE of what the bridge's plugin library gives torch: a real ``hpu`` device (host memory).

The real ``torch/__init__.py`` loads ``lib/libhabana_pytorch*_plugin.so`` with ``ctypes.CDLL``; that library
registers an allocator, a device guard, the accelerator hooks and kernels for torch's built-in HPU device
type, and the autocast kernels of ``hpu_ops/autocast_helpers.h``; ``core/__init__.py`` then registers
``torch.hpu`` (``torch._register_device_module``). With FAKE_HPU_DEVICE=1 the simulator does the same with
``torch/lib/fake_hpu_device.cpp``, compiled here on first use (g++ against the running torch's headers, cached by
source and torch version) and loaded with ``torch.ops.load_library``: tensors report ``device.type ==
"hpu"``, transformers and accelerate take the Gaudi path (``is_torch_hpu_available``), models move to the
device, and ``torch.autocast("hpu")`` casts by the bridge's op lists.

A process loads it once: the device cannot be unloaded, so in-process tests that re-import the simulator
leave FAKE_HPU_DEVICE unset and the subprocess runs (examples, the launcher) set it.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "torch" / "lib" / "fake_hpu_device.cpp"
BUILD_DIR = Path(__file__).resolve().parents[1] / ".build"  # tests/fakes/.build, ignored by git
_loaded = False


def enabled() -> bool:
    return os.environ.get("FAKE_HPU_DEVICE") == "1"


def loaded() -> bool:
    return _loaded


def _library() -> Path:
    """The compiled library for this source and torch, built once (atomically: parallel ranks may race)."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__}|{abi}|{sys.version}".encode()).hexdigest()[:16]
    target = BUILD_DIR / f"fake_hpu_device-{key}.so"
    if target.exists():
        return target
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    include = Path(torch.__file__).parent / "include"
    lib = Path(torch.__file__).parent / "lib"
    major, minor = torch.__version__.split(".")[:2]
    release = int(major) * 100 + int(minor)  # the source adapts to the interfaces of torch 2.6 (206) and later
    fd, partial = tempfile.mkstemp(suffix=".so", dir=BUILD_DIR)
    os.close(fd)
    command = [
        os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O1", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DTORCH_RELEASE={release}", f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", str(SOURCE),
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", partial,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(partial)
        raise RuntimeError(f"building the simulated hpu device failed:\n{result.stderr[-4000:]}")
    os.replace(partial, target)
    return target


def load_library() -> None:
    """Load the device (once per process)."""
    global _loaded
    if not _loaded:
        torch.ops.load_library(str(_library()))
        torch.ops.fake_hpu.route_cpu_kernels()
        _loaded = True


def load(bf16_ops, fp32_ops, lazy: bool) -> None:
    """The plugin's load: the device, its autocast with the op lists the bridge read at import, and its mode
    (the lazy kernels refuse what the eager ones take: ``set_`` without an offset aborts)."""
    load_library()
    torch.ops.fake_hpu.set_autocast_lists(sorted(bf16_ops), sorted(fp32_ops))
    torch.ops.fake_hpu.set_lazy(lazy)


def register_module(hpu) -> None:
    """``core/__init__.py``: ``torch._register_device_module("hpu", hpu)``; a simulator imported again in the
    same process re-points the registration at its fresh module."""
    if hasattr(torch, "hpu"):
        torch.hpu = hpu
        sys.modules["torch.hpu"] = hpu
    else:
        torch._register_device_module("hpu", hpu)


def memory_counters() -> tuple[int, int, int]:
    """(bytes live, peak since reset, allocations) of the device's allocator."""
    ops = torch.ops.fake_hpu
    return int(ops.memory_allocated()), int(ops.max_memory_allocated()), int(ops.num_allocs())


def reset_peak() -> None:
    torch.ops.fake_hpu.reset_peak_memory_stats()


def to_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.to(torch.device("hpu"))`` where the simulated device is loaded (as the bridge's Python code
    does); the tensor as it is where it is not."""
    return tensor.to("hpu") if _loaded else tensor
