"""AdaLoRA's rank budget, reallocated as training goes, as optimum-habana's GaudiTrainer does.

PEFT's AdaLoRA prunes the adapters' ranks from importance scores, but only when the training loop calls
``model.base_model.update_and_allocate(step)`` after each optimizer step (its documentation's loop does;
transformers' Trainer does not, so there AdaLoRA keeps its initial ranks). Its schedule also needs the number
of training steps, which a script knows only once the Trainer has counted its batches: peft >= 0.18 refuses an
``AdaLoraConfig`` built without ``total_step``, as optimum-habana's run_lora_clm.py builds it, so importing this
module lets such a config wait for the run's count (:func:`defer_total_step`).
"""

from __future__ import annotations

import functools
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


def defer_total_step() -> None:
    """An ``AdaLoraConfig`` built without ``total_step`` passes peft's checks (peft < 0.18 took it; 0.18 raises
    "AdaLoRA does not work when `total_step` is None") and keeps None until :class:`AdaLoraBudget` sets the run's
    step count and checks the schedule against it. A config given ``total_step`` is checked by peft as before."""
    try:
        from peft import AdaLoraConfig
    except ImportError:
        return
    check = AdaLoraConfig.__post_init__
    if getattr(check, "defers_total_step", False):
        return

    @functools.wraps(check)
    def __post_init__(self) -> None:
        if self.total_step is not None:
            return check(self)
        self.total_step = self.tinit + self.tfinal + 1  # a count peft's schedule check accepts, for its other checks
        try:
            return check(self)
        finally:
            self.total_step = None

    __post_init__.defers_total_step = True
    AdaLoraConfig.__post_init__ = __post_init__


defer_total_step()
