"""Op lists that feed one op inputs of two dtypes, found before the first training step, in one line.

A bf16 op list says which ops run in bf16; every op left out of both lists runs in whatever dtype its inputs
have. So a list can leave an op that needs one dtype with inputs of two: Llama's attention gets bf16 values
from ``linear`` but float32 queries and keys from the rotary embedding (``mul`` promotes to the float32
cos/sin), and scaled_dot_product_attention refuses them with a kernel error at step 1, after the model,
data and optimizer are loaded. Which ops an architecture mixes is a property of its code, not of a pattern we
could list, so the check asks the model itself: one no-grad forward of a dummy batch (a row of 8 tokens,
one image, a fraction of a second of audio) under the trainer's autocast. If it fails there and succeeds
without the autocast, the op lists are the cause, and the error says which op and which config keys to change.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import UserError, one_line
from .op_lists import HABANA_DEFAULT_BF16_OPS, KNOWN_OPS

logger = logging.getLogger(__name__)

DUMMY_LENGTH = 8  # tokens (or audio frames) in the dummy row: enough for every attention and conv path


class OpListDtypeError(UserError, RuntimeError):
    """The Gaudi config's autocast op lists give an op inputs of mixed dtypes on this model."""


def check_op_lists(model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager] | None) -> None:
    """Raise :class:`OpListDtypeError` (one line) when the autocast mixes dtypes in this model's forward.

    ``autocast`` is the trainer's autocast factory (None: no op-list autocast, nothing to check). Checked once
    per model and autocast, and never on a compiled model: a forward of another shape would recompile it."""
    if autocast is None or model.__dict__.get(_CHECKED) is autocast or _is_compiled(model):
        return
    problem = op_list_problem(model, autocast)
    if problem is not None:
        raise OpListDtypeError(problem)
    model.__dict__[_CHECKED] = autocast


_CHECKED = "_gaudi_op_lists_checked"


def _is_compiled(model: nn.Module) -> bool:
    """torch.compile(model) (an OptimizedModule, which keeps the model as _orig_mod) or module.compile() anywhere
    in it (regional compilation)."""
    return hasattr(model, "_orig_mod") or any(
        getattr(module, "_compiled_call_impl", None) is not None for module in model.modules()
    )


def op_list_problem(model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager]) -> str | None:
    """One line saying which op the autocast's lists leave with mixed-dtype inputs and what to change, or
    None when the model's dummy forward runs under the autocast, or when no dummy batch of ours runs the model
    even without it (then there is nothing this check can say)."""
    with _evaluation_mode(model):
        for batch in dummy_batches(model):
            failure = _forward(model, batch, autocast)
            if failure is None:
                return None
            if _forward(model, batch, None) is None:  # fails only under the autocast: the lists are the cause
                return _message(*failure)
    logger.debug("Op-list dtype check skipped: no dummy batch runs %s.", type(model).__name__)
    return None


# ---- the dummy batches ------------------------------------------------------------------------------------------


def dummy_batches(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of one row for the model's main input, with token labels, one label per row, then none: the
    first the model takes decides. Built without the random generator, so training draws what it would."""
    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    if config is None or parameter is None:
        return
    device, dtype = parameter.device, parameter.dtype if parameter.is_floating_point() else torch.float32
    accepted = inspect.signature(model.forward).parameters
    name = getattr(model, "main_input_name", "input_ids")
    inputs = _main_input(name, config, device, dtype)
    if inputs is None or name not in accepted:
        return
    extra = {"use_cache": False} if "use_cache" in accepted else {}
    if "labels" in accepted:
        if inputs.dtype == torch.long:
            yield {name: inputs, "labels": inputs, **extra}  # causal LM, masked LM, seq2seq, token classification
        elif name == "input_values":
            yield {name: inputs, "labels": torch.ones(1, 2, dtype=torch.long, device=device), **extra}  # CTC
        yield {name: inputs, "labels": torch.zeros(1, dtype=torch.long, device=device), **extra}  # classification
    yield {name: inputs, **extra}


def _main_input(name: str, config: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if name == "input_ids" and getattr(text, "vocab_size", None):
        return (torch.arange(DUMMY_LENGTH, device=device) % text.vocab_size).unsqueeze(0)
    if name == "pixel_values" and getattr(config, "image_size", None):
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return torch.zeros(1, getattr(config, "num_channels", 3), height, width, device=device, dtype=dtype)
    if name == "input_values" and getattr(config, "conv_kernel", None):
        samples = 1
        for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride, strict=True))):
            samples = (samples - 1) * stride + kernel
        samples += (DUMMY_LENGTH - 1) * math.prod(config.conv_stride)  # DUMMY_LENGTH frames out of the encoder
        return torch.zeros(1, samples, device=device, dtype=dtype)
    return None


# ---- one forward ----------------------------------------------------------------------------------------------


class _FailingFunction(TorchFunctionMode):
    """Notes the innermost torch function an exception leaves: the op that refused its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.function: Any = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.function is None:
                self.function = func
            raise


def _forward(
    model: nn.Module, batch: dict[str, torch.Tensor], autocast: Callable[[], contextlib.AbstractContextManager] | None
) -> tuple[str, Exception] | None:
    """None when the model runs the batch; else the name of the torch function that failed, and the error."""
    watch = _FailingFunction()
    try:
        with torch.no_grad(), autocast() if autocast is not None else contextlib.nullcontext(), watch:
            model(**batch)
    except Exception as e:  # any failure: a bad dummy batch is told apart by the run without autocast
        return _function_name(watch.function), e
    return None


def _function_name(function: Any) -> str:
    name = getattr(function, "__name__", None) or "an op"
    return name.strip("_") if name.startswith("__") else name


@contextlib.contextmanager
def _evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off, no batch-norm statistics updated, no random draw: the check leaves training as it was."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


# ---- the line ---------------------------------------------------------------------------------------------------

_DTYPES = re.compile(r"\b(?:c10::)?(BFloat16|Half|Float|Double|float|bfloat16|half)\b")


def _message(op: str, error: Exception) -> str:
    detail = one_line(str(error))
    detail = detail if len(detail) <= 160 else detail[:157] + "..."
    dtypes = sorted({_canonical(d) for d in _DTYPES.findall(detail)})
    mixed = f" ({' and '.join(dtypes)})" if len(dtypes) > 1 else ""
    if op in KNOWN_OPS:
        default = " (it is in Habana's default bf16 list)" if op in HABANA_DEFAULT_BF16_OPS else ""
        fix = (
            f"add '{op}' to autocast_bf16_ops{default}, or remove autocast_bf16_ops and autocast_fp32_ops to use "
            "Habana's default lists"
        )
    else:
        fix = (
            "put the ops that produce its inputs in the same list (autocast_bf16_ops or autocast_fp32_ops), or "
            "remove both keys to use Habana's default lists"
        )
    return (
        f"The Gaudi config's autocast op lists give '{op}' inputs of mixed dtypes{mixed} on this model, which fails "
        f"at the first step ({detail}); in the Gaudi config, {fix}."
    )


def _canonical(name: str) -> str:
    return {"float": "float32", "Float": "float32", "Double": "float64", "Half": "float16", "half": "float16"}.get(
        name, name.lower()
    )
