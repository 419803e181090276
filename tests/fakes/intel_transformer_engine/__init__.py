"""TEST DOUBLE of ``intel_transformer_engine`` (Intel Gaudi Transformer Engine), the package the bridge's
``hpex/experimental/transformer_engine`` re-exports. ``FAKE_HPU_NO_TE=1``: not installed (ImportError).

Modelled from how the bridge's tests drive it (``tests/pytest_working/any_mode/test_hpu_fp8_te.py``) and from
NVIDIA's Transformer Engine, which it is derived from (the bridge file carries NVIDIA's copyright):

- ``Linear(in_features, out_features, bias=True, params_dtype=None, skip_weight_param_allocation=False,
  minimize_memory=False)``; skipping the allocation leaves ``weight`` to be assigned (or passed to ``forward(inp,
  weight, bias)``); a forward with no weight fails.
- Outside ``fp8_autocast(enabled=True)`` the layer is a plain linear (the bridge's ``test_te_linear_fp8_disabled``
  compares it with ``torch.nn.functional.linear``).
- Inside, input and weight are cast to the recipe's forward fp8 format and the output gradient to its backward
  format, each scaled by delayed scaling: ``scale = fp8_max / amax`` with amax from ``amax_history`` (the
  previous steps', ``fp8_meta["scaling_fwd"].amax_history``); the first step uses scale 1. The matmul then runs
  on the de-scaled values (the real kernel multiplies in fp8 with fp32 accumulation).
- The scaling state is module state: ``state_dict`` holds ``_extra_state`` (a uint8 tensor, as NVIDIA's TE, or
  with FAKE_HPU_TE_EXTRA_STATE=bytesio an ``io.BytesIO``; ``set_extra_state`` takes either).
- ``FusedAttention(scale, attention_dropout, enable_recompute)`` called ``(q, k, v, attn_mask, is_causal,
  softmax_mode)``, as optimum-habana builds and calls it (``optimum/habana/accelerate/utils/transformer_engine.py``);
  query and key/value heads must match (asserted: the model repeats grouped heads); inside ``fp8_autocast`` q, k
  and v are rounded through e4m3 with delayed scaling, then attention runs as torch's SDPA. Its dropout is the one
  it was built with, in training mode only (``self.training``, as NVIDIA TE's ``DotProductAttention``); it keeps
  scaling state in ``_extra_state`` as ``Linear`` does.
- The extra state holds the amax histories and how many steps they cover (NVIDIA TE's ``get_extra_state`` in
  ``module/base.py`` saves the scales with the histories), so a restored module scales its next step as before.
- ``PT_TE_CUSTOM_OP`` is read once, when the package is first imported (``CUSTOM_OP``): the switch that makes its
  ops custom ops torch.compile can trace; set later, it changes nothing.
Every fp8 forward and the autocast entries are recorded (``te.Linear.forward``, ``te.fp8_autocast`` with the
recipe's fields and ``custom_op``).
"""

import contextlib
import io
import os
import pickle

import habana_frameworks as _hf
import torch
import torch.nn.functional as F

from . import distributed, recipe

if os.environ.get("FAKE_HPU_NO_TE") == "1":
    raise ModuleNotFoundError("No module named 'intel_transformer_engine'", name="intel_transformer_engine")

CUSTOM_OP = os.environ.get("PT_TE_CUSTOM_OP") == "1"  # read at import only
_state = {"enabled": False, "recipe": None}


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: recipe.DelayedScaling | None = None, fp8_group=None):
    fields = {k: v for k, v in vars(fp8_recipe).items() if k != "fp8_format"} if fp8_recipe is not None else {}
    _hf.record(
        "te.fp8_autocast",
        enabled=enabled,
        fp8_format=getattr(getattr(fp8_recipe, "fp8_format", None), "value", None),
        custom_op=CUSTOM_OP,
        **fields,
    )
    saved = dict(_state)
    _state.update(enabled=enabled, recipe=fp8_recipe or recipe.DelayedScaling())
    try:
        yield
    finally:
        _state.update(saved)


