"""Fused RMSNorm and rotary embedding for Llama-family models, without forking a model class.

Where the device has a fused kernel (a Gaudi: ``hpex.normalization.FusedRMSNorm``, ``hpex.kernels`` rotary
helpers), the model's own modules and functions are swapped narrowly:

- each RMSNorm module whose ``forward`` is Llama's formula gets an instance-level ``forward`` calling the kernel
  (the class, the parameters and ``state_dict`` stay as they are, so a saved model is the user's own);
- each attention layer that calls its modeling module's ``apply_rotary_pos_emb``, where that function is Llama's
  rotate-half one, runs the kernel in its place (the module function dispatches to the kernel only while such
  a layer of this model runs on that thread).

Anything else (Gemma's ``1 + weight`` norm, GPT-J's pairwise rotation) is left alone: the swap is decided by
the code being the same as Llama's, not by the class name. On devices without such kernels nothing is touched,
so results there are exactly the model's own. transformers' hub-kernel decorators (``use_kernel_forward_from_hub``)
name these same two places; they need the ``kernels`` package and know no Gaudi kernels.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..seam import Seam

logger = logging.getLogger(__name__)

RMSNormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (hidden, weight, eps) -> normalized
RotaryKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, cos, sin) -> rotated x


@functools.cache
def _reference_source(kind: str) -> str:
    from transformers.models.llama import modeling_llama

    reference = modeling_llama.LlamaRMSNorm.forward if kind == "rms_norm" else modeling_llama.apply_rotary_pos_emb
    return _normalized_source(reference)


def _normalized_source(function: Any) -> str:
    """Source without decorators, comments, docstrings and blank lines: code copied from Llama compares equal."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return ""
    source = re.sub(r'"""[\s\S]*?"""', "", source)
    lines = [line.split("#", 1)[0].rstrip() for line in source.splitlines()]
    return "\n".join(line for line in lines if line.strip() and not line.lstrip().startswith("@"))


def is_llama_rms_norm(module: nn.Module) -> bool:
    forward = type(module).forward
    return (
        hasattr(module, "weight")
        and hasattr(module, "variance_epsilon")
        and (_normalized_source(forward) == _reference_source("rms_norm"))
    )


def fuse_rms_norms(model: nn.Module, kernel: RMSNormKernel) -> int:
    """Give every Llama-style RMSNorm of ``model`` the fused kernel; returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if "forward" not in vars(module) and is_llama_rms_norm(module):
            fused = types.MethodType(_fused_rms_norm_forward(kernel), module)
            Seam.of(module, "forward").put("fused_rms_norm", lambda own, fused=fused: fused)
            swapped += 1
    return swapped


def _fused_rms_norm_forward(kernel: RMSNormKernel) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernel(hidden_states, self.weight, self.variance_epsilon)

    return forward


class _ActiveRotary(threading.local):
    """The fused kernel of the attention layer running on this thread; None outside such a layer (the modeling
    module's own function runs). Set and restored around each fused layer's forward, so it is a dynamic scope, and
    one per thread: a model another thread runs meanwhile never takes this one's kernel. A thread-local rather than
    a ``ContextVar``: dynamo traces (and guards) a thread-local's attribute as it does a global, but cannot trace
    ``ContextVar.get``, which would break the graph of every compiled attention layer."""

    def __init__(self) -> None:
        # in each thread's own dict from the start (threading.local runs this once a thread): dynamo guards a
        # compiled frame on the attribute being absent from it, which the frame's own write would then break
        self.kernel: RotaryKernel | None = None


_active_rotary = _ActiveRotary()


def fuse_rotary(model: nn.Module, kernel: RotaryKernel) -> int:
    """Run the fused kernel as ``apply_rotary_pos_emb`` inside the attention layers of ``model`` whose modeling
    module's function is Llama's; returns how many layers. The module function is replaced once by one that
    uses the kernel only while such a layer runs, so every other model in the process keeps its own."""
    swapped = 0
    for module in model.modules():
        home = sys.modules.get(type(module).__module__)
        code = inspect.unwrap(type(module).forward).__code__  # under decorators such as deprecate_kwarg
        if "forward" in vars(module) or "apply_rotary_pos_emb" not in code.co_names:
            continue
        if not _install_dispatch(home):
            continue
        with_kernel = types.MethodType(_with_rotary(kernel, type(module).forward), module)
        Seam.of(module, "forward").put("fused_rotary", lambda own, with_kernel=with_kernel: with_kernel)
        swapped += 1
    return swapped


def _install_dispatch(home: Any) -> bool:
    current = getattr(home, "apply_rotary_pos_emb", None)
    if getattr(current, "_gaudi_dispatch", False):
        return True
    if current is None or _normalized_source(current) != _reference_source("rotary"):
        return False

    @functools.wraps(current)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        kernel = _active_rotary.kernel
        if kernel is None:
            return current(q, k, cos, sin, unsqueeze_dim, **kwargs)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return kernel(q, cos, sin), kernel(k, cos, sin)

    apply_rotary_pos_emb._gaudi_dispatch = True
    home.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _with_rotary(kernel: RotaryKernel, forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def forward_with_kernel(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        previous, _active_rotary.kernel = _active_rotary.kernel, kernel
        try:
            return forward(self, *args, **kwargs)
        finally:
            _active_rotary.kernel = previous

    return forward_with_kernel


def use_device_kernels(model: nn.Module, rms_norm: RMSNormKernel | None, rotary: RotaryKernel | None) -> dict[str, Any]:
    """Swap in what the device has; says once what changed."""
    done: dict[str, Any] = {}
    if rms_norm is not None:
        done["fused RMSNorm modules"] = fuse_rms_norms(model, rms_norm)
    if rotary is not None:
        done["attention layers with the fused rotary embedding"] = fuse_rotary(model, rotary)
    done = {what: count for what, count in done.items() if count}
    if done:
        logger.info("Gaudi LLM kernels: %s", "; ".join(f"{k} {v}" for k, v in done.items()))
    return done
