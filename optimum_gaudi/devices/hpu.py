"""Intel Gaudi (HPU) through Habana's PyTorch bridge.

This is the only module that imports ``habana_frameworks``, and only inside functions: the bridge reads
PT_HPU_* environment variables (lazy mode, autocast op lists) once, when first imported, so nothing may
import it before the training arguments have set them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .base import GB, Device


def bridge_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def bridge_imported() -> bool:
    return "habana_frameworks.torch" in sys.modules


BF16_LIST_ENV = "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"
FP32_LIST_ENV = "PT_HPU_AUTOCAST_FP32_OPS_LIST"


def export_autocast_op_lists(bf16_ops: list[str] | None, fp32_ops: list[str] | None) -> None:
    """Write the op lists to files and name them in the environment, where the bridge looks at import.

    Files are named by content so repeated runs reuse them instead of piling up in the temp directory.
    """
    wanted = {}
    for env, ops in ((BF16_LIST_ENV, bf16_ops), (FP32_LIST_ENV, fp32_ops)):
        if ops:
            text = "\n".join(ops) + "\n"
            path = (
                Path(tempfile.gettempdir())
                / "optimum-gaudi-op-lists"
                / f"{hashlib.sha1(text.encode()).hexdigest()[:16]}.txt"
            )
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(text)
                os.replace(tmp, path)
            wanted[env] = str(path)
    if bridge_imported() and any(os.environ.get(env) != value for env, value in wanted.items()):
        raise RuntimeError(
            "habana_frameworks was imported before the Gaudi config's autocast op lists were set; build "
            "GaudiTrainingArguments (or set PT_HPU_AUTOCAST_*_OPS_LIST) before importing habana_frameworks."
        )
    os.environ.update(wanted)


def _exported_lists() -> tuple[list[str], list[str]]:
    def read(env: str) -> list[str]:
        path = os.environ.get(env)
        return Path(path).read_text().split() if path and Path(path).is_file() else []

    return read(BF16_LIST_ENV), read(FP32_LIST_ENV)


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
    fast_ddp_dtype = "bfloat16"
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

    def register_ddp_backend(self) -> None:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")  # registers the 'hccl' backend

    def mark_step(self) -> None:
        importlib.import_module("habana_frameworks.torch.core").mark_step()

    def fused_adamw(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        from habana_frameworks.torch.hpex.optimizers import FusedAdamW

        return FusedAdamW, {}

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        from habana_frameworks.torch.hpex.normalization import FusedClipNorm

        params = [p for p in parameters if p.grad is not None]
        return FusedClipNorm(params, max_norm).clip_norm(params)

    def autocast_factory(
        self, bf16_ops: list[str] | None = None, fp32_ops: list[str] | None = None
    ) -> Callable[[], contextlib.AbstractContextManager]:
        """torch.autocast('hpu'); the bridge took the op lists from the environment when it loaded."""
        if (bf16_ops or fp32_ops) and _exported_lists() != (bf16_ops or [], fp32_ops or []):
            raise RuntimeError(
                "The Gaudi config's autocast op lists did not reach habana_frameworks before it was imported; "
                "pass the config as --gaudi_config_name (GaudiTrainingArguments sets them up before the import)."
            )
        return lambda: torch.autocast(device_type="hpu", dtype=torch.bfloat16)

    def wrap_for_training(self, model: torch.nn.Module, max_graphs: int | None) -> torch.nn.Module:
        from habana_frameworks.torch.hpu import ModuleCacher

        cacher = ModuleCacher() if max_graphs is None else ModuleCacher(max_graphs=max_graphs)
        return cacher(model=model, inplace=True)

    def wrap_for_inference(self, model: torch.nn.Module, disable_tensor_cache: bool) -> torch.nn.Module:
        from habana_frameworks.torch.hpu import wrap_in_hpu_graph

        return wrap_in_hpu_graph(model, disable_tensor_cache=disable_tensor_cache)

    def static_shapes(self, lazy_mode: bool) -> bool:
        """Lazy mode compiles (and HPU Graphs capture) one graph per input shape."""
        return lazy_mode

    def capture_graph(self, fn: Callable[..., Any], static_inputs: tuple) -> tuple[Any, Callable[[], None]]:
        from habana_frameworks.torch.hpu import HPUGraph, graph

        hpu_graph = HPUGraph()
        with graph(hpu_graph):
            outputs = fn(*static_inputs)
        return outputs, hpu_graph.replay

    def make_graphed_callables(self, callables: Any, sample_args: tuple) -> Any:
        from habana_frameworks.torch.hpu import make_graphed_callables

        return make_graphed_callables(callables, sample_args)

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """HPU activity where this torch build knows it (Habana's builds do)."""
        activity = torch.profiler.ProfilerActivity
        return [activity.CPU, activity.HPU] if hasattr(activity, "HPU") else [activity.CPU]

    def memory_info(self) -> tuple[int, int]:
        free, total = importlib.import_module("habana_frameworks.torch.hpu").mem_get_info()
        return int(free), int(total)

    def memory_stats(self) -> dict[str, float]:
        stats = importlib.import_module("habana_frameworks.torch.hpu").memory_stats()
        return {
            "memory_allocated (GB)": round(stats.get("InUse", 0) / GB, 3),
            "max_memory_allocated (GB)": round(stats.get("MaxInUse", 0) / GB, 3),
            "total_memory_available (GB)": round(stats.get("Limit", 0) / GB, 2),
        }
