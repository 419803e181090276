"""TEST DOUBLE of ``habana_frameworks.torch.dynamo.compile_backend``: registers the torch.compile backend
``hpu_backend`` when imported (``compile_backend/backends.py``, ``@register_backend``).

``core/__init__.py`` imports this package only when the bridge loads in eager mode: in lazy mode there is no
``hpu_backend`` and ``torch.compile(backend="hpu_backend")`` fails with dynamo's "Invalid backend". The real
backend compiles the FX graph through AOTAutograd for the HPU; here ``hpu_backend`` is torch's ``aot_eager``
(AOTAutograd, no code generation), which exercises the same graph capture, guards and recompilations. The
registration is taken back when the simulator is unloaded.
"""

import torch._dynamo
from torch._dynamo.backends import registry

import habana_frameworks as _hf


def hpu_backend(graph_module, example_inputs, **kwargs):
    import habana_frameworks as hf  # looked up per call: a test may have loaded a fresh simulator since

    hf.record("dynamo.hpu_backend", nodes=len(graph_module.graph.nodes))
    return registry.lookup_backend("aot_eager")(graph_module, example_inputs, **kwargs)


def _unregister() -> None:
    registry._COMPILER_FNS.pop("hpu_backend", None)
    registry._BACKENDS.pop("hpu_backend", None)


if "hpu_backend" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(hpu_backend, name="hpu_backend")
    _hf.on_unload(_unregister)
