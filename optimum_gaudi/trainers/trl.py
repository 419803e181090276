"""TRL's SFT, DPO and GRPO trainers with the Gaudi features: the installed TRL classes plus the Gaudi mixins.

Nothing of TRL is copied: each trainer is ``GaudiTrainerMixin`` + TRL's trainer and each config is
``GaudiTrainingArgumentsMixin`` + TRL's config, so a TRL upgrade brings its fixes and features with it.
Needs the optional extra: ``pip install optimum-gaudi[trl]``. TRL < 1's keywords and flags on optimum-habana's
TRL scripts (``--max_seq_length``, ``DPOTrainer(beta=..., tokenizer=...)``, ``--max_prompt_length``) are read with
their meaning in the installed TRL (trl_legacy.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

try:
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
except ImportError:
    raise ImportError("optimum_gaudi.trl needs TRL: pip install optimum-gaudi[trl]") from None

from .trainer import GaudiTrainerMixin
from .training_args import GaudiArgumentError, GaudiTrainingArgumentsMixin
from .trl_legacy import bare_switches, dropped, move_keywords, renamed

logger = logging.getLogger(__name__)

__all__ = [
    "GaudiDPOConfig",
    "GaudiDPOTrainer",
    "GaudiGRPOConfig",
    "GaudiGRPOTrainer",
    "GaudiSFTConfig",
    "GaudiSFTTrainer",
]


@bare_switches
@dataclass
class GaudiSFTConfig(GaudiTrainingArgumentsMixin, SFTConfig):
    """TRL's SFTConfig with the Gaudi options; ``max_seq_length`` is TRL < 1's name of ``max_length``."""

    max_seq_length: int | None = field(
        default=None, metadata={"help": "TRL < 1's name of --max_length, read as it (with one line)."}
    )

    def __post_init__(self) -> None:
        if self.max_seq_length is not None:
            _check_length("max_seq_length", self.max_seq_length)
            self.max_length = self.max_seq_length
            logger.warning("--max_seq_length (TRL < 1) is read as --max_length %d; pass that instead.", self.max_length)
        super().__post_init__()


def _check_length(name: str, value: int) -> None:
    if value < 1:
        raise GaudiArgumentError(f"--{name} must be >= 1, got {value}.")


def _buckets(trainer: str, args: Any, value: int, keywords: dict[str, Any]) -> None:
    """optimum-habana's SFT bucketing (num_buckets > 0: batches padded to a few fixed lengths)."""
    if value > 0:
        logger.warning(
            "%s(num_buckets=%d): optimum-habana's length buckets are not implemented; batches are padded as TRL "
            "pads them (set pad_to_multiple_of in GaudiSFTConfig for fewer shapes).",
            trainer,
            value,
        )


class GaudiSFTTrainer(GaudiTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer with the Gaudi features; takes a GaudiSFTConfig and an optional ``gaudi_config``."""

    gaudi_args_class = GaudiSFTConfig

    def _move_removed_keywords(self, args: GaudiSFTConfig, trainer_kwargs: dict[str, Any]) -> None:
        move_keywords(
            self,
            args,
            trainer_kwargs,
            {"max_seq_length": renamed("max_seq_length", "max_length"), "num_buckets": _buckets},
        )


@bare_switches
@dataclass
class GaudiDPOConfig(GaudiTrainingArgumentsMixin, DPOConfig):
    """TRL's DPOConfig with the Gaudi options, and TRL < 1's ``max_prompt_length``."""

    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "TRL < 1's option (TRL 1 dropped it): prompts keep their last N tokens. Unset: whole."},
    )

    def __post_init__(self) -> None:
        if self.max_prompt_length is not None:
            _check_length("max_prompt_length", self.max_prompt_length)
        super().__post_init__()


class GaudiDPOTrainer(GaudiTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer with the Gaudi features; takes a GaudiDPOConfig and an optional ``gaudi_config``."""

    gaudi_args_class = GaudiDPOConfig

    def _move_removed_keywords(self, args: GaudiDPOConfig, trainer_kwargs: dict[str, Any]) -> None:
        reference = dropped(
            "force_use_ref_model={value} (TRL < 1) is dropped: TRL 1 uses the ref_model you pass, with or without "
            "peft_config; drop the keyword."
        )
        move_keywords(self, args, trainer_kwargs, {"force_use_ref_model": reference})

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: GaudiDPOConfig, dataset_name: str) -> Any:
        """TRL's tokenized rows, each prompt cut to its last ``max_prompt_length`` tokens as TRL < 1 cut them:
        before TRL drops the rows whose prompt alone fills ``max_length``."""
        cut = args.max_prompt_length
        if cut is None:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        max_length, args.max_length = args.max_length, None
        try:
            rows = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        finally:
            args.max_length = max_length
        rows = rows.map(lambda row: {"prompt_ids": row["prompt_ids"][-cut:]})
        if max_length is not None and args.truncation_mode == "keep_start":
            rows = rows.filter(lambda row: len(row["prompt_ids"]) < max_length)
        return rows


@bare_switches
@dataclass
class GaudiGRPOConfig(GaudiTrainingArgumentsMixin, GRPOConfig):
    """TRL's GRPOConfig with the Gaudi options, and TRL < 1's ``max_prompt_length`` and ``chat_template``. Where the
    device compiles a graph per shape (a Gaudi in lazy mode), completions are generated with a fixed-size
    key/value cache unless ``cache_implementation`` is set."""

    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "TRL < 1's option (TRL 1 dropped it): text prompts keep their last N tokens. Unset: whole."},
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "optimum-habana's: a chat template its grpo.py sets on the tokenizer (the trainer does not)."
        },
    )

    def __post_init__(self) -> None:
        if self.max_prompt_length is not None:
            _check_length("max_prompt_length", self.max_prompt_length)
        super().__post_init__()
        if self.cache_implementation is None and self.gaudi_device.static_shapes(self.use_lazy_mode):
            self.cache_implementation = "static"


class GaudiGRPOTrainer(GaudiTrainerMixin, GRPOTrainer):
    """TRL's GRPOTrainer with the Gaudi features; takes a GaudiGRPOConfig and an optional ``gaudi_config``."""

    gaudi_args_class = GaudiGRPOConfig

    def _move_removed_keywords(self, args: GaudiGRPOConfig, trainer_kwargs: dict[str, Any]) -> None:
        move_keywords(self, args, trainer_kwargs, {})

    def _tokenize_prompts(self, prompts: list) -> tuple:
        """TRL's prompt tokens, a text prompt's cut to its last ``max_prompt_length`` as TRL < 1 cut them."""
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        cut = self.args.max_prompt_length
        if cut is not None and images is None and not multimodal_fields:
            prompt_ids = [ids[-cut:] for ids in prompt_ids]
        return prompt_ids, images, multimodal_fields
