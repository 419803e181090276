"""TEST DOUBLE of ``habana_frameworks.torch`` (see the ``habana_frameworks`` package docstring).

Like the real bridge, importing this package is the moment the PT_HPU_* environment is read, and it
imports ``core``, ``hpu`` and ``distributed.hccl`` (the last one registers the 'hccl' backend).

Unlike the real bridge it does NOT register ``torch.hpu`` as a device module: transformers switches to
device 'hpu' as soon as ``torch.hpu.is_available()`` is true, and torch here has no 'hpu' device.
"""

import habana_frameworks as _hf

_hf.env_at_import = _hf.snapshot_env()
_hf.record("import", lazy=_hf.is_lazy(), env=dict(_hf.env_at_import))

import importlib  # noqa: E402  (everything below comes after the snapshot, as in the real import order)

from . import core, distributed, hpu  # noqa: E402

importlib.import_module("habana_frameworks.torch.distributed.hccl")

__all__ = ["core", "distributed", "hpu"]
