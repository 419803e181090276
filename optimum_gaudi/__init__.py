"""optimum-gaudi: train Hugging Face models on Intel Gaudi (HPU), with the same script on CUDA and CPU."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _legacy_paths

__version__ = "0.1.0"

# Imported on first use: `optimum-gaudi launch` and `env` start in a fraction of a second instead of
# paying for transformers before they need it.
_EXPORTS = {
    "GaudiConfig": ".configuration.gaudi_config",
    "GaudiConfigError": ".configuration.gaudi_config",
    "GaudiSeq2SeqTrainer": ".trainers.seq2seq",
    "GaudiSeq2SeqTrainingArguments": ".trainers.seq2seq",
    "GaudiTrainer": ".trainers.trainer",
    "GaudiTrainerMixin": ".trainers.trainer",
    "GaudiArgumentError": ".trainers.training_args",
    "GaudiTrainingArguments": ".trainers.training_args",
    "GaudiTrainingArgumentsMixin": ".trainers.training_args",
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
    from .configuration.gaudi_config import GaudiConfig, GaudiConfigError
    from .trainers.seq2seq import GaudiSeq2SeqTrainer, GaudiSeq2SeqTrainingArguments
    from .trainers.trainer import GaudiTrainer, GaudiTrainerMixin
    from .trainers.training_args import GaudiArgumentError, GaudiTrainingArguments, GaudiTrainingArgumentsMixin


_legacy_paths.install()  # module paths from before 0.2's layout: one FutureWarning each


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'optimum_gaudi' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
