"""TEST DOUBLE of ``habana_frameworks.torch.hpex.normalization.FusedClipNorm``.

``FusedClipNorm(parameters, max_norm).clip_norm(parameters)`` scales the gradients in place so their
total 2-norm is at most max_norm and returns that norm as it was before clipping; here this is done by
torch.nn.utils.clip_grad_norm_. With no gradient at all it returns ``torch.tensor(0.0)``, as the real one.
"""

import torch

import habana_frameworks as _hf


class FusedClipNorm:
    def __init__(self, parameters, max_norm):
        params = list(parameters)
        self.dtype = params[0].dtype if params else torch.float32
        self.max_norm = max_norm
        self.norm_type = 2.0
        _hf.record("hpex.normalization.FusedClipNorm", params, max_norm=max_norm)

    def clip_norm(self, parameters):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        params = [p for p in params if p.grad is not None]
        if not params:
            total_norm = torch.tensor(0.0)
        else:
            total_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm, norm_type=self.norm_type)
        _hf.record("hpex.normalization.FusedClipNorm.clip_norm", params, total_norm=float(total_norm))
        return total_norm
