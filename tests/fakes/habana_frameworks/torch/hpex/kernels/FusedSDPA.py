"""TEST DOUBLE of ``habana_frameworks.torch.hpex.kernels.FusedSDPA`` (bridge 1.19.0, ``hpex/kernels/FusedSDPA.py``).

Models what the wrapper does and refuses, computing on CPU with torch's math:

- ``FusedSDPA.apply(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softmax_mode="None",
  recompute_mode=None, valid_seq_len=None, seq_padding_type="left")``: an autograd Function, so every argument
  is positional; ``scale`` None means 1/sqrt(head_dim); ``softmax_mode`` is lower-cased and only "fast" changes
  anything (``hpu_ops/backend/sdpa_gen.cpp``: any other string is the default softmax); ``recompute_mode`` None
  means the process-wide recompute flag, on by default (``backend/helpers/runtime_config.cpp``).
- Its asserts: in training (q, k or v requires grad) with recompute, fast softmax needs ``is_causal``;
  ``valid_seq_len`` only in inference, causal, with no mask.
- Grouped-query attention: k/v with fewer heads are taken as they are (the wrapper reshapes q into groups);
  k/v repeated by the caller would work but waste memory, so the simulator records the head counts.
- A mask together with ``is_causal``: the wrapper does not assert, but the bridge's own tests treat the
  combination as unsupported (``tests/pytest_working/any_mode/FusedSDPA/test_hpu_sdpa.py``): refused here so
  that optimum_gaudi is caught passing both.
- Boolean masks (True = attend) and additive float masks are both accepted, as in the bridge's tests.

Fast softmax is computed like the default softmax here (its lower precision is not simulated).
"""

import math

import torch

import habana_frameworks as _hf

_RECOMPUTE_DEFAULT = True  # habana_frameworks.torch.hpu.recompute_sdp_enabled() until changed


class FusedSDPA:
    """The real one is a ``torch.autograd.Function``: ``apply`` takes its arguments by position only."""

    @staticmethod
    def apply(
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        softmax_mode="None",
        recompute_mode=None,
        valid_seq_len=None,
        seq_padding_type="left",
        /,
    ):
        softmax_mode = str(softmax_mode).lower()
        recompute = _RECOMPUTE_DEFAULT if recompute_mode is None else bool(recompute_mode)
        requires_backward = q.requires_grad or k.requires_grad or v.requires_grad
        if recompute and requires_backward and softmax_mode == "fast":
            assert is_causal, "fast softmax in training is supported only with the triangular (causal) mask"
        if valid_seq_len is not None:
            assert is_causal and not requires_backward and attn_mask is None, (
                "valid_seq_len is supported only in inference, with is_causal and no attn_mask"
            )
        if is_causal and attn_mask is not None:
            raise NotImplementedError("FusedSDPA with both attn_mask and is_causal is not supported")
        if q.dim() != 4 or k.shape[:2] != v.shape[:2] or q.shape[1] % k.shape[1]:
            raise RuntimeError(f"FusedSDPA: bad head layout q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
        _hf.record(
            "hpex.kernels.FusedSDPA",
            q_heads=q.shape[1],
            kv_heads=k.shape[1],
            mask=None if attn_mask is None else str(attn_mask.dtype),
            dropout_p=dropout_p,
            is_causal=bool(is_causal),
            scale=scale,
            softmax_mode=softmax_mode,
            recompute=recompute,
            requires_backward=requires_backward,
        )
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=bool(is_causal), scale=scale
        )