class _Meta:
    def __init__(self, history: int):
        self.amax_history = torch.zeros(history, 2)  # [step, (input, weight) or (grad,)]
        self.steps = 0

    def scale(self, column: int, dtype: torch.dtype, algo: str) -> float:
        recent = self.amax_history[: self.steps, column]
        amax = float(recent.max() if algo == "max" else recent[-1]) if self.steps else 0.0
        return torch.finfo(dtype).max / amax if amax > 0 else 1.0

    def record(self, column: int, amax: float) -> None:
        row = self.steps % self.amax_history.shape[0]
        self.amax_history[row, column] = amax


def _extra_state(fp8_meta: dict) -> torch.Tensor | io.BytesIO:
    """A uint8 tensor of the pickled state; with FAKE_HPU_TE_EXTRA_STATE=bytesio an ``io.BytesIO`` written by
    ``torch.save``, the other form the bridge's TE test reads (``print_extra_state`` in ``test_hpu_fp8_te.py``,
    as NVIDIA TE's ``set_extra_state`` takes both): which one Intel's closed TE returns is not public."""
    state = {k: (v.amax_history, v.steps) for k, v in fp8_meta.items() if k != "recipe"}
    buffer = io.BytesIO()
    if os.environ.get("FAKE_HPU_TE_EXTRA_STATE") == "bytesio":
        torch.save(state, buffer)
        buffer.seek(0)
        return buffer
    pickle.dump(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _set_extra_state(fp8_meta: dict, state) -> None:
    if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
        return
    if isinstance(state, torch.Tensor):
        loaded = pickle.loads(state.detach().cpu().numpy().tobytes())
    elif isinstance(state, io.BytesIO):
        state.seek(0)
        loaded = torch.load(state, map_location="cpu")
    else:
        raise RuntimeError("Unsupported checkpoint format.")  # NVIDIA TE module/base.py set_extra_state
    for key, (history, steps) in loaded.items():
        fp8_meta[key].amax_history, fp8_meta[key].steps = history, steps


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return ((x.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / scale).to(
        x.dtype
    )


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, module):
        r = module.fp8_meta["recipe"]
        fwd = r.fp8_format.forward_dtype()
        meta = module.fp8_meta["scaling_fwd"]
        phase = distributed._phase
        if phase["recompute"]:  # a checkpointed layer recomputed: the forward's scales, the history untouched
            scale_inp, scale_w = phase["saved"][id(module)]
        else:
            scale_inp, scale_w = meta.scale(0, fwd, r.amax_compute_algo), meta.scale(1, fwd, r.amax_compute_algo)
            if phase["saved"] is not None:
                phase["saved"][id(module)] = (scale_inp, scale_w)
            meta.record(0, float(inp.detach().abs().max()))
            meta.record(1, float(weight.detach().abs().max()))
            meta.steps += 1
        q_inp = _quantize(inp, fwd, scale_inp)
        q_w = _quantize(weight.to(inp.dtype), fwd, scale_w)
        ctx.save_for_backward(q_inp, q_w)
        ctx.module, ctx.has_bias, ctx.dtypes = module, bias is not None, (inp.dtype, weight.dtype)
        return F.linear(q_inp, q_w, None if bias is None else bias.to(inp.dtype))

    @staticmethod
    def backward(ctx, grad):
        q_inp, q_w = ctx.saved_tensors
        module = ctx.module
        r = module.fp8_meta["recipe"]
        bwd = r.fp8_format.backward_dtype()
        meta = module.fp8_meta["scaling_bwd"]
        q_grad = _quantize(grad, bwd, meta.scale(0, bwd, r.amax_compute_algo))
        meta.record(0, float(grad.detach().abs().max()))
        meta.steps += 1
        q_grad, q_inp, q_w = q_grad.float(), q_inp.float(), q_w.float()  # fp32 accumulation, as the kernel
        grad_inp = (q_grad @ q_w).to(ctx.dtypes[0])
        rows = q_grad.reshape(-1, q_grad.shape[-1])
        grad_w = (rows.t() @ q_inp.reshape(-1, q_inp.shape[-1])).to(ctx.dtypes[1])
        grad_b = rows.sum(0) if ctx.has_bias else None
        return grad_inp, grad_w, grad_b, None


class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, skip_weight_param_allocation=False,
                 minimize_memory=False, **kwargs):  # fmt: skip
        super().__init__()
        _hf.record("te.Linear", in_features=in_features, out_features=out_features, bias=bias,
                   params_dtype=str(params_dtype), skip_weight_param_allocation=skip_weight_param_allocation,
                   minimize_memory=minimize_memory)  # fmt: skip
        self.in_features, self.out_features = in_features, out_features
        self.minimize_memory = minimize_memory
        dtype = params_dtype or torch.get_default_dtype()
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.fp8_meta = {"recipe": recipe.DelayedScaling(), "scaling_fwd": _Meta(1024), "scaling_bwd": _Meta(1024)}

    def forward(self, inp, weight=None, bias=None):
        weight = weight if weight is not None else self.weight
        bias = bias if bias is not None else self.bias
        if weight is None:
            raise RuntimeError("te.Linear was built with skip_weight_param_allocation=True: assign or pass a weight")
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise RuntimeError(f"te.Linear: weight of shape {tuple(weight.shape)}, expected "
                               f"{(self.out_features, self.in_features)}")  # fmt: skip
        if not _state["enabled"]:
            _hf.record("te.Linear.forward", fp8=False)
            return F.linear(inp, weight.to(inp.dtype), None if bias is None else bias.to(inp.dtype))
        r = _state["recipe"]
        self.fp8_meta["recipe"] = r  # the forward's recipe; the history kept unless its length changes
        if self.fp8_meta["scaling_fwd"].amax_history.shape[0] != r.amax_history_len:
            history = r.amax_history_len
            self.fp8_meta.update(scaling_fwd=_Meta(history), scaling_bwd=_Meta(history))
        _hf.record("te.Linear.forward", fp8=True, fp8_format=r.fp8_format.value, dtype=str(inp.dtype))
        return _Fp8Matmul.apply(inp, weight, bias, self)

    def get_extra_state(self) -> torch.Tensor | io.BytesIO:
        return _extra_state(self.fp8_meta)

    def set_extra_state(self, state) -> None:
        _set_extra_state(self.fp8_meta, state)


