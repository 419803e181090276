"""TEST DOUBLE of ``habana_frameworks.torch.hpu.graphs``.

The real module captures a module's forward (and backward) into HPU graphs and replays them. Nothing is
captured here: every wrapper runs the original forward eagerly on CPU, and only records its arguments
and each forward call. ``HPUGraph.replay`` therefore does no work.
"""

import copy
import functools

import torch

import habana_frameworks as _hf

# Keyword arguments the real graph-wrapped forward consumes itself instead of passing them to the model.
_GRAPH_ONLY_KWARGS = ("warmup_mode", "bypass_hpu_graphs", "cache_tensors_list")


class HPUGraph:
    def __init__(self):
        _hf.record("hpu.HPUGraph")

    def capture_begin(self, dry_run=False):
        _hf.record("hpu.HPUGraph.capture_begin", dry_run=dry_run)

    def capture_end(self):
        _hf.record("hpu.HPUGraph.capture_end")

    def replay(self, asynchronous=False):
        _hf.record("hpu.HPUGraph.replay", asynchronous=asynchronous)

    def reset(self):
        _hf.record("hpu.HPUGraph.reset")


class graph:  # noqa: N801  (the real class is lower-case)
    def __init__(self, hpu_graph, stream=None, dry_run=False):
        self.hpu_graph, self.stream, self.dry_run = hpu_graph, stream, dry_run

    def __enter__(self):
        self.hpu_graph.capture_begin(self.dry_run)

    def __exit__(self, exc_type, exc_value, traceback):
        self.hpu_graph.capture_end()


def make_graphed_callables(
    callables,
    sample_args,
    warmups=0,
    allow_unused_input=False,
    asynchronous=False,
    disable_tensor_cache=False,
    dry_run=False,
):
    _hf.record(
        "hpu.make_graphed_callables",
        callables,
        warmups=warmups,
        allow_unused_input=allow_unused_input,
        asynchronous=asynchronous,
        disable_tensor_cache=disable_tensor_cache,
        dry_run=dry_run,
    )
    return callables


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    _hf.record(
        "hpu.wrap_in_hpu_graph",
        module,
        asynchronous=asynchronous,
        disable_tensor_cache=disable_tensor_cache,
        dry_run=dry_run,
        max_graphs=max_graphs,
    )
    orig_forward = module.forward

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        for name in _GRAPH_ONLY_KWARGS:
            kwargs.pop(name, None)
        _hf.record("hpu.wrap_in_hpu_graph.forward", training=module.training)
        return orig_forward(*args, **kwargs)

    module.forward = forward
    module.clear_cache = lambda: _hf.record("hpu.wrap_in_hpu_graph.clear_cache")
    module.clear_inputs = lambda: _hf.record("hpu.wrap_in_hpu_graph.clear_inputs")
    return module


class ModuleCacher(torch.nn.Module):
    """``ModuleCacher(max_graphs=10)(model=model, inplace=True)`` returns ``model`` with a wrapped forward."""

    def __init__(self, max_graphs=10):
        super().__init__()
        self.max_graphs = max_graphs
        _hf.record("hpu.ModuleCacher", max_graphs=max_graphs)

    def __call__(
        self,
        model,
        use_lfu=False,
        inplace=True,
        allow_unused_input=False,
        asynchronous=False,
        have_grad_accumulation=False,
        log_frequency=100,
        verbose=False,
        disable_tensor_cache=False,
        dry_run=False,
    ):
        _hf.record(
            "hpu.ModuleCacher.__call__",
            model,
            use_lfu=use_lfu,
            inplace=inplace,
            allow_unused_input=allow_unused_input,
            asynchronous=asynchronous,
            have_grad_accumulation=have_grad_accumulation,
            log_frequency=log_frequency,
            verbose=verbose,
            disable_tensor_cache=disable_tensor_cache,
            dry_run=dry_run,
        )
        if not inplace:
            model = copy.copy(model)
        orig_forward = model.forward
        lazy = _hf.is_lazy()

        def forward(*args, **kwargs):
            # The real cacher replays graphs only for training forwards with grad enabled in lazy mode.
            cached = model.training and torch.is_grad_enabled() and lazy
            _hf.record("hpu.ModuleCacher.forward", training=model.training, cached=cached)
            return orig_forward(*args, **kwargs)

        model.orig_forward = orig_forward
        model.forward = forward
        model.set_iteration_count = self.set_iteration_count
        model.capture_start = lambda: _hf.record("hpu.ModuleCacher.capture_start")
        model.capture_end = lambda: _hf.record("hpu.ModuleCacher.capture_end")
        model.is_hpugraph_tracing = lambda: False
        return model

    def set_iteration_count(self, iter_num):
        _hf.record("hpu.ModuleCacher.set_iteration_count", iter_num)
