"""TEST DOUBLE of ``habana_frameworks.torch.hpex.optimizers``: only FusedAdamW is simulated."""

from .FusedAdamW import FusedAdamW

__all__ = ["FusedAdamW"]
