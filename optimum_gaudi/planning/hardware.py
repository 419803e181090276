"""The cards a plan can target, as data: memory, dense peak TFLOP/s and link bandwidth, each with its public source.

Figures are the vendors' datasheet numbers (dense, no sparsity). A card is looked up by a forgiving name
(``gaudi2``, ``Gaudi 3``, ``A100-80GB``, ``h100``, ``cpu``); ``cpu`` is this machine's available RAM and has no
stated peak (tokens/s are not estimated for it unless a peak is given).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from ..errors import UserError

GB = 1e9  # vendors state memory and bandwidth in decimal units; the plan prints GB = 10^9 bytes

GAUDI3_WHITEPAPER = "Intel Gaudi 3 AI Accelerator White Paper (2024), table 'Gaudi 2 vs Gaudi 3'"
A100_DATASHEET = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column, dense"
H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column, dense (half the sparsity figure)"
H200_DATASHEET = "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM column, dense (half the sparsity figure)"


@dataclass(frozen=True)
class Card:
    """One accelerator: what it holds and how fast it computes and talks to its peers."""

    name: str
    memory_gb: float  # on-card memory, GB = 10^9 bytes
    bf16_tflops: float | None  # dense matmul peak; None: unknown (no tokens/s estimate)
    fp8_tflops: float | None  # None: no fp8 matmuls on this card (no --fp8 candidates)
    link_gb_s: float  # per-card bandwidth to its peers inside a node, one direction, GB/s
    source: str
    kind: str  # "hpu", "cuda" or "cpu": which runtime reserve and which flags apply


CARDS: dict[str, Card] = {
    # Gaudi 2: 96 GB HBM2E, MME 432 BF16 / 865 FP8 TFLOP/s; 24x100 GbE, 21 of them between the 8 cards of a node
    "gaudi2": Card("Gaudi 2", 96, 432, 865, 21 * 100 / 8, GAUDI3_WHITEPAPER, "hpu"),
    # Gaudi 3: 128 GB HBM2e, MME 1835 BF16 and FP8 TFLOP/s; 24x200 GbE, 21 of them inside a node
    "gaudi3": Card("Gaudi 3", 128, 1835, 1835, 21 * 200 / 8, GAUDI3_WHITEPAPER, "hpu"),
    # A100: 312 BF16 TFLOP/s, no fp8; NVLink 600 GB/s both directions
    "a100-40gb": Card("A100-40GB", 40, 312, None, 300, A100_DATASHEET, "cuda"),
    "a100-80gb": Card("A100-80GB", 80, 312, None, 300, A100_DATASHEET, "cuda"),
    # H100 SXM: 80 GB HBM3, 989 BF16 / 1979 FP8 TFLOP/s dense; NVLink 900 GB/s both directions
    "h100": Card("H100", 80, 989, 1979, 450, H100_DATASHEET, "cuda"),
    # H200 SXM: 141 GB HBM3e, the H100's compute; NVLink 900 GB/s
    "h200": Card("H200", 141, 989, 1979, 450, H200_DATASHEET, "cuda"),
}
_ALIASES = {"a100": "a100-80gb", "h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200", "hpu": "gaudi2"}


def _plain(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower()).replace("intel", "").replace("nvidia", "")


_BY_PLAIN_NAME = {_plain(k): k for k in CARDS} | {_plain(k): v for k, v in _ALIASES.items()} | {"cpu": "cpu"}


def _key(name: str) -> str:
    """The CARDS key of a name written any way (case, spaces, dashes, underscores, a vendor's name)."""
    return _BY_PLAIN_NAME.get(_plain(name), name)


def available_ram_gb() -> float:
    """This machine's RAM the kernel can hand out now (MemAvailable), GB: what a CPU 'card' holds."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def cpu_card(memory_gb: float | None = None) -> Card:
    memory = available_ram_gb() if memory_gb is None else memory_gb
    return Card("cpu", memory, None, None, 5.0, "this machine: /proc/meminfo MemAvailable", "cpu")


def card(name: str, memory_gb: float | None = None, bf16_tflops: float | None = None) -> Card:
    """The card called ``name``; ``memory_gb`` / ``bf16_tflops`` override its figures (another memory size, a
    measured peak). An unknown name is one line listing the known ones."""
    key = _key(name)
    if key == "cpu":
        found = cpu_card(memory_gb)
    elif key in CARDS:
        found = CARDS[key] if memory_gb is None else replace(CARDS[key], memory_gb=memory_gb)
    else:
        known = ", ".join([c.name for c in CARDS.values()] + ["cpu"])
        raise UserError(f"unknown card {name!r}; choose one of {known} (or give --card_memory_gb with one of them).")
    if bf16_tflops is not None:
        found = replace(found, bf16_tflops=bf16_tflops)
    return found
