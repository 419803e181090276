"""bf16 autocast that follows a Gaudi config's operator lists on devices whose torch.autocast cannot.

On a Gaudi the bridge reads the lists from files named by environment variables. torch's CPU and CUDA
autocast have fixed, built-in lists, so the same config would mean different numerics there; this
TorchFunctionMode casts the inputs of exactly the listed functions and leaves every other op alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def op_name(func: Any) -> str:
    """The operator name a list entry refers to: `F.linear` -> linear, `Tensor.__matmul__` -> matmul."""
    name = getattr(func, "__name__", "")
    return name.strip("_") if name.startswith("__") else name


def _known_op(name: str) -> bool:
    return any(hasattr(ns, name) for ns in (torch, torch.nn.functional, torch.Tensor))


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


class OpListAutocast(TorchFunctionMode):
    """Run the functions named in `bf16_ops` in `lower_dtype` and those in `fp32_ops` in float32."""

    def __init__(
        self, bf16_ops: Iterable[str] = (), fp32_ops: Iterable[str] = (), lower_dtype: torch.dtype = torch.bfloat16
    ) -> None:
        super().__init__()
        bf16_ops, fp32_ops = list(bf16_ops or ()), list(fp32_ops or ())
        both = sorted(set(bf16_ops) & set(fp32_ops))
        if both:
            raise ValueError(f"Ops {both} are in both the bf16 and the fp32 autocast lists; keep each op in one list.")
        unknown = sorted(name for name in bf16_ops + fp32_ops if not _known_op(name) and name not in _warned)
        _warned.update(unknown)  # once per process: a mode is built for every step
        if unknown:
            logger.warning("Autocast op names %s are not torch functions here; they only apply on a Gaudi.", unknown)
        self.targets = {name: lower_dtype for name in bf16_ops} | {name: torch.float32 for name in fp32_ops}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.targets.get(op_name(func))
        if dtype is not None:
            args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
        return func(*args, **kwargs)
