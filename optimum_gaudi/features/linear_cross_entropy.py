"""--use_fused_linear_cross_entropy: a causal LM's training loss without its [tokens, vocabulary] logits.

With a 128k-token vocabulary the logits of a long batch and their gradient, not the weights, decide how
large a batch fits. Here the loss is computed from the final hidden states and the output layer's weight a
chunk of tokens at a time: each chunk's logits, log-softmax cross-entropy (fp32) and its share of the
gradients of the hidden states and of the weight are computed together, so only [chunk, vocabulary] logits
are ever alive. The gradients are kept for the backward, which only scales them.

No model class is forked: while a training step computes its loss, a forward pre-hook on the model's output
embeddings takes the hidden states and passes on only the last position (the model's own logits, softcapping
or scaling included, of one token a row, used to check the head once), and the model's own ``loss_function``
hook computes the loss from the hidden states, with ``ForCausalLMLoss``'s semantics (shifted labels or
``shift_labels``, ``ignore_index``, ``num_items_in_batch``). The same code runs on HPU, CUDA and CPU and
compiles without graph breaks.

The loss runs with autocast off: its matmuls in the dtype the output layer computes in under the caller's
autocast, everything else in float32, whatever an op list names. With ``--torch_compile`` the per-chunk
log-sum-exp and logit gradient (several passes over a chunk's logits when eager) is compiled with the model's
backend, one graph per chunk shape; the matmuls stay outside it and write in place, so the weight's gradient
is one float32 buffer however many chunks add to it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UserError
from ..seam import Seam, undo_attribute, undo_hook

logger = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed

    class DTensor:  # noqa: D101 - nothing is ever an instance
        pass


FLAG = "--use_fused_linear_cross_entropy"
# Logits of one chunk hold at most this many elements (256 MB in fp32): a 128,256-token vocabulary gives
# 523-token chunks. Larger chunks mean fewer passes over the weight's gradient, which each chunk adds to.
CHUNK_ELEMENTS = 1 << 26
# Config keys of transformers models whose head does more than its linear layer (their value: no-op)
_HEAD_CONFIG_KEYS = {
    "final_logit_softcapping": None,
    "logit_softcapping": None,
    "logits_scaling": 1,
    "logit_scale": 1,
    "output_multiplier": 1,
}
# How far the model's own logits may be from the output layer's, relative to their largest magnitude (bf16
# rounding stays far below; a logit scale or a soft cap that matters does not)
_HEAD_CHECK_TOLERANCE = 0.02
_INSTALLED = "_gaudi_fused_linear_cross_entropy"  # the model's hooks (or None: they cannot serve it)


def _eager_chunk(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grads: bool) -> torch.Tensor:
    """The summed cross-entropy of one chunk of float32 logits; with ``grads``, the logits are replaced by the
    gradient of that sum with respect to them (softmax minus the one-hot target, 0 on ignored rows). Eager: each
    step in place, so that no [chunk, vocabulary] temporary is made."""
    kept = target != ignore_index
    target = target.masked_fill(~kept, 0)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    top = logits.amax(1, keepdim=True)
    sums = logits.sub_(top).exp_().sum(1)  # the logits' exponentials, in place
    total = torch.where(kept, sums.log() + top.squeeze(1) - picked, 0.0).sum()
    if grads:
        # softmax, and 0 on ignored rows: their exponentials divided by infinity (no pass of its own)
        logits.div_(sums.masked_fill(~kept, float("inf"))[:, None])
        logits.scatter_add_(1, target[:, None], -kept[:, None].to(logits.dtype))
    return total


def _fused_chunk(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grads: bool) -> torch.Tensor:
    """:func:`_eager_chunk` for a compiler, on logits of the head's dtype (float32 inside): written as one
    reduction (the log-sum-exp) and one elementwise pass that a compiler fuses, the gradient stored into the
    logits in their dtype."""
    kept = target != ignore_index
    target = target.masked_fill(~kept, 0)
    x = logits.float()
    lse = torch.logsumexp(x, 1)
    # the target's logit picked by the one-hot mask the gradient needs anyway, not by gather: torch 2.10's inductor
    # let the in-place write of the gradient below reach a gather of the logits (the loss off by 15%)
    hot = torch.arange(x.shape[1], device=x.device)[None, :] == target[:, None]
    total = torch.where(kept, lse - torch.where(hot, x, 0.0).sum(1), 0.0).sum()
    if grads:
        grad = torch.where(kept[:, None], (x - lse[:, None]).exp() - hot.to(x.dtype), 0.0)
        logits.copy_(grad)
    return total


# Devices whose kernels add a bf16 product into a float32 matrix in place (addmm with out_dtype): by device type
_MIXED_ADDMM: dict[str, bool] = {}


def _note_mixed_addmm(device: torch.device) -> None:
    """Whether this device's addmm accumulates a low-precision product into float32 in place, tried once on a
    small matrix where the device registers the kernel (torch's CUDA; not its CPU)."""
    if device.type in _MIXED_ADDMM:
        return
    works = False
    try:  # the overload came with torch 2.8: looking it up on an older torch raises (no such operator)
        key = torch._C._dispatch_key_for_device(device.type)
        if torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", key):
            a, b = (torch.randn(16, 16, device=device, dtype=torch.bfloat16) for _ in range(2))
            c = torch.ones(16, 16, device=device)
            torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
            works = bool(torch.allclose(c, 1 + a.float() @ b.float(), rtol=1e-2, atol=1e-2))
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        works = False
    _MIXED_ADDMM[device.type] = works


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, in place: no [vocabulary, hidden] temporary where the dtypes agree or the device's addmm
    writes a low-precision product into float32 (a chunk's temporary otherwise)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif _MIXED_ADDMM.get(total.device.type, False):
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total += a @ b


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over the tokens of cross-entropy(hidden @ weight.T + bias, targets); gradients made in the forward.

    ``step`` is the per-chunk loss and logit gradient: :func:`_eager_chunk` on a float32 buffer, or a compiled
    :func:`_fused_chunk` on a buffer of the head's dtype. The matmuls stay outside it, in place, so the weight's
    gradient is accumulated without a temporary and a compiled step is one graph per chunk shape."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, chunk, grad_hidden, grad_weight, compute, step):
        h, w, b = hidden.to(compute), weight.to(compute), None if bias is None else bias.to(compute)
        total = hidden.new_zeros((), dtype=torch.float32)
        gh = torch.empty_like(hidden) if grad_hidden else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
        gb = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if grad_weight and bias is not None
            else None
        )
        grads = gh is not None or gw is not None
        # logits go into one buffer: a new block per chunk would grow a host's heap (blocks are kept there)
        dtype = torch.float32 if step is None else compute
        buffer = hidden.new_empty((min(chunk, hidden.shape[0]), weight.shape[0]), dtype=dtype)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = buffer[: h[rows].shape[0]]
            if dtype != compute:
                logits.copy_(F.linear(h[rows], w, b))
            elif b is None:
                torch.mm(h[rows], w.t(), out=logits)
            else:
                torch.addmm(b, h[rows], w.t(), out=logits)
            total = total + (step or _eager_chunk)(logits, targets[rows], ignore_index, grads)
            if not grads:
                continue
            grad = logits.to(compute)  # the logits' gradient
            if gh is not None:
                gh[rows] = grad @ w
            if gw is not None:
                _accumulate(gw, grad.t(), h[rows])
            if gb is not None:
                gb += logits.sum(0, dtype=torch.float32)
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        """The gradients the forward made, scaled in place (the backward of a step runs once)."""
        gh, gw, gb = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            None if gh is None else gh.mul_(grad_total.to(gh.dtype)),
            None if gw is None else gw.mul_(grad_total).to(weight_dtype),
            None if gb is None else gb.mul_(grad_total).to(bias_dtype),
            *(None,) * 7,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    compiled_chunk: Callable | None = None,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(F.linear(hidden, weight, bias), labels, ...)``, never holding the logits:
    labels shifted by one (or ``shift_labels`` as given), ``ignore_index`` left out, the sum divided by
    ``num_items_in_batch`` when given, else the mean over the tokens kept. ``compiled_chunk`` (from
    :func:`compiled_chunk`) computes each chunk's loss and logit gradient compiled; eager without it."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    grads = torch.is_grad_enabled()
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    compute = F.linear(hidden[:1], weight).dtype  # what autocast (if any) makes of the output layer
    if not torch.compiler.is_compiling():
        _note_mixed_addmm(weight.device)
    with _autocast_off(hidden.device.type):
        total = _LinearCrossEntropy.apply(
            hidden, weight, bias, targets, ignore_index, chunk, grads and hidden.requires_grad,
            grads and (weight.requires_grad or (bias is not None and bias.requires_grad)), compute, compiled_chunk,
        )  # fmt: skip
        if num_items_in_batch is None:
            return total / (targets != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


@functools.cache
def compiled_chunk(**compile_kwargs: Any) -> Callable:
    """The chunk step compiled with these ``torch.compile`` arguments (once per set of them): one graph per chunk
    shape, the full chunks' and the last one's (a model compiled whole inlines it into its own graph)."""
    return torch.compile(_fused_chunk, **compile_kwargs)


# Whether a device type has autocast, asked once eagerly (dynamo could not trace the question before torch 2.11)
_AUTOCAST: dict[str, bool] = {}


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off around the loss: its matmuls run in the dtype the output layer computes in under the caller's
    autocast (cast explicitly), everything else in float32 whatever an op list names. Habana's default lists put
    ``mul`` in bf16 (hpu_ops/autocast_helpers.h), which made the per-token sum bf16."""
    available = _AUTOCAST.get(device_type)
    if available is None and torch.compiler.is_compiling():
        available = True  # cpu, cuda, hpu: every device this traces on has autocast; the check is not traceable (2.10)
    elif available is None:
        available = _AUTOCAST.setdefault(device_type, torch.amp.is_autocast_available(device_type))
    return torch.autocast(device_type=device_type, enabled=False) if available else contextlib.nullcontext()


def _head_problem(model: nn.Module) -> str | None:
    """Why the fused loss cannot stand in for this model's head and loss; None when it can."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        kind = "none" if head is None else type(head).__name__
        return f"{name}'s output layer is {kind}, not a torch.nn.Linear (an adapter on lm_head, e.g. LoRA, counts)"
    seam = Seam.find(model, "loss_function")  # the model's own, under what compilation laid over it
    loss_function = seam.original if seam is not None else getattr(model, "loss_function", None)
    if loss_function is not ForCausalLMLoss:
        return f"{name} computes its loss otherwise than transformers' ForCausalLMLoss"
    configs = [model.config, getattr(model.config, "text_config", None)]
    for config in filter(None, configs):
        for key, neutral in _HEAD_CONFIG_KEYS.items():
            value = getattr(config, key, neutral)
            if value != neutral:
                return f"{name}'s head applies {key}={value} to the logits, which the fused loss does not"
    return None


class FusedLinearCrossEntropy:
    """The hooks on one causal LM; they change nothing unless :meth:`step` is active (training steps only)."""

    def __init__(self, model: nn.Module) -> None:
        self.head: nn.Linear = model.get_output_embeddings()
        self.active = False
        self.hidden: torch.Tensor | None = None
        self.probe: tuple[torch.Tensor, torch.Tensor] | None = None  # (the model's last logits, their hidden)
        self.checked = False
        self.compiled_chunk: Callable | None = None  # the chunk step, compiled (see compile_with); None: eager
        undo_hook(self.head, self.head.register_forward_pre_hook(self._take_hidden))
        undo_attribute(model, _INSTALLED)
        Seam.of(model, "loss_function").put("fused_loss", lambda own: functools.partial(self._loss, own))

    @classmethod
    def of(cls, model: nn.Module, strict: bool = True) -> FusedLinearCrossEntropy | None:
        """The hooks installed on ``model`` (a transformers model, or a PEFT model around one), once. A model
        they cannot serve is one line: an error when ``strict`` (the flag), else a warning and None (the Gaudi
        config key, which asks for the fused loss where it applies)."""
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        if _INSTALLED not in vars(model):
            problem = _head_problem(model)
            if problem is not None:
                _refuse(problem, strict)
            vars(model)[_INSTALLED] = cls(model) if problem is None else None
        return vars(model)[_INSTALLED]

    def compile_with(self, compile_kwargs: dict[str, Any]) -> None:
        """Compile the loss's chunk step with the model (``torch.compile`` arguments): under regional compilation
        the loss runs beside the compiled blocks, its chunk step compiled; a model compiled whole traces it into
        its own graph."""
        self.compiled_chunk = compiled_chunk(**compile_kwargs)

    def _take_hidden(self, module: nn.Module, args: tuple) -> tuple | None:
        if not self.active:
            return None
        self.hidden = args[0]
        return (args[0][..., -1:, :], *args[1:])

    def _loss(
        self, own_loss: Callable, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None, **kwargs
    ):
        """The model's loss function while the hooks are on: ``own_loss`` is what it was before them."""
        hidden, self.hidden = self.hidden, None
        if hidden is None:  # not a training step, or a head that did not go through the hook
            return own_loss(logits, labels, vocab_size, **kwargs)
        if labels.dim() > 1 and hidden.shape[0] > labels.shape[0]:
            hidden = hidden[: labels.shape[0]]  # the real rows, as a short batch padded in the forward gives labels
        weight, bias = self._unsharded_head()
        self.probe = (logits.detach(), hidden[..., -1:, :].detach())
        known = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
        return linear_cross_entropy(hidden, weight, labels, bias, compiled_chunk=self.compiled_chunk, **known)

    def _unsharded_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output layer's weight and bias, whole. An output layer that is an FSDP2 unit of its own was
        resharded after its (one position a row) forward: it is all-gathered again for the loss. FSDP's
        end-of-backward callback reduce-scatters gradients left on unsharded parameters by a group whose own
        backward hook never ran (``_fsdp_state.py``, ``_root_post_backward_final_callback``), so the head's
        gradient is sharded as FSDP's own backward would have."""
        if isinstance(self.head.weight, DTensor):
            unshard = getattr(self.head, "unshard", None)  # FSDPModule (fully_shard) only
            if unshard is None:
                raise UserError(
                    f"{FLAG}: the output layer's weight is a DTensor outside FSDP (tensor parallelism?); "
                    f"train without {FLAG}."
                )
            unshard()
        return self.head.weight, self.head.bias

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one training step's loss: the hooks active; afterwards, once, the check that the model's
        logits are its output layer's (no scale or cap the fused loss would leave out)."""
        self.active, self.hidden = True, None
        try:
            yield
        finally:
            self.active, left = False, self.hidden
            self.hidden = None
        if left is not None:
            raise UserError(f"{FLAG}: the model did not compute its loss through its loss_function; train without it.")
        if not self.checked and self.probe is not None:
            self._check_head(*self.probe)
        self.probe = None

    def _check_head(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.checked = True
        with torch.no_grad():
            bias = None if self.head.bias is None else self.head.bias.float()
            expected = F.linear(hidden.float(), self.head.weight.float(), bias)
            error = (logits.float() - expected).abs().max()
            if error > _HEAD_CHECK_TOLERANCE * expected.abs().max():
                raise UserError(
                    f"{FLAG}: the model's logits are not its output layer's (its head scales or caps them); "
                    f"train without {FLAG}."
                )


def enabled(args: Any, gaudi_config: Any) -> bool:
    """On with the flag or the Gaudi config key."""
    return bool(getattr(args, "use_fused_linear_cross_entropy", False) or gaudi_config.use_fused_linear_cross_entropy)


def _refuse(problem: str, strict: bool) -> None:
    if strict:
        raise UserError(f"{FLAG}: {problem}; train without {FLAG}.")
    logger.warning("use_fused_linear_cross_entropy (Gaudi config) is off for this run: %s.", problem)


def applies(trainer: Any, mixin: type) -> bool:
    """Whether this trainer's training steps use the fused loss. Where it cannot stand in for the model's (the
    logits a training step computes are one position a row, so nothing else may need them), the flag is an
    error in one line when the trainer is built, the Gaudi config key a warning."""
    from transformers import Trainer

    if not enabled(trainer.args, trainer.gaudi_config):
        return False
    own = [k.__name__ for k in type(trainer).__mro__ if "compute_loss" in vars(k) and k not in (mixin, Trainer)]
    if own:
        problem = f"{own[0]} overrides compute_loss (it may read the logits, which are not computed)"
    elif trainer.label_smoother is not None:
        problem = "--label_smoothing_factor smooths the full logits"
    elif getattr(trainer, "compute_loss_func", None) is not None:
        problem = "a compute_loss_func takes the full logits"
    elif trainer.args.use_hpu_graphs_for_training:
        problem = "--use_hpu_graphs_for_training replays the forward without the hooks that take the hidden states"
    else:
        return True
    _refuse(problem, strict=trainer.args.use_fused_linear_cross_entropy)
    return False
