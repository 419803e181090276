"""TEST DOUBLE of ``habana_frameworks.torch.hpex.normalization``: only FusedClipNorm is simulated."""

from .FusedClipNorm import FusedClipNorm

__all__ = ["FusedClipNorm"]
