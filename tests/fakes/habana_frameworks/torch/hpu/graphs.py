"""TEST DOUBLE of ``habana_frameworks.torch.hpu.graphs`` (exported by ``hpu`` in lazy mode only).

Follows ``hpu/graphs.py``:

- ``wrap_in_hpu_graph(module)`` replaces ``module.forward`` in place. Each call is keyed by its inputs
  (``input_hash``: tensor shapes and views but not dtypes, other values, autocast state; not
  ``module.training``, not grad mode); a replay copies the inputs with ``copy_to``'s type and key checks. The
  first call with a new key captures: it runs the forward and returns its outputs. Every later call with
  that key replays: it copies the new inputs into the tensors given at capture and returns the outputs of
  the capture, refreshed in place. The capture records the tensor ops the forward ran (a dispatch mode);
  a replay runs those ops again without autograd on the capture's tensors, each result written where the
  capture's was, and runs no Python of the forward: decisions it took from values at capture (a branch on
  ``.item()``, a Python object's state, a length) are replayed as they were then, as on the device. The
  static outputs carry no autograd history: nothing flows back through a replay. Past ``max_graphs`` keys
  (default: no limit) new keys run the plain forward. With
  ``disable_tensor_cache=True`` the bridge copies only into the capture inputs the graph did not match as
  user inputs (``get_user_input_match_indices``, decided in C++); here into all of them, the worst case. An
  exported PT_HPUGRAPH_DISABLE_TENSOR_CACHE decides instead of the argument ("1" on, anything else off), in
  ``wrap_in_hpu_graph`` and ``ModuleCacher`` alike; the records carry the value in force.
- ``ModuleCacher(max_graphs=10)(model, ...)`` asserts that ``model.forward`` takes no positional-only
  or ``*args`` parameter, patches ``model.forward`` and caches one graph per input key for training
  forwards (module in training mode, grad enabled, lazy mode), at most ``max_graphs``; other forwards run
  the plain forward. The patched ``model.forward`` is the cacher's bound method, whose body starts with
  ``self.iteration_cnt += 1``: its function rebound to the model (accelerate's mixed precision does
  ``MethodType(model.forward.__func__, model)``) fails with an AttributeError on the model, as the real
  one does. The capture call's own input tensors become the graph's inputs: each replay copies its batch
  into them (the first batch of each shape is overwritten by every later one, as in the bridge's
  ``make_graphed_callables``) and runs the model's own forward on them, so gradients are exact (the
  static-output aliasing of the real training graphs is not simulated). Capturing a DistributedDataParallel
  model fails as in the real ``GraphModel``. A capture also captures the backward, from every output that
  requires grad to every input and parameter that does, with ``allow_unused=allow_unused_input`` (default
  False): a trainable parameter the forward does not use fails the first step. Allowed, the bridge's backward
  also has ``materialize_grads=allow_unused_input``: such a parameter gets a zero gradient, not None, at every
  step (so weight decay and the optimizer's moments act on it).
- ``make_graphed_callables`` checks its arguments as the real one does (no hooks, buffers without grad,
  tensor-only sample args, given as tuples); a call of a graphed callable copies its inputs into static
  tensors of the sample args' shapes (another shape fails, as in the bridge) and runs the original code.
- ``HPUGraph`` / ``graph`` record capture and replay; a replay does no work.
"""

import collections
import copy
import functools
import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import habana_frameworks as _hf


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


def _view_hash(tensor):
    """``_hpu_C.get_view_hash`` (``hpu/csrc/bindings.cpp``): 0 for a tensor that is no view, else a hash of
    its chain of view parameters; here of what those parameters produce, the view's strides and offset."""
    return 0 if tensor._base is None else hash((tensor.stride(), tensor.storage_offset()))


