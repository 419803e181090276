"""Gaudi's fused attention as a transformers attention implementation: ``attn_implementation="gaudi_fused_sdpa"``.

Registered in transformers' own ``AttentionInterface`` (and its mask builder in ``AttentionMaskInterface``), so
every model that dispatches attention through it (Llama, Mistral, Qwen, Gemma, GPT-NeoX, ...) gets the kernel
with no forked model class, and a saved model keeps its own class and config: transformers never writes the
implementation's name into ``config.json``.

On a Gaudi the device's kernel is ``hpex.kernels.FusedSDPA`` in the modes the ``--flash_attention_*`` flags name.
Elsewhere the name means transformers' own ``sdpa`` integration, call for call: losses equal ``sdpa``'s exactly,
and the Gaudi-only modes change nothing there (said once in the feature table).

The name is process-wide, as transformers' registry is; the kernel and its modes are not: the trainer binds them
to the layers of its own model (``bind``), so two trainers of one process (or a model no trainer was given) never
run each other's kernel. optimum-habana keeps them in environment variables, process-wide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..seam import Named, Seam

ATTENTION_NAME = "gaudi_fused_sdpa"

# (query, key, value, mask or None, dropout_p, is_causal, scale, the attention layer) -> [batch, heads, q_len, head_dim]
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, float, bool, Any, Any], torch.Tensor]


@dataclass(frozen=True)
class FusedAttentionOptions:
    """optimum-habana's ``--flash_attention_*`` flags, as FusedSDPA reads them."""

    recompute: bool = False  # recompute the attention in the backward instead of keeping it (memory)
    causal_mask: bool = False  # the kernel's causal mode instead of the padding mask (exact for right padding)
    fast_softmax: bool = False  # the kernel's fast (lower-precision) softmax
    fp8: bool = False  # attention in fp8 inside --fp8's Transformer Engine (a Gaudi 3)

    @classmethod
    def from_args(cls, args: Any) -> FusedAttentionOptions:
        return cls(
            recompute=bool(getattr(args, "flash_attention_recompute", False)),
            causal_mask=bool(getattr(args, "flash_attention_causal_mask", False)),
            fast_softmax=bool(getattr(args, "flash_attention_fast_softmax", False)),
            fp8=bool(getattr(args, "flash_attention_fp8", False)),
        )


@dataclass(frozen=True)
class AttentionBinding:
    """What ``gaudi_fused_sdpa`` runs in the layers of one model: the device's kernel (None: transformers' sdpa
    integration) in the modes of the arguments of the trainer it was given to."""

    kernel: AttentionKernel | None
    options: FusedAttentionOptions


BINDING = "_gaudi_fused_attention"  # the attribute each module of a model given to a trainer carries
_SDPA = AttentionBinding(None, FusedAttentionOptions())  # a model no trainer was given


def register() -> None:
    """Make ``gaudi_fused_sdpa`` a name transformers accepts (``from_pretrained``, ``set_attn_implementation``).
    Its masks are sdpa's: boolean, and None for a purely causal batch, so the causal kernel mode can run."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, fused_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


_FLAGS = ("flash_attention_recompute", "flash_attention_causal_mask", "flash_attention_fast_softmax")


def argument_problem(args: Any) -> str | None:
    """The attention flags' checks, as optimum-habana makes them, in one line; None when they can run."""
    given = [f"--{name}" for name in (*_FLAGS, "flash_attention_fp8") if getattr(args, name, False)]
    if given and args.attn_implementation != ATTENTION_NAME:
        return f"{', '.join(given)} set the modes of --attn_implementation {ATTENTION_NAME}; add it or drop them."
    if getattr(args, "flash_attention_fp8", False) and not getattr(args, "fp8", False):
        return "--flash_attention_fp8 runs attention inside --fp8's Transformer Engine; add --fp8 or drop it."
    return None


def prepare(args: Any) -> None:
    """``--sdp_on_bf16``: torch's math SDPA may reduce in bf16 (process-wide, set where the run starts)."""
    if getattr(args, "sdp_on_bf16", False):
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)


def bind(model: torch.nn.Module, kernel: AttentionKernel | None, options: FusedAttentionOptions) -> None:
    """What ``gaudi_fused_sdpa`` runs in ``model``'s layers: the device's fused kernel, or None for torch's SDPA.
    Every module carries it (the attention function is handed its layer, whichever module class that is); the
    binding is a plain attribute, outside the parameters, buffers and ``state_dict``."""
    binding = AttentionBinding(kernel, options)
    for module in model.modules():
        setattr(module, BINDING, binding)


def use(model: torch.nn.Module, args: Any, device: Any) -> None:
    """The preparation's attention stage: ``--attn_implementation`` set on ``model`` (a PEFT model's
    transformers model), and for gaudi_fused_sdpa the device's kernel and the flags' modes bound to its layers."""
    if args.attn_implementation is None:
        return
    if args.attn_implementation == ATTENTION_NAME:
        options = FusedAttentionOptions.from_args(args)
        bind(model, device.attention_kernel(options), options)
    base = getattr(model, "get_base_model", lambda: model)()
    seam = Seam.of(base, "attn_implementation")
    if "requested" in seam:
        if seam.value("requested") == args.attn_implementation:
            return
        seam.undo()  # another trainer's request on this model; a split is laid again over this one, next stage
    seam.put("requested", Named(args.attn_implementation))


def fused_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [B, H, T, D], k/v [B, Hkv, S, D] (grouped heads not repeated: the
    fused kernel takes them as they are); returns [B, T, H, D]."""
    binding: AttentionBinding = getattr(module, BINDING, _SDPA)
    if binding.kernel is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = attention_mask
    if mask is not None and causal and binding.options.causal_mask and q_len == kv_len:
        mask = None  # right-padded batches: real tokens never see the pads after them
    if mask is not None:
        mask = mask[:, :, :, :kv_len]
        causal = False  # the mask already holds the causal part (sdpa_mask builds it so)
    else:
        causal = causal and q_len > 1 and q_len == kv_len
    output = binding.kernel(query, key, value, mask, dropout, causal, scaling, module)
    return output.transpose(1, 2).contiguous(), None


# The name is known to transformers as soon as arguments can ask for it, before a script loads a model with it
# (``from_pretrained(attn_implementation="gaudi_fused_sdpa")``): transformers' own registry, where its built-in
# names live; a model that does not ask for the name is unchanged.
register()
