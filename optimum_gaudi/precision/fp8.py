"""fp8 training (``--fp8``): the model's linear layers computed in fp8, by the device's own means.

Each device supplies an :class:`Fp8Plan`, the contract defined here (``Device.fp8_plan``): on a Gaudi,
Intel's Gaudi Transformer Engine (``te.Linear`` under ``te.fp8_autocast`` with delayed scaling, as optimum-habana
uses it); on CPU and CUDA, torchao's float8 training (``Float8Linear``, dynamic per-tensor scaling). The same layers are converted on
every device: each ``nn.Linear`` whose two sizes are multiples of 16 (what fp8 matmul kernels take), except
the output layer (the LM head, whose logits are the most sensitive to precision). A converted layer keeps the
original weight and bias objects, so the optimizer, weight tying and ``state_dict`` keys stay as they were;
a saved model is the user's own class and loads in plain transformers.

On a Gaudi the Transformer Engine keeps scaling state in its modules (``_extra_state``): a checkpoint carries it
in a file of its own (:data:`SCALING_STATE_FILE`, one per rank on several), so a resumed run scales its first
steps as the uninterrupted run did on every card, while the saved weights stay plain. The recipe is
optimum-habana's unless the user gives one (``--fp8_recipe``, precision/fp8_recipe.py).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..seam import Seam

logger = logging.getLogger(__name__)

FP8_ATTENTION = "gaudi_fp8_attention"  # --flash_attention_fp8: the fp8 attention module inside each attention layer


@dataclass(frozen=True)
class Fp8Plan:
    """How a device trains in fp8: `convert` swaps the given linear layers of a model in place, keeping their
    weight and bias objects; `autocast`, where not None, is the context each training forward runs in (and a
    checkpointed layer's recomputation in the backward, :func:`recompute_in_fp8`)."""

    name: str
    convert: Callable[[nn.Module, set[nn.Linear]], None]
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None
    # With activation checkpointing: what marks the function a checkpointed layer runs (forward, then recompute)
    checkpointed: Callable[[Callable], Callable] | None = None
    # Whether FSDP2 shards the converted layers (torchao's Float8Linear: tested; the Transformer Engine's: not)
    shards_with_fsdp: bool = True


SIZE_MULTIPLE = 16
EXTRA_STATE_SUFFIX = "._extra_state"  # where Transformer Engine modules keep their scaling state
SCALING_STATE_FILE = "fp8_scaling_state.pt"  # in a checkpoint: the Transformer Engine modules' scaling state
BYTES_IO = "bytes_io"  # an ``_extra_state`` kept as an io.BytesIO, saved as its bytes under this key


def eligible_linears(model: nn.Module) -> set[nn.Linear]:
    """The layers fp8 computes: plain ``nn.Linear`` with sizes that are multiples of 16, not the output layer."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    return {
        module
        for module in model.modules()
        if type(module) is nn.Linear
        and module is not output
        and module.in_features % SIZE_MULTIPLE == 0
        and module.out_features % SIZE_MULTIPLE == 0
    }


def use_fp8(model: nn.Module, plan: Fp8Plan) -> None:
    """Convert the model's eligible layers once (later calls find them converted)."""
    if getattr(model, "_gaudi_fp8", None) == plan.name:
        return
    layers = eligible_linears(model)
    plan.convert(model, layers)
    model._gaudi_fp8 = plan.name
    logger.info("--fp8: %d linear layers compute in fp8 (%s).", len(layers), plan.name)


def recompute_in_fp8(model: nn.Module, plan: Fp8Plan) -> int:
    """Activation checkpointing under a device's fp8 context: each checkpointed layer's function enters that
    context itself, so the recomputation in the backward (outside the training forward's context) runs in fp8
    as the first forward did, marked as checkpointed where the device asks (Transformer Engine then recomputes
    with the forward's scales). Returns how many layers were wrapped (each once)."""
    if plan.autocast is None:
        return 0  # torchao: the recomputation is the same fp8 computation, with nothing to enter
    wrapped = 0
    for module in model.modules():
        if getattr(module, "_gradient_checkpointing_func", None) is None:
            continue
        seam = Seam.of(module, "_gradient_checkpointing_func")
        if "fp8" not in seam:  # not yet, or gradient checkpointing enabled again since
            seam.put("fp8", functools.partial(_InFp8, plan=plan))
            wrapped += 1
    return wrapped


class _InFp8:
    """``checkpoint(function, *args)`` with ``function`` run in the fp8 context, forward and recomputation."""

    def __init__(self, checkpoint: Callable, plan: Fp8Plan) -> None:
        self.checkpoint, self.plan = checkpoint, plan

    def __call__(self, function: Callable, *args, **kwargs):
        def in_fp8(*inner_args, **inner_kwargs):
            with self.plan.autocast():
                return function(*inner_args, **inner_kwargs)

        if self.plan.checkpointed is not None:
            in_fp8 = self.plan.checkpointed(in_fp8)
        return self.checkpoint(in_fp8, *args, **kwargs)


def without_fp8_state(state_dict: dict) -> dict:
    """The weights without Transformer Engine's scaling state: what plain transformers and vLLM expect in a
    saved model (the scaling history rebuilds itself in the first steps after a resume)."""
    return {key: value for key, value in state_dict.items() if not key.endswith(EXTRA_STATE_SUFFIX)}


def saved_state_dict(model: nn.Module) -> dict | None:
    """What to save of an fp8 model: its state without scaling state, or None (the model's own) if it has none."""
    state = model.state_dict()
    return without_fp8_state(state) if any(key.endswith(EXTRA_STATE_SUFFIX) for key in state) else None


def scaling_state(model: nn.Module) -> dict[str, torch.Tensor | io.BytesIO]:
    """The Transformer Engine modules' scaling state (amax histories, scales), by state-dict key: a tensor or an
    ``io.BytesIO`` each (the two forms a module's ``_extra_state`` takes, the bridge's TE test reads both)."""
    return {
        key: value
        for key, value in model.state_dict().items()
        if key.endswith(EXTRA_STATE_SUFFIX) and isinstance(value, (torch.Tensor, io.BytesIO))
    }


def _scaling_file(directory: str, rank: int, world_size: int) -> str:
    """One file per rank: with optimum-habana's recipe (``reduce_amax=False``) each card keeps its own amax history."""
    name = SCALING_STATE_FILE if world_size == 1 else SCALING_STATE_FILE.replace(".pt", f".rank{rank}.pt")
    return os.path.join(directory, name)


def save_scaling_state(model: nn.Module, directory: str, rank: int = 0, world_size: int = 1) -> None:
    """Into a checkpoint, by every rank: the scaling state the saved weights leave out (nothing without
    Transformer Engine). An ``io.BytesIO`` is kept as its bytes, so the file loads with ``weights_only``."""
    state = {
        key: {BYTES_IO: torch.frombuffer(bytearray(value.getvalue()), dtype=torch.uint8)}
        if isinstance(value, io.BytesIO)
        else value.detach().cpu()
        for key, value in scaling_state(model).items()
    }
    if state:
        torch.save(state, _scaling_file(directory, rank, world_size))


def load_scaling_state(model: nn.Module, directory: str, rank: int = 0, world_size: int = 1) -> bool:
    """From a checkpoint, where it has one: the modules scale their next steps as before the interruption, each
    rank from its own file. A rank the checkpoint has none for (saved on fewer ranks) takes rank 0's, said."""
    path = _scaling_file(directory, rank, world_size)
    if not os.path.isfile(path):
        fallback = [_scaling_file(directory, 0, n) for n in (1, 2)]
        path = next((candidate for candidate in fallback if os.path.isfile(candidate)), None)
        if path is None:
            return False
        if world_size > 1:
            logger.warning(
                "--fp8: the checkpoint holds no scaling state of rank %d (saved on fewer ranks); it starts from rank "
                "0's amax history.",
                rank,
            )
    state = torch.load(path, map_location="cpu", weights_only=True)
    expected = set(scaling_state(model))
    if set(state) != expected:
        logger.warning(
            "--fp8: the checkpoint's scaling state is for other modules (%d saved, %d here); scaling starts afresh.",
            len(state),
            len(expected),
        )
        return False
    restored = {
        key: io.BytesIO(value[BYTES_IO].numpy().tobytes()) if isinstance(value, dict) else value
        for key, value in state.items()
    }
    model.load_state_dict(restored, strict=False)
    return True


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that call transformers' attention interface with their own scale and dropout (Llama, Mistral,
    Qwen, Gemma, ...): the ones ``--flash_attention_fp8`` gives an fp8 FusedAttention."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "attention_dropout", None), (int, float))
        and hasattr(module, "scaling")
        and hasattr(module, "config")
    ]


def attach_fp8_attention(model: nn.Module, build: Callable[[float | None, float], nn.Module]) -> int:
    """Give each attention layer its fp8 attention module, built once from the layer's scale and the model's
    attention dropout, as a registered submodule: ``train()``/``eval()`` reach it (dropout only in training)
    and its scaling state is part of the model's state, saved and resumed with the rest."""
    layers = [layer for layer in attention_layers(model) if not hasattr(layer, FP8_ATTENTION)]
    for layer in layers:
        layer.add_module(FP8_ATTENTION, build(layer.scaling, float(layer.attention_dropout)))
    return len(layers)
