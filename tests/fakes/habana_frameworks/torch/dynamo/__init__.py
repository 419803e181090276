"""TEST DOUBLE of ``habana_frameworks.torch.dynamo``: registers the torch.compile backend ``hpu_backend``.

The real backend (``dynamo/compile_backend``) compiles the FX graph through AOTAutograd for the HPU.
Here ``hpu_backend`` is a CPU backend: torch's ``aot_eager`` (AOTAutograd, no code generation), which
keeps tests fast while exercising the same graph capture, guards and recompilations.
"""

import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend


def hpu_backend(graph_module, example_inputs, **kwargs):
    import habana_frameworks as _hf  # looked up per call: a test may have loaded a fresh simulator since

    _hf.record("dynamo.hpu_backend", nodes=len(graph_module.graph.nodes))
    return lookup_backend("aot_eager")(graph_module, example_inputs, **kwargs)


if "hpu_backend" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(hpu_backend, name="hpu_backend")
