"""fast_ddp: average gradients with one all-reduce over one contiguous buffer, without a DDP wrapper.

DDP buckets gradients and overlaps their all-reduce with backward, which pays off on fast links with
many buckets in flight; on Gaudi's graph-compiled steps (and on small models everywhere) one fused
collective per optimizer step is cheaper: pack all gradients into a buffer allocated once, all-reduce
it, unpack. A bf16 buffer halves the bytes on the wire.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class FastDDPError(RuntimeError):
    """The gradients cannot be fused as set up (their set changed between steps)."""


class FusedGradientAllReduce:
    """Averages the gradients of `params` across the process group, in place, with a single all-reduce."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype = torch.float32, group=None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.dtype = dtype
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._grads_of: list[nn.Parameter] = []

    def _allocate(self, with_grads: list[nn.Parameter]) -> None:
        total = sum(p.numel() for p in with_grads)
        self._buffer = torch.empty(total, dtype=self.dtype, device=with_grads[0].device)
        self._views, offset = [], 0
        for p in with_grads:
            self._views.append(self._buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._grads_of = with_grads

    def __call__(self) -> None:
        with_grads = [p for p in self.params if p.grad is not None]
        if not with_grads:
            return
        if self._buffer is None:
            self._allocate(with_grads)
        elif len(with_grads) != len(self._grads_of) or any(
            a is not b for a, b in zip(with_grads, self._grads_of, strict=True)
        ):
            raise FastDDPError(
                f"fast_ddp: {len(with_grads)} parameters have gradients this step, {len(self._grads_of)} had them "
                "when the fusion buffer was built; freeze parameters before training or use --distribution_strategy ddp."
            )
        grads = [p.grad for p in with_grads]
        with torch.no_grad():
            torch._foreach_copy_(self._views, grads)
            dist.all_reduce(self._buffer, group=self.group)
            self._buffer.div_(self.world_size)
            torch._foreach_copy_(grads, self._views)

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()


def broadcast_parameters(model: nn.Module, src: int = 0, group=None) -> None:
    """Start every rank from rank `src`'s weights, as DDP does when it wraps a model."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)


class FastDDPModel(nn.Module):
    """Marks a model as handled by fast_ddp so the trainer does not wrap it in DDP; forward is the model's."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def unwrap_the_marker_too(accelerator: Any) -> None:
    """``accelerator.unwrap_model`` takes :class:`FastDDPModel` off first, as accelerate takes off DDP, FSDP and
    DeepSpeed's engines (it knows no others): transformers unwraps the trained model through it to tell a causal
    LM for label smoothing and a model already wrapped at a second train(), the trainer to find the fused loss's
    output layer. Only this accelerator's method changes; the trainer calls this once per Accelerator, on the one
    transformers has just made (a second call would only unwrap nothing more)."""
    unwrap = accelerator.unwrap_model

    def unwrap_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        while isinstance(model, FastDDPModel):
            model = model.module
        return unwrap(model, *args, **kwargs)

    accelerator.unwrap_model = unwrap_model
