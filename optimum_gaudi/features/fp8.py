"""fp8 training (``--fp8``): the model's linear layers computed in fp8, by the device's own means.

Each device supplies an :class:`Fp8Plan` (``Device.fp8_plan``): on a Gaudi, Intel's Gaudi Transformer Engine
(``te.Linear`` under ``te.fp8_autocast`` with delayed scaling, as optimum-habana uses it); on CPU and CUDA,
torchao's float8 training (``Float8Linear``, dynamic per-tensor scaling). The same layers are converted on
every device: each ``nn.Linear`` whose two sizes are multiples of 16 (what fp8 matmul kernels take), except
the output layer (the LM head, whose logits are the most sensitive to precision). A converted layer keeps the
original weight and bias objects, so the optimizer, weight tying and ``state_dict`` keys stay as they were;
a saved model is the user's own class and loads in plain transformers.
"""

from __future__ import annotations

import logging

from torch import nn

from ..devices.base import Fp8Plan

logger = logging.getLogger(__name__)

SIZE_MULTIPLE = 16
EXTRA_STATE_SUFFIX = "._extra_state"  # where Transformer Engine modules keep their scaling state


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


def without_fp8_state(state_dict: dict) -> dict:
    """The weights without Transformer Engine's scaling state: what plain transformers and vLLM expect in a
    saved model (the scaling history rebuilds itself in the first steps after a resume)."""
    return {key: value for key, value in state_dict.items() if not key.endswith(EXTRA_STATE_SUFFIX)}


def saved_state_dict(model: nn.Module) -> dict | None:
    """What to save of an fp8 model: its state without scaling state, or None (the model's own) if it has none."""
    state = model.state_dict()
    return without_fp8_state(state) if any(key.endswith(EXTRA_STATE_SUFFIX) for key in state) else None
