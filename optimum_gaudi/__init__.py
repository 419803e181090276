"""optimum-gaudi: train Hugging Face models on Intel Gaudi (HPU), with the same script on CUDA and CPU."""

from .configuration import GaudiConfig, GaudiConfigError
from .trainer import GaudiTrainer
from .training_args import GaudiArgumentError, GaudiTrainingArguments

__version__ = "0.1.0"

__all__ = [
    "GaudiArgumentError",
    "GaudiConfig",
    "GaudiConfigError",
    "GaudiTrainer",
    "GaudiTrainingArguments",
    "__version__",
]
