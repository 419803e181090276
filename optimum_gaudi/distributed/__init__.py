"""Multi-card training: the fast_ddp gradient all-reduce, the multi-process launcher and ZeRO-3 leaf modules.

``apply_zero3_leaf_promotion`` is imported on first use, so the launcher's modules load without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["apply_zero3_leaf_promotion"]


def __getattr__(name: str) -> Any:
    if name == "apply_zero3_leaf_promotion":
        from .zero3 import apply_zero3_leaf_promotion

        return apply_zero3_leaf_promotion
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
