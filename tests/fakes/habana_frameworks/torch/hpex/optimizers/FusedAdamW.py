"""TEST DOUBLE of ``habana_frameworks.torch.hpex.optimizers.FusedAdamW``.

Same constructor signature and defaults as the real optimizer (note eps=1e-6 and weight_decay=0.0, not
torch's 1e-8 and 1e-2). The update is torch.optim.AdamW's (decoupled weight decay), computed on CPU, so
results match ``torch.optim.AdamW`` with the same hyper-parameters exactly. The real fused kernel may
differ from that in the last bits (it folds the bias corrections into the step size).

Not simulated (they raise NotImplementedError): bias_correction=False and moments_dtype.
Differences a test could see: this class is a subclass of torch.optim.AdamW (the real one derives from
torch.optim.Optimizer), so its param groups carry AdamW's extra keys; and the real optimizer also calls
mark_step() around its update in lazy mode, which is not recorded as ``core.mark_step`` here.
"""

import torch

import habana_frameworks as _hf


class FusedAdamW(torch.optim.AdamW):
    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        bias_correction=True,
        moments_dtype=None,
    ):
        if not bias_correction:
            raise NotImplementedError("fake FusedAdamW: bias_correction=False is not simulated")
        if moments_dtype is not None:
            raise NotImplementedError("fake FusedAdamW: moments_dtype is not simulated")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.defaults["bias_correction"] = bias_correction
        for group in self.param_groups:
            group.setdefault("bias_correction", bias_correction)
        self.moments_dtype = moments_dtype
        n_params = sum(len(g["params"]) for g in self.param_groups)
        _hf.record(
            "hpex.optimizers.FusedAdamW",
            params=f"<{n_params} tensors in {len(self.param_groups)} groups>",
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            moments_dtype=moments_dtype,
        )
        # A pre-hook rather than an overridden step(): torch wraps step() with its own hook runner, and
        # calling super().step() from an override could run the user's step hooks twice.
        self.register_step_pre_hook(FusedAdamW._record_step)

    @staticmethod
    def _record_step(optimizer, args, kwargs):
        n = len(_hf.calls_named("hpex.optimizers.FusedAdamW.step")) + 1
        _hf.record("hpex.optimizers.FusedAdamW.step", n=n, lr=[g["lr"] for g in optimizer.param_groups])
