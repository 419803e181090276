"""TEST DOUBLE of ``habana_frameworks.torch.hpex.kernels.RotaryPosEmbeddingHelper`` (bridge 1.19.0).

Follows ``hpex/kernels/RotaryPosEmbeddingHelper.py``: ``RotaryPosEmbeddingMode`` BLOCKWISE (rotate-half, the
Llama / NeoX layout) and PAIRWISE (GPT-J); ``apply_rotary_pos_emb(p, cos, sin, position_ids=None, offset=0,
mode=BLOCKWISE)`` harmonizes dtypes (all fp32 if any input is, else cos/sin cast to p's dtype) and runs the
``rotary_pos_embedding`` op (which takes sin before cos; not visible from Python). ``RotaryPosEmbeddingHelperV1
.apply(p, cos, sin, offset)``: blockwise, no position ids, cos/sin already per position. ``V2.apply(p, cos, sin,
position_ids)``: blockwise, cos/sin a table gathered by position_ids when given. Gradients flow to p only.
"""

from enum import Enum

import torch

import habana_frameworks as _hf


class RotaryPosEmbeddingMode(Enum):
    BLOCKWISE = 0
    PAIRWISE = 1


def _rotate(p, mode):
    if mode is RotaryPosEmbeddingMode.BLOCKWISE:
        half = p.shape[-1] // 2
        return torch.cat((-p[..., half:], p[..., :half]), dim=-1)
    even, odd = p[..., ::2], p[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary_pos_emb(p, cos, sin, position_ids=None, offset=0, mode=RotaryPosEmbeddingMode.BLOCKWISE):
    if torch.float32 in (p.dtype, cos.dtype, sin.dtype):
        p32 = p.float()
        cos, sin = cos.float(), sin.float()
    else:
        p32 = p
        cos, sin = cos.to(p.dtype), sin.to(p.dtype)
    if position_ids is not None:  # a [1, 1, max_pos, D] table gathered per position: [B, 1, S, D]
        cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
        sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    elif offset:
        cos, sin = cos[..., offset:, :], sin[..., offset:, :]
    return p32 * cos + _rotate(p32, mode) * sin


class RotaryPosEmbeddingHelperV1:
    @staticmethod
    def apply(p, cos, sin, offset=0, /):
        _hf.record("hpex.kernels.RotaryPosEmbeddingHelperV1", shape=tuple(p.shape), offset=offset)
        return apply_rotary_pos_emb(p, cos.detach(), sin.detach(), None, offset)


class RotaryPosEmbeddingHelperV2:
    @staticmethod
    def apply(p, cos, sin, position_ids=None, /):
        _hf.record("hpex.kernels.RotaryPosEmbeddingHelperV2", shape=tuple(p.shape), positions=position_ids is not None)
        return apply_rotary_pos_emb(p, cos.detach(), sin.detach(), position_ids)
