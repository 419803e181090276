"""TEST DOUBLE: a simulator of Habana's PyTorch bridge, for this project's tests only.

This is NOT Habana's software and it does not drive a Gaudi. It has the module paths, names and
signatures of the slice of ``habana_frameworks.torch`` that optimum_gaudi calls, models the bridge's
behaviour (what loads when, what is lazy-only, what a replayed graph returns, what importing changes in
torch and in the environment), runs everything on CPU tensors, and records every call so tests can
check what the HPU code path did and in which order. Each modelled behaviour names, in a comment, the
file of ``HabanaAI/gaudi-pytorch-bridge`` (``python_packages/habana_frameworks/...``) it follows.

Two generations of Gaudi software, chosen by ``FAKE_HPU_SOFTWARE`` (read when a module needs it):

- ``1.19`` (up to 1.20): lazy mode unless PT_HPU_LAZY_MODE=0; the bridge loads when imported, and
  during ``import torch`` only if PT_HPU_LAZY_MODE=0 or PT_HPU_AUTOLOAD=1.
- ``1.21`` (1.21 and later, the default): eager mode unless PT_HPU_LAZY_MODE=1; the bridge loads
  during ``import torch`` (a ``torch.backends`` entry point) unless PT_HPU_LAZY_MODE=1 or PT_HPU_AUTOLOAD=0.

The entry point is real: ``tests/fakes/habana_frameworks_simulator-1.0.dist-info`` declares it, so a
process started with ``tests/fakes`` on PYTHONPATH autoloads this simulator as torch would the bridge.

Inspection API (only in the simulator):

- ``calls``: list of :class:`Call` records, in call order; ``names()``, ``calls_named(name, **kwargs)``.
- ``env_at_import``: the PT_HPU_* (and related) variables when ``habana_frameworks.torch`` was imported,
  which is when the real bridge reads them. ``None`` before that.
- ``autocast_lists``: the (bf16, fp32) op sets the loaded bridge autocasts with (read once at import).
- ``FAKE_HPU_CALL_LOG=PATH``: a process that loads the simulator writes that (JSON) to ``PATH.RANK`` at exit.
- ``reset()``: empty the log. ``unload()``: forget the import (modules, torch patches) so a test can
  import it again under another environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Imported under another name: importing the subpackage sets this package's attribute ``torch``.
import torch as _torch

SIMULATED = True  # lets a test tell this double from the real bridge

GENERATION_ENV = "FAKE_HPU_SOFTWARE"
GENERATIONS = ("1.19", "1.21")
ENV_PREFIXES = ("PT_HPU", "HABANA", "FAKE_HPU", "HLS_MODULE_ID")  # PT_HPU also covers PT_HPUGRAPH_*


def generation() -> str:
    """The simulated Gaudi software generation: '1.19' (lazy default) or '1.21' (eager default, autoload)."""
    value = os.environ.get(GENERATION_ENV, "1.21")
    if value not in GENERATIONS:
        raise ValueError(f"{GENERATION_ENV} must be one of {GENERATIONS}, got {value!r}")
    return value


def lazy_by_default() -> bool:
    return generation() == "1.19"


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
autocast_lists: tuple[frozenset[str], frozenset[str]] | None = None  # (bf16, fp32) the loaded plugin uses
_undo: list[Callable[[], None]] = []  # restores what importing the simulator changed in torch


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


def record(name: str, *args: Any, **kwargs: Any) -> Call | None:
    """Log a call, except while dynamo traces Python code: the real kernels are opaque ops to dynamo, and tracing this
    list's append made dynamo guard on its length (a recompilation at every step) and replay the append."""
    if _torch.compiler.is_dynamo_compiling():
        return None
    call = Call(name, tuple(summarize(a) for a in args), {k: summarize(v) for k, v in kwargs.items()})
    calls.append(call)
    return call


def names() -> list[str]:
    return [c.name for c in calls]


def calls_named(name: str, **match: Any) -> list[Call]:
    """The records with that name (and those keyword values, e.g. ``mode="replay"``)."""
    return [c for c in calls if c.name == name and all(c.kwargs.get(k) == v for k, v in match.items())]


def reset() -> None:
    calls.clear()


def snapshot_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}


def dump_log_at_exit() -> None:
    """With FAKE_HPU_CALL_LOG=PATH, write the call names, env_at_import, autocast lists and (with the
    simulated device) its allocator's peak and count to PATH.RANK (JSON) when the process exits: how a test
    reads what the simulator saw in a subprocess."""
    if os.environ.get("FAKE_HPU_CALL_LOG"):
        import atexit

        atexit.register(write_call_log)


_LAUNCHERS = ("torch.distributed.run", "optimum_gaudi.__main__")  # ``python -m`` of torchrun and optimum-gaudi


def write_call_log() -> None:
    """Write the FAKE_HPU_CALL_LOG file now (a process leaving with ``os._exit`` runs no atexit hook)."""
    path = os.environ.get("FAKE_HPU_CALL_LOG")
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    launcher = "RANK" not in os.environ and getattr(main, "name", "") in _LAUNCHERS
    if path and not launcher:  # a launcher's own process would write over rank 0's log when the ranks are done
        import json

        lists = None if autocast_lists is None else [sorted(autocast_lists[0]), sorted(autocast_lists[1])]
        data = {"names": names(), "env_at_import": env_at_import, "autocast_lists": lists}
        from . import _device

        hccl = sys.modules.get("habana_frameworks.torch.distributed.hccl")
        if hccl is not None and getattr(hccl, "census", None):  # every distinct collective the 'hccl' group ran
            data["collectives"] = [list(entry) for entry in sorted(hccl.census, key=str)]
        if _device.loaded():  # what lived on the simulated hpu device
            _live, peak, allocations = _device.memory_counters()
            data["device"] = {"peak_bytes": peak, "allocations": allocations}
        with open(f"{path}.{os.environ.get('RANK', '0')}", "w") as f:
            json.dump(data, f)


def on_unload(undo: Callable[[], None]) -> None:
    """Register how to take back a change the import made to torch (run by ``unload``)."""
    _undo.append(undo)


def unload() -> None:
    """Forget the import: drop ``habana_frameworks.torch*`` modules and restore what they patched in torch."""
    global env_at_import
    while _undo:
        _undo.pop()()
    for name in [m for m in sys.modules if m == "habana_frameworks.torch" or m.startswith("habana_frameworks.torch.")]:
        del sys.modules[name]
    globals().pop("torch", None)
    env_at_import = None
    globals()["autocast_lists"] = None
    autoload = sys.modules.get("habana_frameworks.autoload")
    if autoload is not None:
        autoload.is_loaded = False
