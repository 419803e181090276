"""What this package needs from the installed transformers, checked once per trainer class.

The Gaudi features override a handful of Trainer hooks. A release that drops or renames one of them must
fail at construction with one clear line, never silently train without the feature.
"""

from __future__ import annotations

import functools

import transformers

# The Trainer methods GaudiTrainerMixin overrides (docs/architecture.md says which feature uses which).
TRAINER_HOOKS = (
    "_build_accelerator_args",
    "_wrap_model",
    "get_train_dataloader",
    "autocast_smart_context_manager",
    "compute_loss_context_manager",
    "training_step",
    "evaluation_loop",
    "prediction_step",
    "create_optimizer",
    "_clip_grad_norm",
    "log",
    "_save",
)


class TrainerHookError(TypeError):
    """The installed transformers lacks a Trainer hook that a Gaudi feature overrides."""


@functools.cache
def check_trainer_hooks(cls: type) -> None:
    """Fails when a hook the Gaudi mixin overrides is missing from the Trainer classes ``cls`` builds on."""
    from .trainer import GaudiTrainerMixin

    mro = cls.__mro__
    parents = mro[mro.index(GaudiTrainerMixin) + 1 :]
    missing = [name for name in TRAINER_HOOKS if not any(name in vars(p) for p in parents)]
    if missing:
        raise TrainerHookError(
            f"{cls.__name__}: transformers {transformers.__version__} has no Trainer.{', Trainer.'.join(missing)}, "
            "which the Gaudi features override; install a transformers release that optimum-gaudi supports (see setup.py)."
        )
