"""What the trainer's constructor reads before the parent Trainer is built (its arguments, in transformers' or
optimum-habana's order, and the Gaudi configuration), and what it says once it is built."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from transformers import TrainingArguments

from ..configuration.gaudi_config import GaudiConfig
from ..features.table import feature_table
from .training_args import GaudiTrainingArgumentsMixin

logger = logging.getLogger("optimum_gaudi.trainers.trainer")  # the run's start is said under the trainer's name


@functools.cache
def _args_position(cls: type, mixin: type) -> int:
    """Where ``args`` sits among the positional parameters of the Trainer that ``cls`` builds on: TRL's
    DPOTrainer takes ``ref_model`` before it, GRPOTrainer ``reward_funcs``. A class whose ``__init__`` only
    passes ``*args, **kwargs`` through is skipped for the next one that names its parameters."""
    mro = cls.__mro__
    for klass in mro[mro.index(mixin) + 1 :]:
        if "__init__" not in vars(klass):
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]
        positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if "args" in positional:
            return positional.index("args")
    raise TypeError(f"{cls.__name__}: no Trainer after GaudiTrainerMixin takes an `args` parameter.")


def _habana_order(trainer_args: tuple, position: int, gaudi_config: Any) -> tuple[tuple, Any]:
    """optimum-habana's ``GaudiTrainer(model, gaudi_config, args, ...)``: a GaudiConfig (or None followed by
    training arguments) where the parent Trainer takes ``args`` is the ``gaudi_config``; the other positional
    arguments keep the parent's order. ``GaudiTrainer(model, args, ...)`` (transformers' order) is unchanged."""
    if len(trainer_args) <= position:
        return trainer_args, gaudi_config
    slot, following = trainer_args[position], trainer_args[position + 1 : position + 2]
    if not (
        isinstance(slot, GaudiConfig) or (slot is None and following and isinstance(following[0], TrainingArguments))
    ):
        return trainer_args, gaudi_config
    if gaudi_config is not None:
        raise TypeError("gaudi_config was given twice: by position (optimum-habana's order) and by keyword.")
    return (*trainer_args[:position], *trainer_args[position + 1 :]), slot


def trainer_arguments(
    trainer: Any, mixin: type, trainer_args: tuple, trainer_kwargs: dict[str, Any], gaudi_config: Any
) -> tuple[tuple, GaudiTrainingArgumentsMixin, Any]:
    """The parent's positional arguments (``args`` built with ``gaudi_args_class`` where left out, put back where
    it was), the training arguments, and the ``gaudi_config`` given, by keyword or in optimum-habana's order."""
    position = _args_position(type(trainer), mixin)
    trainer_args, gaudi_config = _habana_order(trainer_args, position, gaudi_config)
    by_position = "args" not in trainer_kwargs and len(trainer_args) > position
    args = trainer_args[position] if by_position else trainer_kwargs.get("args")
    if args is None:
        args = trainer.gaudi_args_class(output_dir="trainer_output")
        if by_position:
            trainer_args = (*trainer_args[:position], args, *trainer_args[position + 1 :])
        else:
            trainer_kwargs["args"] = args
    if not isinstance(args, GaudiTrainingArgumentsMixin):
        raise TypeError(
            f"{type(trainer).__name__} needs GaudiTrainingArguments (or arguments built with "
            f"GaudiTrainingArgumentsMixin), got {type(args).__name__}; build {trainer.gaudi_args_class.__name__}(...) "
            "with the same keyword arguments."
        )
    return trainer_args, args, gaudi_config


def gaudi_config_of(given: GaudiConfig | dict[str, Any] | str | os.PathLike | None, args: Any) -> GaudiConfig:
    """The run's GaudiConfig: the one given (a dict, a path or a Hub name read), else the arguments', else every
    Gaudi feature off."""
    if isinstance(given, dict):
        given = GaudiConfig.from_dict(given)
    elif given is not None and not isinstance(given, GaudiConfig):
        given = GaudiConfig.from_pretrained(given)
    return given or args.gaudi_config or GaudiConfig()


def say_the_run(trainer: Any) -> None:
    """On the first process: the features on, the Gaudi arguments, the parallel layout and the precision, and
    what DeepSpeed replaces."""
    if not trainer.is_world_process_zero():
        return
    args = trainer.args
    table = feature_table(trainer.gaudi_device, args, trainer.gaudi_config)
    flags = ", ".join(f"{k}={v}" for k, v in args.gaudi_flags().items())
    logger.warning("Gaudi features on this run:\n%s\nGaudi arguments: %s", table, flags)
    logger.warning("Parallel layout: %s", trainer._layout.describe())
    logger.warning("Precision: %s", trainer._precision.describe())
    if trainer.is_deepspeed_enabled:
        _say_what_deepspeed_replaces(trainer)


def _say_what_deepspeed_replaces(trainer: Any) -> None:
    """DeepSpeed clips the gradients itself ("gradient_clipping"), and builds the optimizer its config names;
    the trainer's optimizer (the fused AdamW included) is used, partitioned, only when the config names none."""
    replaced = []
    if trainer.gaudi_config.use_fused_clip_norm:
        replaced.append('use_fused_clip_norm (DeepSpeed clips by its "gradient_clipping")')
    deepspeed_config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    if trainer.gaudi_config.use_fused_adam and "optimizer" in deepspeed_config:
        replaced.append("use_fused_adam (the DeepSpeed config names its own optimizer)")
    if replaced:
        logger.warning("DeepSpeed replaces these Gaudi features on this run: %s.", "; ".join(replaced))
