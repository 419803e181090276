"""TEST DOUBLE of ``habana_frameworks.autoload``: the ``torch.backends`` entry point torch calls at import.

Follows ``python_packages/habana_frameworks/autoload/__init__.py`` and the ``entry_points`` of
``python_packages/setup.py``: PT_HPU_AUTOLOAD=1/0 forces the choice; otherwise 1.19 autoloads only when
PT_HPU_LAZY_MODE is set to something else than "1", and 1.21+ (eager by default) unless it is "1".
torch itself skips every entry point when TORCH_DEVICE_BACKEND_AUTOLOAD=0 (``torch/__init__.py``).

With FAKE_HPU_DEVICE=1 the simulated device library (``habana_frameworks._device``) is loaded here
whatever the choice: torch caches its accelerator hooks at the first query, which transformers and accelerate
make while importing, before a lazy-mode bridge is imported. The library alone is not the bridge:
``torch.hpu`` is still registered only when ``habana_frameworks.torch`` is imported.
"""

import os

import habana_frameworks as _hf

is_loaded = False  # set by habana_frameworks.torch when it is imported, by either path


def is_autoload_enabled() -> bool:
    forced = os.environ.get("PT_HPU_AUTOLOAD", "-1")
    if forced in ("0", "1"):
        return forced == "1"
    default = "1" if _hf.lazy_by_default() else "0"
    return os.environ.get("PT_HPU_LAZY_MODE", default) != "1"


def __autoload():
    if os.environ.get("FAKE_HPU_DEVICE") == "1":
        from habana_frameworks import _device

        _device.load_library()
    if is_loaded or not is_autoload_enabled():
        return
    import habana_frameworks.torch  # noqa: F401

    _hf.record("autoload", generation=_hf.generation())
