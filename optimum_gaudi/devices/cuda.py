"""NVIDIA GPU: eager execution, torch's fused AdamW, foreach clipping, torch.cuda memory API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .base import GB, Device


class CUDADevice(Device):
    type = "cuda"
    ddp_backend = "nccl"
    behaviour = {
        "use_habana": "no Gaudi here: runs on CUDA",
        "use_lazy_mode": "eager execution (no lazy graphs on CUDA)",
        "pipelining_fwd_bwd": "no-op",
        "use_hpu_graphs_for_training": "no-op (capture CUDA graphs by hand with optimum_gaudi.graphs)",
        "use_hpu_graphs_for_inference": "no-op (capture CUDA graphs by hand with optimum_gaudi.graphs)",
        "use_fused_adam": "torch.optim.AdamW(fused=True)",
        "use_fused_clip_norm": "foreach clip_grad_norm_",
        "use_torch_autocast": "bf16 on exactly the config's op lists (torch.autocast('cuda') without lists)",
        "distribution_strategy": "nccl process group",
        "torch_compile": "inductor backend",
    }

    def count(self) -> int:
        return torch.cuda.device_count()

    def capture_graph(self, fn: Callable[..., Any], static_inputs: tuple) -> tuple[Any, Callable[[], None]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the graph, as CUDA graph capture requires
            fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            outputs = fn(*static_inputs)
        return outputs, cuda_graph.replay

    def make_graphed_callables(self, callables: Any, sample_args: tuple) -> Any:
        return torch.cuda.make_graphed_callables(callables, sample_args)

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(torch.cuda.current_device())
        return int(free), int(total)

    def memory_stats(self) -> dict[str, float]:
        index = torch.cuda.current_device()
        return {
            "memory_allocated (GB)": round(torch.cuda.memory_allocated(index) / GB, 3),
            "max_memory_allocated (GB)": round(torch.cuda.max_memory_allocated(index) / GB, 3),
            "total_memory_available (GB)": round(torch.cuda.get_device_properties(index).total_memory / GB, 2),
        }
