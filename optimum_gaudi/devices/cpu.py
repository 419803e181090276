"""CPU: eager execution, torch's fused AdamW and foreach clipping, process memory from the OS."""

from __future__ import annotations

import contextlib
import os
import resource

from .base import GB, Device
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


class CPUDevice(Device):
    type = "cpu"
    ddp_backend = "gloo"
    on_host = True
    # Compiled code draws its random numbers (dropout) from torch's generator, as eager code does: the same
    # random stream as an eager run, and faster here than inductor's own generator on CPU (the benchmarks'
    # GPT-2 4x256 training step, compiled both ways in one process: 140.6 against 151.9 ms).
    inductor_options = {"fallback_random": True}
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
    }

    def loop_memory(self) -> contextlib.AbstractContextManager:
        """The model trains in host memory: glibc keeps freed blocks for the next step (host_memory)."""
        return freed_memory_kept()

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
