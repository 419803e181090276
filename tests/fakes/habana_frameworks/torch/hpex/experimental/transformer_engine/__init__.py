"""TEST DOUBLE of ``habana_frameworks.torch.hpex.experimental.transformer_engine`` (bridge 1.19.0).

Follows ``hpex/experimental/transformer_engine/__init__.py``: the bridge ships no Transformer Engine of its own;
it imports ``intel_transformer_engine`` (a separate package of the Gaudi software, simulated in
``tests/fakes/intel_transformer_engine``) and re-exports every name, registering its submodules (``recipe``, ...)
under this package's name. Without that package the import fails (ModuleNotFoundError).
"""

import importlib
import sys

_te = importlib.import_module("intel_transformer_engine")

for _name in dir(_te):
    if not _name.startswith("__"):
        _attr = getattr(_te, _name)
        if isinstance(_attr, type(sys)):
            sys.modules[f"{__name__}.{_name}"] = _attr
        globals()[_name] = _attr
