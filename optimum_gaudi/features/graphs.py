"""Graph capture and replay that runs on every device, for users who graph regions by hand.

Written against this API, a script that captures a step on a Gaudi (HPU Graphs) also runs on CUDA (CUDA
graphs) and on a CPU (plain re-execution with the same static-tensor semantics), so it can be developed
without a Gaudi. The usual patterns from the Habana docs map onto it:

    graph = Graph()
    static_out = graph.capture(model, static_in)      # capture once on fixed input tensors
    static_in.copy_(next_batch); graph.replay()        # refresh static_out in place

    fwd = make_graphed_callables(block, (sample,))     # a callable that replays its graph
    model = cache_module(model, max_graphs=8)          # training: graph cache per input shape
    model = wrap_in_graph(model)                       # inference
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..devices import Device, detect_device


class Graph:
    """One captured region: ``capture`` runs it on static inputs, ``replay`` re-runs it on their new data."""

    def __init__(self, device: Device | None = None) -> None:
        self.device = device or detect_device()
        self._replay: Callable[[], None] | None = None
        self.outputs: Any = None

    def capture(self, fn: Callable[..., Any], *static_inputs: Any) -> Any:
        self.outputs, self._replay = self.device.capture_graph(fn, static_inputs)
        return self.outputs

    def replay(self) -> Any:
        if self._replay is None:
            raise RuntimeError("Graph.replay() before Graph.capture(fn, *static_inputs); capture the region first.")
        self._replay()
        return self.outputs


def make_graphed_callables(callables: Any, sample_args: tuple, device: Device | None = None) -> Any:
    """Graphed versions of `callables` (a callable or a tuple of them), as torch.cuda / Habana define it."""
    return (device or detect_device()).make_graphed_callables(callables, sample_args)


def cache_module(model: nn.Module, max_graphs: int | None = None, device: Device | None = None) -> nn.Module:
    """Training-time graph cache (Habana's ModuleCacher, at most `max_graphs` shapes; None: the bridge's
    default, 10); the model itself where graphs do not apply (CPU, CUDA, a Gaudi in eager mode)."""
    return (device or detect_device()).wrap_for_training(model, max_graphs)


def wrap_in_graph(
    model: nn.Module, disable_tensor_cache: bool = False, device: Device | None = None, max_graphs: int | None = None
) -> nn.Module:
    """Inference-time graphs (Habana's wrap_in_hpu_graph, in place: never on a model that still trains, whose
    forwards would replay them; at most `max_graphs` input shapes, None: no limit); the model itself where
    graphs do not apply."""
    return (device or detect_device()).wrap_for_inference(model, disable_tensor_cache, max_graphs=max_graphs)
