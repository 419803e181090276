"""TEST DOUBLE of ``habana_frameworks.torch.hpex.optimizers.FusedAdamW``.

Modelled on the bridge's ``python_packages/habana_frameworks/torch/hpex/optimizers/FusedAdamW.py`` (1.19.0) and
its kernel ``hpu_ops/backend/optimizer_adamw_gen.cpp``, computed with torch ops on CPU:

- a subclass of ``torch.optim.Optimizer`` (not of AdamW), constructor defaults eps=1e-6, weight_decay=0.0;
- the step count lives in the param group (``group["step"]``, incremented once per step for the group); each
  parameter's ``state["step"]`` is set to 0 when its state is made and never advances. A torch AdamW state
  dict (a tensor ``step`` per parameter, none in the group) therefore loads here as a fresh start;
- the update: ``step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``; the moments as AdamW's;
  ``w = w * (1 - lr * weight_decay) - step_size * exp_avg / (sqrt(exp_avg_sq) + eps)``: eps is added to the
  raw second-moment root, where torch's AdamW adds it after dividing by ``sqrt(1 - beta2**t)``, so the two
  differ slightly in the first steps.

- in lazy mode the step is cut into graphs as the real one cuts it (``_mark_step_if_lazy`` at the start of
  each param group's update and after the step, ``step_wrap``); recorded as
  ``hpex.optimizers.FusedAdamW.mark_step`` (not as ``core.mark_step``, which counts the caller's own).

- FSDP2's sharded parameters (DTensors) are refused, as DTensor's dispatch refuses the bridge's kernel call.

Not simulated (they raise NotImplementedError): bias_correction=False and moments_dtype.
"""

import math

import torch
from torch.distributed.tensor import DTensor

import habana_frameworks as _hf

from ...utils.internal import is_lazy


def _mark_step_if_lazy(where: str) -> None:
    if is_lazy():
        _hf.record("hpex.optimizers.FusedAdamW.mark_step", where=where)


class FusedAdamW(torch.optim.Optimizer):
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
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr} - should be >= 0.0")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps} - should be >= 0.0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(_hf.calls_named("hpex.optimizers.FusedAdamW.step")) + 1
        _hf.record("hpex.optimizers.FusedAdamW.step", n=n, lr=[g["lr"] for g in self.param_groups])
        for group in self.param_groups:
            _mark_step_if_lazy("group")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(isinstance(p, DTensor) for p in params):
                # FusedAdamW.py hands the parameters to torch.ops.hpu.optimizer_adamw, for which the bridge registers
                # no DTensor sharding rule: DTensor's dispatch refuses the call (FSDP2's sharded parameters)
                raise NotImplementedError(
                    "Operator hpu.optimizer_adamw.default does not have a sharding strategy registered."
                )
            beta1, beta2 = group["betas"]
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            step_size = group["lr"] * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
            keep = 1.0 - group["weight_decay"] * group["lr"]
            for p in params:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"]) * -step_size
                if keep != 1.0:
                    p.mul_(keep)
                p.add_(update)
        _mark_step_if_lazy("after step")
        return loss
