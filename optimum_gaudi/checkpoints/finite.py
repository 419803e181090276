"""Checkpoints hold finite weights: one whose weights hold a NaN or inf is never published (so it never rotates out
the last finite one), and resuming with ``true`` skips any such checkpoint an older run left.

A checkpoint written here was checked before it was written and says so in a marker file (listed in its
manifest); one without the marker (an older run's, another tool's) has its safetensors weights read, tensor by
tensor, when a run would resume from it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FINITE_MARKER = "weights_finite.json"  # written into each checkpoint whose weights were checked finite


def first_nonfinite(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or inf (this process's shard of a DTensor), or None; one device
    sync for all of them."""
    names, flags = [], []
    for name, tensor in named_tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel() and (local.is_floating_point() or local.is_complex()):
            names.append(name)
            flags.append(torch.isfinite(local.detach()).all())
    if not flags:
        return None
    bad = (~torch.stack(flags)).nonzero().cpu()
    return names[int(bad[0])] if len(bad) else None


def _weight_files(checkpoint: Path) -> list[Path]:
    return sorted(p for p in checkpoint.glob("*.safetensors") if p.is_file())


def saved_nonfinite(checkpoint: str | os.PathLike) -> str | None:
    """The first saved weight holding a NaN or inf (``file: tensor``), or None: trusted where the marker says the
    weights were checked; else its safetensors files read tensor by tensor (sharded DCP weights are not read)."""
    checkpoint = Path(checkpoint)
    if (checkpoint / FINITE_MARKER).is_file():
        return None
    from safetensors import safe_open

    for path in _weight_files(checkpoint):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no iterator
                    if first_nonfinite([(name, f.get_tensor(name))]) is not None:
                        return f"{path.name}: {name}"
        except Exception:  # unreadable: checkpoint_problem says so elsewhere
            continue
    return None


def newest_finite(candidates: list[Path]) -> tuple[Path | None, list[str]]:
    """The first of ``candidates`` (newest first, each complete) whose weights are finite, and the ones skipped."""
    skipped = []
    for candidate in candidates:
        problem = saved_nonfinite(candidate)
        if problem is None:
            return candidate, skipped
        skipped.append(f"{candidate.name} (a non-finite weight: {problem})")
    return None, skipped