class FusedAttention(torch.nn.Module):
    def __init__(self, scale=None, attention_dropout=0.0, enable_recompute=False, **kwargs):
        super().__init__()
        self.scale, self.attention_dropout, self.enable_recompute = scale, attention_dropout, enable_recompute
        self.fp8_meta = {"recipe": recipe.DelayedScaling(), "scaling_fwd": _Meta(1024)}

    def forward(self, q, k, v, attn_mask=None, is_causal=False, softmax_mode="None"):
        if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]:
            raise RuntimeError(
                f"FusedAttention: query, key and value heads differ ({q.shape[1]}, {k.shape[1]}, {v.shape[1]})"
            )
        _hf.record("te.FusedAttention", instance=id(self), fp8=_state["enabled"], is_causal=is_causal, mask=attn_mask is not None,
                   recompute=self.enable_recompute, softmax_mode=str(softmax_mode))  # fmt: skip
        if _state["enabled"]:
            r = _state["recipe"]
            meta, dtype = self.fp8_meta["scaling_fwd"], r.fp8_format.forward_dtype()
            quantized = []
            for column, x in enumerate((q, k, v)):
                quantized.append(_quantize(x, dtype, meta.scale(min(column, 1), dtype, r.amax_compute_algo)))
            meta.record(0, float(q.detach().abs().max()))
            meta.record(1, float(max(k.detach().abs().max(), v.detach().abs().max())))
            meta.steps += 1
            q, k, v = quantized
        dropout = self.attention_dropout if self.training else 0.0
        _hf.record("te.FusedAttention.dropout", instance=id(self), dropout=dropout)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal,
                                              scale=self.scale)  # fmt: skip

    def get_extra_state(self) -> torch.Tensor | io.BytesIO:
        return _extra_state(self.fp8_meta)

    def set_extra_state(self, state) -> None:
        _set_extra_state(self.fp8_meta, state)
