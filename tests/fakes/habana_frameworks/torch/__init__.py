"""TEST DOUBLE of ``habana_frameworks.torch`` (see the ``habana_frameworks`` package docstring).

As ``python_packages/habana_frameworks/torch/__init__.py`` does, importing it:

- marks the backend loaded for the autoload entry point (``habana_frameworks.autoload.is_loaded``);
- reads the local tag of torch's version first: a torch without one (FAKE_HPU_STOCK_TORCH=untagged, as
  PyPI's ``2.5.1``) fails with AttributeError;
- asserts that the running torch has the major.minor version the bridge was built for (here
  FAKE_HPU_BUILT_FOR_TORCH, default: the running torch's) and, in lazy mode, that it is Habana's torch
  fork (FAKE_HPU_STOCK_TORCH=1 simulates a stock torch with a local tag, as ``2.5.1+cpu``);
- loads its plugin library with ``ctypes.CDLL``: FAKE_HPU_PLUGIN_MISSING=1 makes that fail with OSError;
- reads the PT_HPU_* environment once (lazy mode: ``utils/internal.py``; autocast op lists:
  ``_autocast_lists``, exposed as ``habana_frameworks.autocast_lists``);
- replaces torch.profiler's activity enum (``activity_profiler``), registers the 'hccl' backend and
  sets distributed variables (``distributed/hccl``), imports ``core`` and ``hpu``.

- sets TORCHINDUCTOR_COMPILE_THREADS=1 first (no inductor process pool);
- with PT_HPU_REPLACE_ADAM_ADAMW=1 puts the Markstep steps in torch's Adam and AdamW (``hpex/optimizers/_markstep``).

With FAKE_HPU_DEVICE=1 the plugin is a real ``hpu`` device (``_device``: host memory, the bridge's autocast
op lists) and ``core`` registers ``torch.hpu`` as the bridge does, so transformers and accelerate take their
Gaudi path. Without it (the in-process tests, which import the simulator many times) nothing registers
``torch.hpu``: transformers would switch to device 'hpu' as soon as ``torch.hpu.is_available()`` is true.
"""

import ctypes
import os

os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # torch/__init__.py sets it first thing, unconditionally

import torch as _torch  # noqa: E402

import habana_frameworks as _hf
import habana_frameworks.autoload

habana_frameworks.autoload.is_loaded = True

from .utils.internal import is_lazy  # noqa: E402

# torch/__init__.py: `is_torch_fork = run_time_ver.local.startswith("git")`, before the version assert; a
# version without local tag has local None, so that line raises AttributeError.
_local = {"1": "cpu", "untagged": None}.get(os.environ.get("FAKE_HPU_STOCK_TORCH", ""), "git0")
_is_torch_fork = _local.startswith("git")
_built_for = os.environ.get("FAKE_HPU_BUILT_FOR_TORCH") or ".".join(_torch.__version__.split(".")[:2])
_running = ".".join(_torch.__version__.split("+")[0].split(".")[:2])
assert _running == _built_for, (
    f"Error: Compile-time major/minor PyTorch version {_built_for} differs from run-time {_torch.__version__}."
)
if is_lazy():
    assert _is_torch_fork, f"Stock PyTorch version {_torch.__version__} is not supported in Lazy mode."
if os.environ.get("FAKE_HPU_PLUGIN_MISSING") == "1":  # torch/__init__.py: ctypes.CDLL(lib/<plugin>.so) fails
    _lib = "libhabana_pytorch{}_plugin{}.so".format("" if is_lazy() else "2", "" if _is_torch_fork else ".upstream")
    ctypes.CDLL(os.path.join(os.path.dirname(__file__), "lib", _lib), ctypes.RTLD_GLOBAL)  # raises OSError

_hf.env_at_import = _hf.snapshot_env()
from ._autocast_lists import load as _load_autocast_lists  # noqa: E402

_hf.autocast_lists = _load_autocast_lists()  # (bf16 ops, fp32 ops), fixed for the life of the process
from habana_frameworks import _device  # noqa: E402

if _device.enabled():
    _device.load(*_hf.autocast_lists, lazy=is_lazy())
_hf.dump_log_at_exit()
_hf.record("import", lazy=is_lazy(), generation=_hf.generation(), env=dict(_hf.env_at_import))

from . import activity_profiler, core, distributed, hpu  # noqa: E402, F401
from .distributed import hccl  # noqa: E402, F401


def _overwrite_torch_optimizers() -> None:
    """torch/__init__.py ``overwrite_torch_optimizers``: with PT_HPU_REPLACE_ADAM_ADAMW 1/true/yes, torch's Adam
    and AdamW steps become the Markstep ones (in place, so optimizers torch.optim.AdamW builds take them too),
    and ``torch.optim.adam.Adam`` / ``torch.optim.adamw.AdamW`` the Markstep classes."""
    if os.environ.get("PT_HPU_REPLACE_ADAM_ADAMW", "0").lower() not in ("1", "true", "yes"):
        return
    import torch.optim.adam as adam_module
    import torch.optim.adamw as adamw_module

    from .hpex.optimizers._markstep import markstep_step

    classes = adam_module.Adam, adamw_module.AdamW
    steps = [vars(cls).get("step") for cls in classes]  # AdamW may inherit Adam's step: then it has none
    replaced = []
    for cls, step in zip(classes, steps, strict=True):
        cls.step = markstep_step(step or steps[0])
        replaced.append(type(cls.__name__, (cls,), {"__module__": "habana_frameworks.torch.hpex.optimizers"}))
    adam_module.Adam, adamw_module.AdamW = replaced
    _hf.record("replace_adam_adamw")

    def _restore():
        adam_module.Adam, adamw_module.AdamW = classes
        for cls, step in zip(classes, steps, strict=True):
            if step is None:
                del cls.step
            else:
                cls.step = step

    _hf.on_unload(_restore)


_overwrite_torch_optimizers()

__all__ = ["core", "distributed", "hpu"]
