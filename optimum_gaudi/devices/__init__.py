"""Device detection (HPU > CUDA > CPU) and the feature table each device explains.

Everything device-specific lives behind :class:`Device`; the trainer asks the device object and never
checks which kind it is.
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import UserError
from .base import FEATURES, Device, torch_release
from .cpu import CPUDevice
from .cuda import CUDADevice
from .hpu import HPUDevice, hpu_available, unavailable_reason

logger = logging.getLogger(__name__)

REQUIRE_HPU_ENV = "OPTIMUM_GAUDI_REQUIRE_HPU"

__all__ = [
    "FEATURES",
    "CPUDevice",
    "CUDADevice",
    "Device",
    "HPUDevice",
    "NoGaudiError",
    "TorchTooOldError",
    "check_torch_release",
    "detect_device",
]


class NoGaudiError(UserError, RuntimeError):
    """A Gaudi was required (OPTIMUM_GAUDI_REQUIRE_HPU=1) but none is usable here."""


# The oldest torch tested (tests/compat/torch.sh): the one Gaudi software 1.20 and 1.21 ship. setup.py says the same.
TORCH_FLOOR = (2, 6)


class TorchTooOldError(UserError, RuntimeError):
    """The running torch is older than the oldest this package is tested on."""


def check_torch_release(version: str = torch.__version__) -> None:
    """One line, before any work, where the running torch is older than the floor (a Gaudi on software 1.19 or
    older, or a torch installed beside the package without its requirement)."""
    release = torch_release(version)
    if release < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise TorchTooOldError(
            f"optimum-gaudi needs torch >= {floor} (Intel Gaudi software 1.20 or later ships it); this is torch "
            f"{version}: upgrade the Gaudi software, or install torch >= {floor} elsewhere."
        )


def _require_hpu() -> bool:
    return os.environ.get(REQUIRE_HPU_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def detect_device(use_habana: bool = False, use_cpu: bool = False) -> Device:
    """Pick the best device: HPU when the bridge imports and sees a Gaudi, else CUDA, else CPU.

    Asking for Habana on a machine without a Gaudi falls back with one warning, so a script prototyped on
    a laptop ships unchanged; OPTIMUM_GAUDI_REQUIRE_HPU=1 turns the fallback into an error for production.
    """
    if not use_cpu and hpu_available():
        return HPUDevice()
    device: Device = CUDADevice() if not use_cpu and torch.cuda.is_available() else CPUDevice()
    if use_habana or _require_hpu():
        if _require_hpu():
            why = unavailable_reason() or "habana_frameworks missing or no HPU visible"
            raise NoGaudiError(
                f"{REQUIRE_HPU_ENV}=1 but no Gaudi is usable here ({why}); "
                f"run on a Gaudi machine or unset {REQUIRE_HPU_ENV} to fall back to {device.type}."
            )
        logger.warning("--use_habana was given but no Gaudi is available: running on %s instead.", device.type)
    return device
