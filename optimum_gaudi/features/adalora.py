"""AdaLoRA's rank budget, reallocated as training goes, as optimum-habana's GaudiTrainer does.

PEFT's AdaLoRA prunes the adapters' ranks from importance scores, but only when the training loop calls
``model.base_model.update_and_allocate(step)`` after each optimizer step (its documentation's loop does;
transformers' Trainer does not, so there AdaLoRA keeps its initial ranks). Its schedule also needs the number
of training steps, which a script knows only once the Trainer has counted its batches.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers import TrainerCallback

from ..errors import UserError

logger = logging.getLogger(__name__)


def adalora_configs(model: nn.Module) -> list[Any]:
    """The AdaLoRA adapter configurations of a PEFT model (none for any other model)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return []
    return [config for config in configs.values() if getattr(config, "peft_type", None) == "ADALORA"]


class AdaLoraBudget(TrainerCallback):
    """At train start, sets each AdaLoRA adapter's ``total_step`` to the run's optimizer steps; after each
    optimizer step (gradients still in place), calls ``update_and_allocate`` with the step just taken."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for config in adalora_configs(model):
            if state.max_steps - config.tfinal <= config.tinit:
                raise UserError(
                    f"AdaLoRA: the run has {state.max_steps} optimizer steps, too few for tinit={config.tinit} "
                    f"warm-up and tfinal={config.tfinal} final steps; lower them or train longer."
                )
            config.total_step = state.max_steps
        logger.info("AdaLoRA: rank budget reallocated every optimizer step over %d steps.", state.max_steps)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        model.base_model.update_and_allocate(state.global_step)
