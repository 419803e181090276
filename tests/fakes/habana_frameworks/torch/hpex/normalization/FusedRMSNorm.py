"""TEST DOUBLE of ``habana_frameworks.torch.hpex.normalization.FusedRMSNorm`` (bridge 1.19.0).

Follows ``hpex/normalization/FusedRMSNorm.py``: an autograd Function whose ``apply(data_in, gamma, eps,
use_stages=True, bwd_mode=0, fast_math=False)`` (positional) returns ``data_in * rsqrt(mean(data_in^2) + eps) *
gamma``; the ``rms_norm`` op computes in fp32 internally and returns data_in's dtype when data_in and gamma have
the same dtype, float32 when they differ (``hpu_ops/backend/rms_norm_gen.cpp``).
"""

import torch

import habana_frameworks as _hf


class FusedRMSNorm:
    @staticmethod
    def apply(data_in, gamma, eps, use_stages=True, bwd_mode=0, fast_math=False, /):
        _hf.record("hpex.normalization.FusedRMSNorm", dtype=str(data_in.dtype), eps=eps, fast_math=fast_math)
        x = data_in.float()
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
        return out.to(data_in.dtype) if data_in.dtype == gamma.dtype else out
