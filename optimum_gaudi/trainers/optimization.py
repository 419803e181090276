"""The optimizer's Gaudi parts: the device's fused AdamW chosen where it applies, step counts that resume across
AdamW kinds, and the device's fused gradient clipping, built once per model and norm."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from ..features.adam_state import keep_step_counts_on_load

logger = logging.getLogger(__name__)

# Optimizer names for which use_fused_adam swaps in the device's fused AdamW (same update rule).
ADAMW_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def fused_adamw_choice(trainer: Any, model: nn.Module | None) -> tuple[type, dict[str, Any]] | None:
    """``use_fused_adam``: the device's fused AdamW class and its keyword arguments (the run's AdamW settings), or
    None where the trainer's own choice stands (a user's optimizer, not AdamW, FSDP's DTensors the device's
    optimizer does not take: each said in one line)."""
    args, device = trainer.args, trainer.gaudi_device
    if trainer.optimizer is not None or trainer.optimizer_cls_and_kwargs is not None:
        return None
    if not trainer.gaudi_config.use_fused_adam:
        return None
    if args.optim not in ADAMW_OPTIMIZERS:
        logger.warning("use_fused_adam is ignored because --optim %s is not AdamW.", args.optim)
        return None
    if trainer.is_fsdp_enabled and not device.fused_adamw_takes_dtensors:
        logger.warning(
            "use_fused_adam: the device's fused AdamW does not take FSDP's sharded (DTensor) parameters; "
            "torch's AdamW (--optim %s) updates the shards.",
            args.optim,
        )
        return None
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model or trainer.model)
    kwargs.pop("fused", None)
    fused_cls, fused_kwargs = device.fused_adamw()
    return fused_cls, {**kwargs, **fused_kwargs}


def keep_step_counts(trainer: Any, optimizer: torch.optim.Optimizer) -> None:
    """Any AdamW made by the trainer resumes from a checkpoint of the other kind (features/adam_state.py)."""
    device = trainer.gaudi_device
    fused_cls, _ = device.fused_adamw() if trainer.gaudi_config.use_fused_adam else (None, None)
    if fused_cls is not None and isinstance(optimizer, fused_cls):
        keep_step_counts_on_load(optimizer, device.fused_adamw_counts_steps_per_group)
    elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        keep_step_counts_on_load(optimizer, counts_per_group=False)


class DeviceClipping:
    """``use_fused_clip_norm``: the device's clipper of a model's gradients, built again only for another model or
    norm. A weak reference, not ``id()``: a new model (model_init, hyperparameter search) may reuse a freed id."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._built: tuple[weakref.ref, float, Any] | None = None  # (the model, max_norm, clipper)

    def clip(self, model: nn.Module, max_norm: float) -> Any:
        built = self._built
        if built is None or built[0]() is not model or built[1] != max_norm:
            built = (weakref.ref(model), max_norm, self.device.grad_clipper(model.parameters(), max_norm))
            self._built = built
        return built[2]()
