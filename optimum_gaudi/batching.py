"""Static batch shapes for graph-compiling devices.

In lazy mode or under HPU Graphs every new input shape compiles a new graph; an epoch's last, smaller
batch would cost a compilation for one step. Padding it to full size with rows whose labels are ignored
keeps the shape static without changing the loss, since the loss averages over non-ignored labels only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
LABEL_KEYS = ("labels", "label")


class StaticBatchCollator:
    """Wraps a collator so every batch it returns has `batch_size` rows."""

    def __init__(self, collator: Callable[[list[Any]], dict[str, Any]], batch_size: int) -> None:
        self.collator = collator
        self.batch_size = batch_size
        self._warned = False

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch = self.collator(features)
        missing = self.batch_size - len(features)
        if missing <= 0:
            return batch
        if not any(key in batch for key in LABEL_KEYS):
            if not self._warned:
                logger.warning(
                    "Last batch left smaller: no 'labels' to ignore in padding rows. Use --dataloader_drop_last."
                )
                self._warned = True
            return batch
        return {key: self._pad(key, value, len(features), missing) for key, value in batch.items()}

    @staticmethod
    def _pad(key: str, value: Any, rows: int, missing: int) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) != rows:
            return value
        filler = value[-1:].expand(missing, *value.shape[1:])
        if key in LABEL_KEYS:
            filler = torch.full_like(filler, IGNORE_INDEX)
        return torch.cat([value, filler], dim=0)
