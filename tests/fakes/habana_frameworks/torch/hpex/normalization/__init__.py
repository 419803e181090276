"""TEST DOUBLE of ``habana_frameworks.torch.hpex.normalization``: FusedClipNorm and FusedRMSNorm are simulated."""

from .FusedClipNorm import FusedClipNorm
from .FusedRMSNorm import FusedRMSNorm

__all__ = ["FusedClipNorm", "FusedRMSNorm"]
