"""TEST DOUBLE of ``habana_frameworks.torch.hpex.kernels``: only FusedSDPA and the rotary helpers are simulated
(the real package also exports CTCLoss, CustomSoftmax, the fp8 SDPA wrappers, ... : ``hpex/kernels/__init__.py``)."""

from .FusedSDPA import FusedSDPA
from .RotaryPosEmbeddingHelper import (
    RotaryPosEmbeddingHelperV1,
    RotaryPosEmbeddingHelperV2,
    RotaryPosEmbeddingMode,
    apply_rotary_pos_emb,
)

__all__ = [
    "FusedSDPA",
    "RotaryPosEmbeddingHelperV1",
    "RotaryPosEmbeddingHelperV2",
    "RotaryPosEmbeddingMode",
    "apply_rotary_pos_emb",
]
