"""bf16 autocast that follows a Gaudi config's aten operator lists on CPU and CUDA, eager and compiled.

On a Gaudi the bridge reads the lists from files named by environment variables. torch's CPU and CUDA
autocast have fixed, built-in lists, so the same config would mean different numerics there. Instead of
intercepting every Python call, this module gives torch's own autocast our lists: it registers a small
kernel on the device's Autocast dispatch key for exactly the listed aten ops (cast the inputs, run the op
below autocast) and a fallthrough for torch's own autocast ops that are not listed. Because the casts
happen in the dispatcher, torch.compile's tracing bakes them into the graph: no graph break, and eager
pays Python only on the listed ops.

Dispatcher registrations are process-wide, so they exist only while an :class:`OpListAutocast` is
entered, or kept for a whole loop (:meth:`OpListAutocast.kept`: the trainer keeps them for each train,
evaluation and prediction loop, so that a step does not register some 130 kernels again); afterwards
torch's kernels come back and plain ``torch.autocast`` means what it always meant.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# torch's own "promote" kernels (run in the widest input dtype) make mixed-dtype calls legal rather than
# choosing a precision, so they stay registered (facts from torch's aten/src/ATen/autocast_mode.cpp).
_TORCH_PROMOTE_OPS = {
    "AutocastCPU": {"aten::cat", "aten::stack", "aten::index_copy"},
    "AutocastCUDA": {
        "aten::addcdiv", "aten::addcmul", "aten::atan2", "aten::bilinear", "aten::cross", "aten::dot",
        "aten::vdot", "aten::grid_sampler", "aten::index_put", "aten::tensordot", "aten::scatter_add",
    },
}  # fmt: skip

# The bridge casts only the first argument (the input, not weight and bias) of these when they are in the
# lower-precision list (hpu_ops/autocast_helpers.h, lower_first_ops).
_LOWER_FIRST_ARG = {"layer_norm", "group_norm", "instance_norm", "batch_norm"}

_warned_names: set[str] = set()


def _warn_unknown(names: list[str]) -> None:
    new = sorted(set(names) - _warned_names)
    if new:
        _warned_names.update(new)
        logger.warning(
            "Autocast op names %s are not aten operators in this torch %s; they apply only on a Gaudi.",
            new,
            torch.__version__,
        )


def aten_overloads(name: str) -> list[torch._ops.OpOverload] | None:
    """The aten overloads a list entry names (`softmax` -> softmax.int, softmax.Dimname); None if unknown.

    Out= variants are left alone: their output dtype is fixed by the caller, as in torch's autocast.
    """
    name = name.removeprefix("aten::")
    base, _, overload = name.partition(".")
    try:
        packet = getattr(torch.ops.aten, base)
    except (AttributeError, RuntimeError):
        return None
    names = [overload] if overload else packet.overloads()
    try:
        ops = [getattr(packet, o) for o in names]
    except AttributeError:
        return None
    return [op for op in ops if not any(a.is_out for a in op._schema.arguments)]


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.dtype not in (dtype, torch.float64)
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _wider_operands(operands: tuple, dtype: torch.dtype) -> torch.dtype | None:
    """The floating dtype of a norm's weights and statistics when it differs from its input's `dtype`."""
    found = {v.dtype for v in operands if isinstance(v, torch.Tensor) and v.is_floating_point()} - {dtype}
    return functools.reduce(torch.promote_types, found) if found else None


def _cast_kernel(op: torch._ops.OpOverload, dtype: torch.dtype, exclude: Any, first_only: bool) -> Callable:
    """Cast floating inputs to `dtype` and run `op` with the autocast key excluded (torch's own recipe).

    A norm that casts only its input keeps float32 weights: the Gaudi's kernel and torch's CPU one take the
    mixed operands, CUDA's refuse them ("expected scalar type BFloat16 but found Float"). So every device gets
    what those kernels compute: the bf16-rounded input normalized in the weights' dtype, returned in bf16."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        # the casts too run below autocast: they are `_to_copy` calls, which a list may name (no recursion)
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if first_only and args:
                args = (_cast(args[0], dtype), *args[1:])
                wider = _wider_operands(args[1:] + tuple(kwargs.values()), dtype)
                if wider is not None:
                    return _cast(op(args[0].to(wider), *args[1:], **kwargs), dtype)
            else:
                args = _cast(args, dtype)
                kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return kernel


class _Registration:
    """The kernels of one (device, lists, dtype) combination, installed while at least one user is inside."""

    _lock = threading.Lock()
    _active: dict[str, _Registration] = {}  # dispatch key -> the registration installed there

    def __init__(self, key: str, targets: dict[str, tuple[torch.dtype, list]]) -> None:
        self.key = key
        self.targets = targets
        self.users = 0
        self.library: torch.library.Library | None = None
        self.identity = (key, tuple(sorted((n, str(d)) for n, (d, _) in targets.items())))

    def acquire(self) -> None:
        with self._lock:
            installed = self._active.get(self.key)
            if installed is not None and installed.identity != self.identity:
                raise RuntimeError(
                    f"Another op-list autocast with different lists is active on {self.key}; "
                    "nest only autocasts with the same lists."
                )
            installed = installed or self
            if installed.users == 0:
                installed._install()
                self._active[self.key] = installed
            installed.users += 1

    def release(self) -> None:
        with self._lock:
            installed = self._active[self.key]
            installed.users -= 1
            if installed.users == 0:
                installed.library._destroy()
                installed.library = None
                del self._active[self.key]

    def _install(self) -> None:
        key = self.key
        exclude = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
        library = torch.library.Library("aten", "IMPL", key)
        ours = set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
            for name, (dtype, ops) in self.targets.items():
                first_only = dtype != torch.float32 and name in _LOWER_FIRST_ARG
                for op in ops:
                    library.impl(op, _cast_kernel(op, dtype, exclude, first_only), key)
                    ours.add(op.name())
            keep = ours | _TORCH_PROMOTE_OPS.get(key, set())
            for registered in torch._C._dispatch_get_registrations_for_dispatch_key(key):
                if registered.startswith("aten::") and registered not in keep:
                    library.impl(registered.removeprefix("aten::"), torch.library.fallthrough_kernel, key)
        self.library = library


class OpListAutocast(contextlib.ContextDecorator):
    """``torch.autocast(device, lower_dtype)`` in which exactly `bf16_ops` run in `lower_dtype` and exactly
    `fp32_ops` in float32 (aten op names, e.g. ``mm``, ``linear``, ``softmax``, ``nll_loss``).

    Enter it outside compiled code (around the call of a compiled model, as the trainer does): the casts
    are then part of the traced graph. A function compiled under one set of lists keeps its casts if
    later called under another.
    """

    def __init__(
        self,
        bf16_ops: Iterable[str] | None = (),
        fp32_ops: Iterable[str] | None = (),
        lower_dtype: torch.dtype = torch.bfloat16,
        device_type: str = "cpu",
    ) -> None:
        bf16_ops, fp32_ops = list(bf16_ops or ()), list(fp32_ops or ())
        both = sorted(set(bf16_ops) & set(fp32_ops))
        if both:
            raise ValueError(f"Ops {both} are in both the bf16 and the fp32 autocast lists; keep each op in one list.")
        if device_type not in _AUTOCAST_KEYS:
            raise ValueError(f"Op-list autocast runs on {sorted(_AUTOCAST_KEYS)}, not on '{device_type}'.")
        targets, unknown = {}, []
        for names, dtype in ((bf16_ops, lower_dtype), (fp32_ops, torch.float32)):
            for name in names:
                ops = aten_overloads(name)
                if ops is None:
                    unknown.append(name)
                else:
                    targets[name.removeprefix("aten::")] = (dtype, ops)
        _warn_unknown(unknown)
        self.device_type, self.lower_dtype = device_type, lower_dtype
        self.bf16_ops, self.fp32_ops = bf16_ops, fp32_ops
        self._registration = _Registration(_AUTOCAST_KEYS[device_type], targets)
        self._autocasts: list[torch.autocast] = []

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Keep this autocast's kernels installed for the duration (e.g. a training loop), so that each
        entry only turns torch.autocast on. Meanwhile a plain ``torch.autocast`` on this device, should
        any code enter one, follows these lists too."""
        self._registration.acquire()
        try:
            yield
        finally:
            self._registration.release()

    def __enter__(self) -> OpListAutocast:
        self._registration.acquire()
        autocast = torch.autocast(device_type=self.device_type, dtype=self.lower_dtype)
        try:
            autocast.__enter__()
        except BaseException:
            self._registration.release()
            raise
        self._autocasts.append(autocast)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._autocasts.pop().__exit__(*exc)
        finally:
            self._registration.release()
