"""TEST DOUBLE of ``habana_frameworks.torch.core``: ``mark_step``.

Follows ``core/step_closure.py``: ``mark_step`` is decorated with ``lazy_only`` (``utils/internal.py``),
so in eager mode it is a no-op chosen at import (recorded here as ``core.mark_step.noop``). In lazy mode
each call is recorded with a running step-boundary number. Also follows ``core/__init__.py`` in loading
the torch.compile backend ``hpu_backend`` (``dynamo.compile_backend``) in eager mode only and, where the
simulated plugin is a device (FAKE_HPU_DEVICE=1), registering ``torch.hpu``, and in replacing torch's
process-group functions (``overwrite_torch_functions``: ``torch_overwrites.py``).
"""

import habana_frameworks as _hf
from habana_frameworks import _device

from .. import hpu
from ..utils.internal import is_lazy, lazy_only
from .torch_overwrites import overwrite_torch_functions


def mark_step(device_str="", sync=False):
    boundary = len(_hf.calls_named("core.mark_step")) + 1
    _hf.record("core.mark_step", device_str=device_str, sync=sync, lazy=is_lazy(), boundary=boundary)


mark_step.__module__ = "habana_frameworks.torch.core"
mark_step = lazy_only(mark_step)

if not is_lazy():  # core/__init__.py: the torch.compile backend is initialized in eager mode only
    from ..dynamo import compile_backend  # noqa: F401  (registers hpu_backend)

if _device.loaded():  # core/__init__.py: torch._register_device_module("hpu", hpu)
    _device.register_module(hpu)
overwrite_torch_functions()  # core/__init__.py, on every import of the bridge
