"""TEST DOUBLE of ``habana_frameworks.torch.core``: ``mark_step`` only.

The real ``mark_step`` flushes the lazily accumulated graph to the device in lazy mode and does nothing
in eager mode. Here each call is recorded with a running step-boundary number and whether lazy mode was
on at call time (the real function checks PT_HPU_LAZY_MODE on every call, too).
"""

import habana_frameworks as _hf


def mark_step(device_str="", sync=False):
    boundary = len(_hf.calls_named("core.mark_step")) + 1
    _hf.record("core.mark_step", device_str=device_str, sync=sync, lazy=_hf.is_lazy(), boundary=boundary)
