"""CPU: eager execution, torch's fused AdamW and foreach clipping, process memory from the OS."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time

import torch

from .base import GB, Device, torch_release
from .host_memory import freed_memory_kept


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the peak, the best the OS offers
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


# Names of the instructions that compute in bf16: x86's AVX512-BF16 and AMX, Arm's BF16 (NEON and SVE), as
# torch.cpu.get_capabilities() (torch 2.11+) and the kernel's /proc/cpuinfo flags name them. Without them torch
# emulates bf16 (each element converted to float32 and back), slower than float32.
BF16_CAPABILITIES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16", "svebf16")
CPUINFO = "/proc/cpuinfo"
SLOWDOWN_SIZE = 128  # the matmul bf16_matmul_slowdown times, the width of a small model's linear layers


def cpu_capabilities() -> set[str]:
    """The instruction sets this CPU reports: torch's cpuinfo where the running torch exposes it (2.11+), the
    kernel's flags otherwise (every torch a Gaudi release ships, 2.6-2.10, lacks ``torch.cpu.get_capabilities``:
    its private x86 checks alone would miss Arm and answer "emulated" where they are absent)."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        return {name for name, present in capabilities().items() if present is True}
    found: set[str] = set()
    try:
        with open(CPUINFO) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):  # x86, Arm
                    found.update(value.split())
    except OSError:
        pass
    for name, check in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported")):
        if getattr(torch.cpu, check, lambda: False)():
            found.add(name)
    return found


def cpu_has_bf16_instructions() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16, AMX, Arm BF16)."""
    return not cpu_capabilities().isdisjoint(BF16_CAPABILITIES)


@functools.cache
def bf16_matmul_slowdown() -> float:
    """How many times as long a square matmul takes in bf16 as in float32 here, best of 5 each: ~0.1 s where bf16
    is emulated. On one thread: on a busy machine two threads' waits for each other swamped the ratio (from 3x to
    154x for one 256x256 matmul on an AVX2-only AMD EPYC; 21x to 29x for 128x128 on one thread). Built without
    random numbers, so that measuring leaves a seeded run's stream alone."""
    x = torch.linspace(-1.0, 1.0, SLOWDOWN_SIZE**2).reshape(SLOWDOWN_SIZE, SLOWDOWN_SIZE)

    def best(a: torch.Tensor) -> float:
        torch.mm(a, a)  # warm-up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, a)
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best(x.bfloat16()) / best(x)
    finally:
        torch.set_num_threads(threads)


class CPUDevice(Device):
    type = "cpu"
    ddp_backend = "gloo"
    on_host = True
    # Compiled code draws its random numbers (dropout) from torch's generator, as eager code does: the same
    # random stream as an eager run, and faster here than inductor's own generator on CPU (the benchmarks'
    # GPT-2 4x256 training step, compiled both ways in one process: 140.6 against 151.9 ms).
    inductor_options = {"fallback_random": True}
    # gloo's reduce-scatter takes ReduceOp.AVG but sums on torch 2.6 and 2.7 (2.9 averages): FSDP2's gradients came
    # out world-size times too large there, which Adam and clipping hide from the loss. FSDP sums and divides
    # before 2.9, as on a Gaudi.
    collectives_average = torch_release() >= (2, 9)
    behaviour = {
        "use_habana": "no Gaudi here: runs on CPU",
        "use_lazy_mode": "eager execution (no lazy graphs on CPU)",
        "pipelining_fwd_bwd": "no-op",
        "use_hpu_graphs_for_training": "no-op on CPU",
        "use_hpu_graphs_for_inference": "no-op on CPU",
        "use_fused_adam": "torch.optim.AdamW(fused=True)",
        "use_fused_clip_norm": "foreach clip_grad_norm_",
        "use_torch_autocast": "bf16 on exactly the config's op lists (torch.autocast('cpu') without lists)",
        "distribution_strategy": "gloo process group",
        "torch_compile": "inductor backend",
        "attn_implementation": "gaudi_fused_sdpa is transformers' sdpa (torch SDPA); --flash_attention_* no-op",
        "use_fused_rms_norm": "no-op: the model's own RMSNorm",
        "use_fused_rope": "no-op: the model's own rotary embedding",
        "use_fused_linear_cross_entropy": "training loss from the hidden states in chunks, no full logits",
        "fp8": "torchao Float8Linear: fp8 matmuls (torch._scaled_mm) in the linear layers",
        "fsdp": "FSDP2 fully_shard over gloo; use_fused_adam: torch's fused AdamW on the shards",
        "context_parallel_size": "sequences split over the ranks: all-to-all (gloo) around the attention kernel",
    }

    @property
    def native_bf16(self) -> bool:
        return cpu_has_bf16_instructions()

    def bf16_note(self) -> str | None:
        """Measured here (once per process): what emulated bf16 costs depends on the CPU and the shapes."""
        if self.native_bf16:
            return None
        return (
            "this CPU has no bf16 instructions (AVX512-BF16, AMX, Arm BF16): bf16 is emulated, "
            f"a {SLOWDOWN_SIZE}x{SLOWDOWN_SIZE} bf16 matmul took {bf16_matmul_slowdown():.0f}x as long as in float32 here "
            "(one thread)"
        )

    def loop_memory(self, sharded: bool = False) -> contextlib.AbstractContextManager:
        """The model trains in host memory: glibc keeps freed blocks for the next step (host_memory). Not in a
        sharded run, whose point is memory: FSDP gathers and frees each layer's parameters and gradients, in
        sizes that fragment a heap that never shrinks, and kept blocks outgrow the replica sharding saves; there
        freed blocks go back at once (a 107M Llama on 2 processes, this trainer, peak per rank above the
        baseline: 2.41 GB keeping them, 1.22 GB with glibc's defaults, 1.03 GB giving them back)."""
        return freed_memory_kept(returned=sharded)

    def memory_info(self) -> tuple[int, int]:
        """System RAM: available (what the kernel can hand out without swapping) and total."""
        page = os.sysconf("SC_PAGE_SIZE")
        total = _meminfo_bytes("MemTotal") or page * os.sysconf("SC_PHYS_PAGES")
        free = _meminfo_bytes("MemAvailable") or page * os.sysconf("SC_AVPHYS_PAGES")
        return free, total

    def memory_stats(self) -> dict[str, float]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        current = _rss_bytes()  # read from another OS source than the peak: keep peak >= current
        return {
            "memory_allocated (GB)": round(current / GB, 3),
            "max_memory_allocated (GB)": round(max(current, _peak_rss_bytes()) / GB, 3),
            "total_memory_available (GB)": round(total / GB, 2),
        }
