"""TEST DOUBLE of ``habana_frameworks.torch.hpex.normalization.FusedClipNorm``.

Follows ``hpex/normalization/FusedClipNorm.py``: the constructor takes the dtype of the first parameter
and copies ``max_norm`` to the device as a shape-[1] tensor of that dtype (a host-to-device copy, recorded
here as ``hpex.normalization.FusedClipNorm``); ``clip_norm(parameters)`` scales the gradients in place so
their total 2-norm is at most max_norm and returns that norm from before clipping as a shape-[1] tensor
in that dtype, or ``torch.tensor(0.0)`` when no parameter has a gradient. The real one also runs a
mark_step before and after in lazy mode; those are not recorded as ``core.mark_step`` here.
"""

import torch

import habana_frameworks as _hf
from habana_frameworks import _device


class FusedClipNorm:
    def __init__(self, parameters, max_norm):
        params = list(parameters)
        self.dtype = params[0].dtype if params else torch.float32
        self.max_norm_t = _device.to_device((torch.ones(1) * max_norm).to(self.dtype))
        self.norm_type = 2.0
        _hf.record("hpex.normalization.FusedClipNorm", params, max_norm=max_norm, dtype=self.dtype)

    def clip_norm(self, parameters):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            _hf.record("hpex.normalization.FusedClipNorm.clip_norm", params, total_norm=0.0)
            return torch.tensor(0.0)
        with torch.no_grad():
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            scale = torch.clamp(self.max_norm_t.float() / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
        total_norm = norm.reshape(1).to(self.dtype)
        _hf.record("hpex.normalization.FusedClipNorm.clip_norm", params, total_norm=float(total_norm))
        return total_norm
