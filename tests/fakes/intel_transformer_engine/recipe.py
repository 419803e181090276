"""TEST DOUBLE of ``intel_transformer_engine.recipe``: ``Format`` and ``DelayedScaling``.

Names and arguments as the bridge's tests use them (``tests/pytest_working/any_mode/test_hpu_fp8_te.py``:
``DelayedScaling(fp8_format=Format.E5M2 | Format.HYBRID, amax_history_len=16, amax_compute_algo="max",
reduce_amax=False)``; ``module.fp8_meta["recipe"].amax_history_len``). HYBRID: e4m3 in the forward, e5m2 for
gradients; E5M2: e5m2 for both. Defaults as NVIDIA's Transformer Engine, which Intel's is derived from.
"""

import enum
from dataclasses import dataclass

import torch


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


@dataclass
class DelayedScaling:
    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a recipe.Format, got {self.fp8_format!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