def _input_key(obj):
    """The real ``input_hash``: tensor shape and view hash (not the dtype), plain values, the HPU autocast
    state (``torch.hpu.is_autocast_hpu_enabled()``); a UserDict (BatchEncoding) by its keys and the identity
    of its tensors' rows."""
    autocast = torch.is_autocast_enabled("hpu")
    if isinstance(obj, dict):
        return _input_key(tuple(obj.items()))
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return hash((tuple(_input_key(x) for x in obj), autocast))
    if isinstance(obj, torch.Tensor):
        return hash((obj.shape, _view_hash(obj), autocast))
    if isinstance(obj, collections.UserDict):
        return hash(tuple((k, tuple(v)) for k, v in obj.items()))
    return hash((obj, autocast))


def _detached(obj):
    """The same structure with every tensor detached (sharing storage): the graph's static outputs."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the output class (ModelOutput) and its attributes
        for key in obj:
            out[key] = _detached(obj[key])
        return out
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = [_detached(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


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
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    for fn, args in zip(callables, sample_args, strict=True):
        if isinstance(fn, torch.nn.Module):
            assert not (fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks), (
                "Modules must not have hooks registered at the time they are passed."
            )
            assert all(not b.requires_grad for b in fn.buffers()), "All buffers must have requires_grad=False."
        assert all(isinstance(a, torch.Tensor) for a in args), "sample_args must be a tuple of Tensors."
    params = [tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else () for fn in callables]
    # the static input surfaces: a list of sample args fails here, as in the bridge (list + tuple)
    surfaces = [sample_args[i] + params[i] for i in range(len(callables))]
    graphed = []
    for fn, args, surface in zip(callables, sample_args, surfaces, strict=False):
        static_inputs = [a.detach().clone() for a in surface[: len(args)]]

        def replay(user_args, _static=static_inputs):
            for static, arg in zip(
                _static, user_args, strict=False
            ):  # the bridge copies each input into its static tensor
                static.copy_(arg)

        if isinstance(fn, torch.nn.Module):
            original, training = fn.forward, fn.training

            def forward(*user_args, _module=fn, _original=original, _training=training, _replay=replay):
                _hf.record("hpu.make_graphed_callables.replay", graphed=_module.training == _training)
                _replay(user_args)
                return _original(*user_args)

            fn.forward = forward
            graphed.append(fn)
        else:

            def function(*user_args, _fn=fn, _replay=replay):
                _replay(user_args)
                return _fn(*user_args)

            graphed.append(function)
    return graphed[0] if single else tuple(graphed)


def _reached_parameters(outputs) -> set[int]:
    """ids of the leaf tensors the autograd graph of `outputs` accumulates gradients into."""
    seen, reached = set(), set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            reached.add(id(node.variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def _materialize_unused_grads(outputs, model):
    """``torch.autograd.grad(..., allow_unused=True, materialize_grads=True)`` in the captured backward
    (``graphs.py``): each trainable parameter the forward did not use gets a zero gradient."""
    differentiable = [t for t in _tensors(outputs) if t.requires_grad]
    if not differentiable:
        return
    reached = _reached_parameters(differentiable)
    unused = [p for p in model.parameters() if p.requires_grad and id(p) not in reached]

    def zero_grads(_grads):
        for parameter in unused:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)

    if unused:
        torch.autograd.graph.register_multi_grad_hook(differentiable, zero_grads, mode="any")


def _tensors(obj):
    """The tensors ``TensorPacker.pack`` finds in nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _capture_backward(outputs, inputs, allow_unused):
    """``make_graphed_callables`` captures the backward with ``torch.autograd.grad(..., allow_unused=
    allow_unused_input)``: an input that requires grad but was not used fails unless allowed."""
    outputs = [t for t in _tensors(outputs) if t.requires_grad]
    inputs = [t for t in inputs if t.requires_grad]
    if not allow_unused and outputs and inputs:
        grad_outputs = [torch.zeros_like(t) for t in outputs]
        torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True, allow_unused=False)


