"""The fused rotary's active kernel (features/kernels.py) is a dynamic scope of the thread that runs a fused
layer: a model run meanwhile on another thread keeps its modeling module's own function (issue 47), and a fused
attention layer still compiles as one graph."""

from __future__ import annotations

import threading

import tiny
import torch
from transformers.models.llama.modeling_llama import rotate_half

from optimum_gaudi.features import kernels

IDS = torch.arange(1, 17).reshape(1, 16)


def llama_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's own rotation, in the fused kernel's signature."""
    return x * cos + rotate_half(x) * sin


def test_a_model_run_on_another_thread_meanwhile_keeps_its_own_rotary():
    """Thread A stops inside its fused layer's kernel; the main thread then runs a plain Llama (the same modeling
    module, whose function now dispatches): it must not run A's kernel."""
    fused, plain = tiny.llama(), tiny.llama()
    with torch.no_grad():
        expected = plain(IDS).logits
    inside, go_on, callers = threading.Event(), threading.Event(), []

    def kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first = not callers
        callers.append(threading.get_ident())
        if first:  # thread A waits inside its layer while the main thread runs the plain model
            inside.set()
            go_on.wait(60)
        return llama_rotary(x, cos, sin)

    assert kernels.fuse_rotary(fused, kernel) == 2

    def run_fused() -> None:
        with torch.no_grad():
            fused(IDS)

    worker = threading.Thread(target=run_fused)
    worker.start()
    try:
        assert inside.wait(60)
        with torch.no_grad():
            got = plain(IDS).logits
    finally:
        go_on.set()
        worker.join(60)
    assert threading.get_ident() not in callers
    assert set(callers) == {worker.ident} and len(callers) == 2 * 2  # layers x (q, k)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_fused_attention_layer_compiles_as_one_graph():
    """The kernel's scope is read by dynamo as a global is (a ContextVar's would break the graph)."""
    model, calls = tiny.llama(), []
    kernels.fuse_rotary(model, lambda x, cos, sin: calls.append(1) or llama_rotary(x, cos, sin))
    layer = model.model.layers[0].self_attn
    hidden = torch.randn(1, 16, model.config.hidden_size)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(16).unsqueeze(0))
    with torch.no_grad():
        expected, _ = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
        compiled = torch.compile(layer, backend="eager", fullgraph=True)
        got, _ = compiled(hidden, position_embeddings=position_embeddings, attention_mask=None)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(calls) == 2 * 2  # q and k, eager then compiled
    assert kernels._active_rotary.kernel is None  # restored after the layer
