"""DeepSpeed ZeRO-3 leaf modules for the models optimum-habana's scripts promote (``--use_zero3_leaf_promotion``).

ZeRO-3 gathers each module's parameters just before it runs, through hooks on every submodule. A module whose
submodules do not all run at every step (the experts of a mixture-of-experts block) or that runs many small
ones is better fetched whole: DeepSpeed's ``set_z3_leaf_modules`` makes it a leaf. optimum-habana promotes its
own copies of three model classes; here the same classes are transformers' own, found by name in the model.
"""

from __future__ import annotations

import logging

from torch import nn

from ..errors import UserError

logger = logging.getLogger(__name__)

# model_type: the module class made a ZeRO-3 leaf (optimum-habana's list)
ZERO3_LEAF_CLASSES = {
    "llama": "LlamaDecoderLayer",
    "mixtral": "MixtralSparseMoeBlock",
    "qwen3_moe": "Qwen3MoeSparseMoeBlock",
}


def apply_zero3_leaf_promotion(model: nn.Module) -> None:
    """Mark the model's decoder layers (Llama) or mixture-of-experts blocks (Mixtral, Qwen3-MoE) as DeepSpeed
    ZeRO-3 leaf modules, before the trainer hands the model to DeepSpeed; any other model is left as it is.
    Takes a transformers model or a PEFT model wrapping one."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = ZERO3_LEAF_CLASSES.get(model_type)
    leaf = next((type(module) for module in model.modules() if type(module).__name__ == name), None)
    if leaf is None:
        logger.info("ZeRO-3 leaf promotion: nothing to promote in a %s model.", model_type)
        return
    try:
        from deepspeed.utils import set_z3_leaf_modules
    except ImportError:
        raise UserError("apply_zero3_leaf_promotion needs DeepSpeed: pip install deepspeed.") from None
    set_z3_leaf_modules(model, [leaf])
    logger.info("ZeRO-3 leaf promotion: each %s is gathered whole.", name)