class _OpRecording(TorchDispatchMode):
    """What ``HPUGraph.capture_begin`` / ``capture_end`` keep of a forward: the tensor ops it ran, each with its
    arguments and outputs at their addresses (static buffers), and none of the Python that decided them."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self):
        """``HPUGraph.replay``: the recorded ops again, on the capture's tensors (the graph inputs hold the new
        batch by then), each result landing where the capture's was. Values a Python branch, a shape or a
        ``.item()`` took at capture stay as they were; a result of another shape than at capture fails."""
        for func, args, kwargs, out in self.ops:
            result = func(*args, **kwargs)
            for static, fresh in zip(_flat_tensors(out), _flat_tensors(result), strict=True):
                if static.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():  # not a view/in-place
                    static.copy_(fresh)


def _flat_tensors(value):
    return [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]


class _Captured:
    def __init__(self, inputs, outputs, recording):
        self.inputs = inputs  # the caller's tensors of the capture call: replays copy new inputs into them
        self.outputs = _detached(outputs)
        self.recording = recording


def _copy_into(dst, src):
    """The real ``copy_to``: same types, dict keys in the same order, plain ``zip`` (no length check)."""
    assert type(dst) == type(src)  # noqa: E721  (the bridge compares types exactly)
    if isinstance(dst, dict):
        for (dst_key, dst_value), (src_key, src_value) in zip(dst.items(), src.items(), strict=False):
            assert dst_key == src_key
            _copy_into(dst_value, src_value)
    elif isinstance(dst, (list, tuple)) and not isinstance(dst, torch.Size):
        for d, s in zip(dst, src, strict=False):
            _copy_into(d, s)
    elif isinstance(dst, torch.Tensor):
        dst.copy_(src)


def _tensor_cache_disabled(asked: bool) -> bool:
    """``env_tensor_cache = os.environ.get("PT_HPUGRAPH_DISABLE_TENSOR_CACHE")``: exported, it wins."""
    exported = __import__("os").environ.get("PT_HPUGRAPH_DISABLE_TENSOR_CACHE")
    return asked if exported is None else exported == "1"


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    disable_tensor_cache = _tensor_cache_disabled(disable_tensor_cache)
    _hf.record(
        "hpu.wrap_in_hpu_graph",
        module,
        asynchronous=asynchronous,
        disable_tensor_cache=disable_tensor_cache,
        dry_run=dry_run,
        max_graphs=max_graphs,
    )
    cache = {}
    orig_forward = module.forward

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        warmup_mode = kwargs.pop("warmup_mode", False)
        if kwargs.pop("bypass_hpu_graphs", False):
            _hf.record("hpu.wrap_in_hpu_graph.forward", mode="bypass", training=module.training, graphs=len(cache))
            return orig_forward(*args, **kwargs)
        key = _input_key((args, kwargs))
        kwargs.pop("cache_tensors_list", None)
        captured = cache.get(key)
        if captured is None:
            if max_graphs is not None and len(cache) == max_graphs:
                _hf.record(
                    "hpu.wrap_in_hpu_graph.forward", mode="uncached", training=module.training, graphs=len(cache)
                )
                return orig_forward(*args, **kwargs)
            with _OpRecording() as recording:
                outputs = orig_forward(*args, **kwargs)
            cache[key] = _Captured((args, kwargs), outputs, recording)
            _hf.record("hpu.wrap_in_hpu_graph.forward", mode="capture", training=module.training, graphs=len(cache))
            return outputs
        _hf.record("hpu.wrap_in_hpu_graph.forward", mode="replay", training=module.training, graphs=len(cache))
        if warmup_mode:
            return captured.outputs
        with torch.no_grad():
            _copy_into(captured.inputs, (args, kwargs))
            captured.recording.replay()
        return captured.outputs

    module.forward = forward
    module.clear_cache = cache.clear
    module.clear_inputs = lambda: _hf.record("hpu.wrap_in_hpu_graph.clear_inputs")
    return module


_UNSUPPORTED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)


def _forward_params(forward):
    """The real ``GraphModel.process_function_signature``: name -> default, asserting keyword-friendly args."""
    params = collections.OrderedDict(inspect.signature(forward).parameters)
    for name in list(params):
        kind = params[name].kind
        assert kind not in _UNSUPPORTED, f"Unsupported argument type : {kind}"
        if kind == inspect.Parameter.VAR_KEYWORD:
            print("[WARNING] Variable keyword arguments will not be supported.")
            del params[name]
            continue
        params[name] = params[name].default
    return params


class ModuleCacher(torch.nn.Module):
    """``ModuleCacher(max_graphs=10)(model=model, inplace=True)`` returns ``model`` with a graph-caching forward."""

    def __init__(self, max_graphs=10):
        super().__init__()
        self.max_graphs = max_graphs
        self.graph_keys = []
        self.static_inputs = {}  # per graph key: the arguments of its capture call
        self.iteration_cnt = -1
        self.use_lazy_mode = __import__("os").environ.get("PT_HPU_LAZY_MODE", "1") == "1"
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
        disable_tensor_cache = _tensor_cache_disabled(disable_tensor_cache)
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
        model.is_hpugraph_tracing = lambda: False
        if not inplace:
            model = copy.copy(model)
        self.orig_model = copy.copy(model)
        self.forward_params = _forward_params(self.orig_model.forward)
        self.model = model
        self.allow_unused_input = allow_unused_input
        model.orig_forward = model.forward
        model.forward = self.forward
        model.set_iteration_count = self.set_iteration_count
        model.capture_start = lambda: _hf.record("hpu.ModuleCacher.capture_start")
        model.capture_end = lambda: _hf.record("hpu.ModuleCacher.capture_end")
        return model

    def _full_args(self, args, kwargs):
        full = dict(self.forward_params)
        full.update(zip(list(self.forward_params)[: len(args)], args, strict=False))
        full.update(kwargs)
        return full

    def forward(self, *args, **kwargs):
        self.iteration_cnt += 1  # the real forward's first statement: fails on any other object
        full = self._full_args(args, kwargs)
        key = _input_key(full)
        use_cache = self.model.training and torch.is_grad_enabled() and self.use_lazy_mode
        if use_cache and (key in self.graph_keys or len(self.graph_keys) < self.max_graphs):
            capture = key not in self.graph_keys
            if capture:
                assert not isinstance(
                    self.orig_model, (torch.nn.parallel.DataParallel, torch.nn.parallel.DistributedDataParallel)
                ), "Use DataParallel/DistributedDataParallel only after wrapping with ModuleCacher"
                _hf.record("hpu.ModuleCacher.capture", graphs=len(self.graph_keys) + 1)
            _hf.record("hpu.ModuleCacher.forward", training=self.model.training, cached=True)
            if capture:
                self.static_inputs[key] = full  # the capture call's own tensors become the graph's inputs
            else:  # a replay copies the batch into them (make_graphed_callables: static_input_surface[i].copy_)
                with torch.no_grad():
                    _copy_into(self.static_inputs[key], full)
                full = self.static_inputs[key]
            outputs = self.orig_model(**full)
            if self.allow_unused_input:
                _materialize_unused_grads(outputs, self.orig_model)
            if capture:  # the real GraphModel: inputs are the packed arguments, then the parameters
                inputs = _tensors(full) + list(self.orig_model.parameters())
                _capture_backward(outputs, inputs, self.allow_unused_input)
                self.graph_keys.append(key)
            return outputs
        _hf.record("hpu.ModuleCacher.forward", training=self.model.training, cached=False)
        return self.model.orig_forward(*args, **kwargs)

    def set_iteration_count(self, iter_num):
        _hf.record("hpu.ModuleCacher.set_iteration_count", iter_num)
