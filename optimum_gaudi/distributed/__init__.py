"""Training-time parallelism: the fast_ddp gradient all-reduce, FSDP, sequence parallelism, the host group, the
ranks' agreement and progress watchdog, ZeRO-3 leaf modules. The launcher is launch/.

``apply_zero3_leaf_promotion`` is imported on first use, so the package itself loads without torch (the launcher's
0.2 paths, ``optimum_gaudi.distributed.launcher`` ..., pass through it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["apply_zero3_leaf_promotion"]


def __getattr__(name: str) -> Any:
    if name == "apply_zero3_leaf_promotion":
        from .zero3 import apply_zero3_leaf_promotion

        return apply_zero3_leaf_promotion
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
