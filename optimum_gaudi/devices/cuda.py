"""NVIDIA GPU: eager execution, torch's fused AdamW, foreach clipping, torch.cuda memory API.

HPU Graphs' counterpart is CUDA graphs. For training, the HPU-graph flag compiles the model with
torch.compile's ``reduce-overhead`` mode, which records a CUDA graph per input shape and replays it, forward
and backward (a short last batch records one more). For inference, as wrap_in_hpu_graph does on a Gaudi, each
input signature is captured once as a plain CUDA graph, without compiling, and replayed for every later batch
and evaluate() with it: compiling for one evaluation cost more than the whole evaluation (9.6 samples/s against
214 without graphs, a GPT-2 run_clm). Graphs pay off where evaluation is bound by kernel launches (small
batches, small models); a forward that waits for the host cannot be captured and runs without them, said once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .base import GB, Device, private_inputs, replayable, unaliased_outputs

logger = logging.getLogger(__name__)

CUDA_GRAPH_COMPILE = {"backend": "inductor", "mode": "reduce-overhead", "dynamic": False}


def compile_with_cuda_graphs(model: nn.Module) -> nn.Module:
    """Compile `model`'s forward in place so that each input shape runs as a replayed CUDA graph.

    Each call first marks a new graph iteration (the previous call's outputs may be overwritten from
    then on), outside the compiled code, where torch's documentation asks for it. Without gradients
    (evaluation, prediction) the outputs are cloned (``unaliased_outputs``).
    """
    if getattr(model.__dict__.get("forward"), "cuda_graphs", False):
        return model  # already wrapped (the trainer restores the plain forward when it unwraps)
    compiled = torch.compile(model.forward, **CUDA_GRAPH_COMPILE)

    @functools.wraps(model.forward)  # keeps the signature the Trainer reads to select input columns
    def forward(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return unaliased_outputs(compiled(*args, **kwargs))

    forward.cuda_graphs = True
    model.forward = forward
    return model


def _signature(value: Any) -> Any:
    """What a captured graph depends on in a forward's inputs: the structure, each tensor's shape, dtype and
    device, and the plain values (``replayable`` inputs only)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, dict):
        return ("dict", tuple((key, _signature(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(item) for item in value))
    return value


class InferenceGraphs:
    """A model's evaluation forward as CUDA graphs: the first call with an input signature captures one (after
    a warm-up run), every later call with it copies its inputs into the graph's and replays it. A forward with
    gradients, with a stateful input (a generation cache) or beyond `max_graphs` signatures runs as it is."""

    cuda_graphs = True  # compile_with_cuda_graphs and wrap_for_inference wrap a forward once

    def __init__(self, forward: Callable[..., Any], device: Device, max_graphs: int | None = None) -> None:
        functools.update_wrapper(self, forward)  # keeps the signature the Trainer reads to select input columns
        self.plain_forward, self.device, self.max_graphs = forward, device, max_graphs
        self.graphs: dict[Any, tuple[list[torch.Tensor], Any, Callable[[], None]]] = {}
        self.unusable = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() or self.unusable or not replayable((args, kwargs)):
            return self.plain_forward(*args, **kwargs)
        key = _signature((args, kwargs))
        if key not in self.graphs:
            if self.max_graphs is not None and len(self.graphs) >= self.max_graphs:
                return self.plain_forward(*args, **kwargs)
            if not self._capture(key, args, kwargs):
                return self.plain_forward(*args, **kwargs)
        static, outputs, replay = self.graphs[key]
        flat, _ = tree_flatten((args, kwargs))
        for into, tensor in zip(static, (x for x in flat if isinstance(x, torch.Tensor)), strict=True):
            into.copy_(tensor)
        replay()
        return unaliased_outputs(outputs)

    def _capture(self, key: Any, args: tuple, kwargs: dict) -> bool:
        """Capture the forward on private copies of these inputs; False (and one warning) where it cannot be."""
        flat, spec = tree_flatten(private_inputs((args, kwargs)))
        static = [x for x in flat if isinstance(x, torch.Tensor)]

        def run(*tensors: torch.Tensor) -> Any:
            fed = iter(tensors)
            call_args, call_kwargs = tree_unflatten(
                [next(fed) if isinstance(x, torch.Tensor) else x for x in flat], spec
            )
            return self.plain_forward(*call_args, **call_kwargs)

        # autocast caches its casts of the weights until its region ends, and the warm-up run would fill the cache:
        # the graph would read casts freed at the region's end. Without the cache it records the casts itself.
        cache_enabled = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            outputs, replay = self.device.capture_graph(run, tuple(static))
        except Exception as error:  # e.g. a forward that waits for the host (.item(), nonzero)
            self.unusable = True
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            logger.warning(
                "--use_hpu_graphs_for_inference: CUDA graphs cannot capture this model's forward (%s); it runs "
                "without them.",
                reason,
            )
            return False
        finally:
            torch.set_autocast_cache_enabled(cache_enabled)
        self.graphs[key] = (static, outputs, replay)
        return True


class CUDADevice(Device):
    type = "cuda"
    ddp_backend = "nccl"
    torch_context_parallel = True
    has_own_memory = True
    behaviour = {
        "use_habana": "no Gaudi here: runs on CUDA",
        "use_lazy_mode": "eager execution (no lazy graphs on CUDA)",
        "pipelining_fwd_bwd": "no-op",
        "use_hpu_graphs_for_training": "CUDA graphs: torch.compile(mode='reduce-overhead'), a graph per shape",
        "use_hpu_graphs_for_inference": "CUDA graphs: each input shape captured once (no compile), then replayed",
        "use_fused_adam": "torch.optim.AdamW(fused=True)",
        "use_fused_clip_norm": "foreach clip_grad_norm_",
        "use_torch_autocast": "bf16 on exactly the config's op lists (torch.autocast('cuda') without lists)",
        "distribution_strategy": "nccl process group",
        "torch_compile": "inductor backend",
        "attn_implementation": "gaudi_fused_sdpa is transformers' sdpa (torch SDPA (flash / memory-efficient kernels)); --flash_attention_* no-op",
        "use_fused_rms_norm": "no-op: the model's own RMSNorm",
        "use_fused_rope": "no-op: the model's own rotary embedding",
        "use_fused_linear_cross_entropy": "training loss from the hidden states in chunks, no full logits",
        "fp8": "torchao Float8Linear on GPUs with fp8 matmuls (compute capability 8.9+)",
        "fsdp": "FSDP2 fully_shard over nccl; use_fused_adam: torch's fused AdamW on the shards",
        "context_parallel_size": "with --fsdp: torch context parallelism (ring SDPA, parallelism_config); else all-to-all (nccl)",
    }

    def count(self) -> int:
        return torch.cuda.device_count()

    def rng_snapshot(self) -> Callable[[], None]:
        restore_host, states = super().rng_snapshot(), torch.cuda.get_rng_state_all()

        def restore() -> None:
            restore_host()
            torch.cuda.set_rng_state_all(states)

        return restore

    def fp8_problem(self, compiling: bool = False) -> str | None:
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            return (
                f"--fp8 needs a GPU with fp8 matmuls (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}. Train with --bf16."
            )
        return super().fp8_problem(compiling)

    def wrap_for_training(self, model: nn.Module, max_graphs: int | None) -> nn.Module:
        if max_graphs is not None:
            logger.warning("--max_hpu_graphs has no CUDA counterpart: torch's recompile limit bounds the graphs.")
        return compile_with_cuda_graphs(model)

    def wrap_for_inference(
        self, model: nn.Module, disable_tensor_cache: bool, max_graphs: int | None = None
    ) -> nn.Module:
        """In place, like wrap_in_hpu_graph; the trainer restores the plain forward when it trains again."""
        if not getattr(model.__dict__.get("forward"), "cuda_graphs", False):
            model.forward = InferenceGraphs(model.forward, self, max_graphs)
        return model

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

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

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
