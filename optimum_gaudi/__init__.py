"""optimum-gaudi: train Hugging Face models on Intel Gaudi (HPU), with the same script on CUDA and CPU."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Imported on first use: `optimum-gaudi launch` and `env` start in a fraction of a second instead of
# paying for transformers before they need it.
_EXPORTS = {
    "GaudiConfig": ".configuration",
    "GaudiConfigError": ".configuration",
    "GaudiSeq2SeqTrainer": ".seq2seq",
    "GaudiSeq2SeqTrainingArguments": ".seq2seq",
    "GaudiTrainer": ".trainer",
    "GaudiTrainerMixin": ".trainer",
    "GaudiArgumentError": ".training_args",
    "GaudiTrainingArguments": ".training_args",
    "GaudiTrainingArgumentsMixin": ".training_args",
}

__all__ = [
    "GaudiArgumentError",
    "GaudiConfig",
    "GaudiConfigError",
    "GaudiSeq2SeqTrainer",
    "GaudiSeq2SeqTrainingArguments",
    "GaudiTrainer",
    "GaudiTrainerMixin",
    "GaudiTrainingArguments",
    "GaudiTrainingArgumentsMixin",
    "__version__",
]

if TYPE_CHECKING:
    from .configuration import GaudiConfig, GaudiConfigError
    from .seq2seq import GaudiSeq2SeqTrainer, GaudiSeq2SeqTrainingArguments
    from .trainer import GaudiTrainer, GaudiTrainerMixin
    from .training_args import GaudiArgumentError, GaudiTrainingArguments, GaudiTrainingArgumentsMixin


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'optimum_gaudi' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
