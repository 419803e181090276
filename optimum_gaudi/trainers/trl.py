"""TRL's SFT, DPO and GRPO trainers with the Gaudi features: the installed TRL classes plus the Gaudi mixins.

Nothing of TRL is copied: each trainer is ``GaudiTrainerMixin`` + TRL's trainer and each config is
``GaudiTrainingArgumentsMixin`` + TRL's config, so a TRL upgrade brings its fixes and features with it.
Needs the optional extra: ``pip install optimum-gaudi[trl]``.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
except ImportError:
    raise ImportError("optimum_gaudi.trl needs TRL: pip install optimum-gaudi[trl]") from None

from .trainer import GaudiTrainerMixin
from .training_args import GaudiTrainingArgumentsMixin

__all__ = [
    "GaudiDPOConfig",
    "GaudiDPOTrainer",
    "GaudiGRPOConfig",
    "GaudiGRPOTrainer",
    "GaudiSFTConfig",
    "GaudiSFTTrainer",
]


@dataclass
class GaudiSFTConfig(GaudiTrainingArgumentsMixin, SFTConfig):
    """TRL's SFTConfig with the Gaudi options."""


class GaudiSFTTrainer(GaudiTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer with the Gaudi features; takes a GaudiSFTConfig and an optional ``gaudi_config``."""

    gaudi_args_class = GaudiSFTConfig


@dataclass
class GaudiDPOConfig(GaudiTrainingArgumentsMixin, DPOConfig):
    """TRL's DPOConfig with the Gaudi options."""


class GaudiDPOTrainer(GaudiTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer with the Gaudi features; takes a GaudiDPOConfig and an optional ``gaudi_config``."""

    gaudi_args_class = GaudiDPOConfig


@dataclass
class GaudiGRPOConfig(GaudiTrainingArgumentsMixin, GRPOConfig):
    """TRL's GRPOConfig with the Gaudi options. Where the device compiles a graph per shape (a Gaudi in lazy
    mode), completions are generated with a fixed-size key/value cache unless ``cache_implementation`` is set."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_implementation is None and self.gaudi_device.static_shapes(self.use_lazy_mode):
            self.cache_implementation = "static"


class GaudiGRPOTrainer(GaudiTrainerMixin, GRPOTrainer):
    """TRL's GRPOTrainer with the Gaudi features; takes a GaudiGRPOConfig and an optional ``gaudi_config``."""

    gaudi_args_class = GaudiGRPOConfig
