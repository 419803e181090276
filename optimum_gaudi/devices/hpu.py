"""Intel Gaudi (HPU) through Habana's PyTorch bridge.

This is the only module that imports ``habana_frameworks``, and only inside functions: the bridge reads
PT_HPU_* environment variables (lazy mode, autocast op lists) once, when first imported, so nothing may
import it before the training arguments have set them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterable
from typing import Any

import torch

from .base import GB, Device


def bridge_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def bridge_imported() -> bool:
    import sys

    return "habana_frameworks.torch" in sys.modules


def hpu_available() -> bool:
    """True when the bridge imports and sees at least one Gaudi."""
    if not bridge_installed():
        return False
    try:
        hthpu = importlib.import_module("habana_frameworks.torch.hpu")
    except ImportError:
        return False
    return bool(hthpu.is_available())


class HPUDevice(Device):
    type = "hpu"
    ddp_backend = "hccl"
    compile_backend = "hpu_backend"
    behaviour = {
        "use_habana": "Gaudi device hpu",
        "use_lazy_mode": "PT_HPU_LAZY_MODE=1, mark_step() after backward and optimizer step",
        "pipelining_fwd_bwd": "extra mark_step() after forward",
        "use_hpu_graphs_for_training": "ModuleCacher(max_graphs=...)",
        "use_hpu_graphs_for_inference": "wrap_in_hpu_graph(disable_tensor_cache=...)",
        "use_fused_adam": "hpex.optimizers.FusedAdamW",
        "use_fused_clip_norm": "hpex.normalization.FusedClipNorm",
        "use_torch_autocast": "torch.autocast('hpu', bfloat16) with PT_HPU_AUTOCAST_* op lists",
        "distribution_strategy": "hccl process group",
        "torch_compile": "hpu_backend",
    }

    # Modules are looked up per call (sys.modules makes that cheap) so the device object stays picklable:
    # transformers saves the training arguments, which carry it, with torch.save.

    def count(self) -> int:
        return int(importlib.import_module("habana_frameworks.torch.hpu").device_count())

    def mark_step(self) -> None:
        importlib.import_module("habana_frameworks.torch.core").mark_step()

    def fused_adamw(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        from habana_frameworks.torch.hpex.optimizers import FusedAdamW

        return FusedAdamW, {}

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        from habana_frameworks.torch.hpex.normalization import FusedClipNorm

        params = [p for p in parameters if p.grad is not None]
        return FusedClipNorm(params, max_norm).clip_norm(params)

    def autocast(self, dtype: torch.dtype = torch.bfloat16) -> contextlib.AbstractContextManager:
        return torch.autocast(device_type="hpu", dtype=dtype)

    def memory_stats(self) -> dict[str, float]:
        stats = importlib.import_module("habana_frameworks.torch.hpu").memory_stats()
        return {
            "memory_allocated (GB)": round(stats.get("InUse", 0) / GB, 3),
            "max_memory_allocated (GB)": round(stats.get("MaxInUse", 0) / GB, 3),
            "total_memory_available (GB)": round(stats.get("Limit", 0) / GB, 2),
        }
