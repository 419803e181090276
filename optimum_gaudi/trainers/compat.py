"""What this package needs from the installed transformers: the hooks, a shim per older release, one check.

The Gaudi features override a handful of Trainer hooks. Older releases (5.0 to 5.2, 4.57) lack some of them, which
the small shims below rebuild from what those releases do have; ``get_cp_size`` (context parallelism's divisor) is 1
where it is missing, and context parallelism is refused there (distributed/layout.py). The shims sit between the Gaudi mixin and the
Trainer and are empty on a release that has every hook. A release that drops or renames a hook with no shim fails at
construction with one clear line, never silently trains without the feature.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterable, Iterator
from typing import Any

import transformers
from torch import nn
from transformers import Trainer

# The Trainer methods GaudiTrainerMixin overrides (docs/architecture.md says which feature uses which).
TRAINER_HOOKS = (
    "_build_accelerator_args",
    "create_accelerator_and_postprocess",  # --report_to checked when the trainer is built
    "_wrap_model",
    "autocast_smart_context_manager",
    "compute_loss_context_manager",
    "compute_loss",  # --use_fused_linear_cross_entropy
    "training_step",
    "evaluation_loop",
    "prediction_step",
    "create_optimizer",
    "_clip_grad_norm",
    "log",
    "save_model",  # under FSDP2, a plain transformers checkpoint streamed (distributed/full_weights.py)
    "_save",
    "train",  # the checkpoint hooks (optimum_gaudi.checkpoints)
    "_get_output_dir",
    "_save_checkpoint",
    "_save_optimizer_and_scheduler",  # --async_save: FSDP's shards written in the background
    "_load_from_checkpoint",  # the fp8 scaling state a checkpoint keeps beside the weights (precision/fp8.py)
    "_load_callback_state",  # run totals kept out of callback-state matching (metrics.py)
    "get_cp_size",  # context parallelism: the ranks that share a batch (distributed/layout.py)
    "get_train_dataloader",  # context parallelism: those ranks read the same batches
)


try:
    from transformers.trainer_pt_utils import nested_gather
except ImportError:  # transformers < 5.2 had it as a Trainer method, _nested_gather

    def nested_gather(tensors: Any, parallel_mode: Any, name: str | None = None) -> Any:
        """``tensors`` gathered from every process where training is distributed (no XLA, no SageMaker)."""
        from transformers.trainer_pt_utils import distributed_concat
        from transformers.training_args import ParallelMode

        if tensors is None or parallel_mode != ParallelMode.DISTRIBUTED:
            return tensors
        return distributed_concat(tensors)


class TrainerHookError(TypeError):
    """The installed transformers lacks a Trainer hook that a Gaudi feature overrides."""


class _CreateOptimizerTakesModel:
    """transformers < 5.3: ``create_optimizer()`` has no ``model`` argument and always uses ``self.model``."""

    def create_optimizer(self, model: nn.Module | None = None):
        return super().create_optimizer()


class _Parameters:
    """A stand-in for the model where an older release hands over only its parameters."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self._parameters = list(parameters)

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._parameters)


class _ClipGradNormHook:
    """transformers < 5.3 clips inline, ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``:
    that call is routed through a ``_clip_grad_norm(model)`` hook, as later releases have it."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerate_clip = self._accelerate_clip_grad_norm = self.accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, *args: Any, **kwargs: Any):
            if args or kwargs or max_norm != self.args.max_grad_norm:  # not the training loop's clipping
                return accelerate_clip(parameters, max_norm, *args, **kwargs)
            # The same wrapper while the parameters stay the same, so the trainer keeps its built clipper (the
            # wrapper holds the parameters, so their ids cannot be reused while it is compared).
            params = list(parameters)
            held = getattr(self, "_clip_parameters", None)
            if held is None or list(map(id, held.parameters())) != list(map(id, params)):
                self._clip_parameters = held = _Parameters(params)
            return self._clip_grad_norm(held)

        self.accelerator.clip_grad_norm_ = clip_grad_norm_

    def _clip_grad_norm(self, model: nn.Module):
        return self._accelerate_clip_grad_norm(model.parameters(), self.args.max_grad_norm)


class _BuildAcceleratorArgsHook:
    """transformers < 5.2 builds the Accelerator's arguments inline: the mixed precision that
    ``_build_accelerator_args`` settles is handed over through what those releases read (the training
    arguments' ``mixed_precision`` on 5.0 and 5.1, accelerate's environment variable on 4.57)."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        mixed_precision = getattr(self.args, "mixed_precision", None)
        return {"mixed_precision": mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")}

    def create_accelerator_and_postprocess(self) -> None:
        wanted = self._build_accelerator_args()["mixed_precision"]
        with _mixed_precision(self.args, wanted):
            super().create_accelerator_and_postprocess()


@contextlib.contextmanager
def _mixed_precision(args: Any, value: str) -> Iterator[None]:
    saved_env = os.environ.get("ACCELERATE_MIXED_PRECISION")
    saved_arg = getattr(args, "mixed_precision", None)
    os.environ["ACCELERATE_MIXED_PRECISION"] = value
    if saved_arg is not None:
        args.mixed_precision = value
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = saved_env
        if saved_arg is not None:
            args.mixed_precision = saved_arg


class _CpSize:
    """A transformers without ``get_cp_size``: nothing there divides by it (and context parallelism is refused
    there in one line, distributed/layout.py)."""

    def get_cp_size(self) -> int:
        return 1


SHIMS = tuple(
    shim
    for shim, needed in (
        (_CreateOptimizerTakesModel, "model" not in inspect.signature(Trainer.create_optimizer).parameters),
        (_ClipGradNormHook, not hasattr(Trainer, "_clip_grad_norm")),
        (_BuildAcceleratorArgsHook, not hasattr(Trainer, "_build_accelerator_args")),
        (_CpSize, not hasattr(Trainer, "get_cp_size")),
    )
    if needed
)


class TrainerShims(*SHIMS):
    """Base of GaudiTrainerMixin: the shims this transformers release needs (none on the newest)."""


@functools.cache
def check_trainer_hooks(cls: type, mixin: type) -> None:
    """Fails when a hook ``mixin`` overrides is missing from the Trainer classes ``cls`` builds on after it."""
    mro = cls.__mro__
    parents = mro[mro.index(mixin) + 1 :]
    missing = [name for name in TRAINER_HOOKS if not any(name in vars(p) for p in parents)]
    if missing:
        raise TrainerHookError(
            f"{cls.__name__}: transformers {transformers.__version__} has no Trainer.{', Trainer.'.join(missing)}, "
            "which the Gaudi features override; install a transformers release that optimum-gaudi supports (see setup.py)."
        )
