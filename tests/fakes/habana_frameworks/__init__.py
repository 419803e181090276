"""TEST DOUBLE: a simulator of Habana's PyTorch bridge, for this project's tests only.

This is NOT Habana's software and it does not drive a Gaudi. It copies the module paths, names and
signatures of the slice of ``habana_frameworks.torch`` that optimum_gaudi calls, runs everything on CPU
tensors, and records every call so tests can check what the HPU code path did and in which order.

Tests put ``tests/fakes`` on ``sys.path``; then ``import habana_frameworks.torch`` loads this package.

Inspection API (only in the fake):

- ``calls``: list of :class:`Call` records, in call order.
- ``names()``: the recorded names, e.g. ``["import", "hpu.is_available", "core.mark_step", ...]``.
- ``calls_named(name)``: the records with that name.
- ``env_at_import``: the PT_HPU_* (and related) environment variables as they were when
  ``habana_frameworks.torch`` was imported, which is when the real bridge reads them. ``None`` before that.
- ``reset()``: empty the log (``env_at_import`` is kept: it describes the import, not the log).
- ``unload()``: drop ``habana_frameworks.torch*`` from ``sys.modules`` so a test can import it again under
  another environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Imported under another name: importing the subpackage sets this package's attribute ``torch``.
import torch as _torch

SIMULATED = True  # lets a test tell this double from the real bridge

ENV_PREFIXES = ("PT_HPU", "HABANA", "FAKE_HPU")  # PT_HPU also covers PT_HPUGRAPH_*
ENV_NAMES = ("LOWER_LIST", "FP32_LIST")  # older names of the autocast op-list variables


@dataclass
class Call:
    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


calls: list[Call] = []
env_at_import: dict[str, str] | None = None


def summarize(value: Any) -> Any:
    """A small, printable stand-in for an argument (no tensors or modules are kept alive by the log)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, _torch.Tensor):
        return f"Tensor{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, _torch.nn.Module):
        return f"<{type(value).__name__}>"
    if isinstance(value, _torch.dtype):
        return str(value)
    if isinstance(value, dict):
        return {k: summarize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, _torch.Tensor) for v in value):
            return f"<{len(value)} tensors>"
        if any(isinstance(v, (_torch.Tensor, dict)) for v in value):
            return f"<{len(value)} items>"
        return type(value)(summarize(v) for v in value)
    if isinstance(value, Iterator):
        return "<iterator>"
    return f"<{type(value).__name__}>"


def record(name: str, *args: Any, **kwargs: Any) -> Call:
    call = Call(name, tuple(summarize(a) for a in args), {k: summarize(v) for k, v in kwargs.items()})
    calls.append(call)
    return call


def names() -> list[str]:
    return [c.name for c in calls]


def calls_named(name: str) -> list[Call]:
    return [c for c in calls if c.name == name]


def reset() -> None:
    calls.clear()


def snapshot_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def is_lazy() -> bool:
    """Same rule as the bridge: lazy mode unless PT_HPU_LAZY_MODE is "0"."""
    return os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"


def unload() -> None:
    global env_at_import
    for name in [m for m in sys.modules if m == "habana_frameworks.torch" or m.startswith("habana_frameworks.torch.")]:
        del sys.modules[name]
    globals().pop("torch", None)
    env_at_import = None
