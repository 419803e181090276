"""Static batch shapes for devices that compile a graph per input shape, with inert padding rows.

In lazy mode or under HPU Graphs every new input shape compiles a new graph, so an epoch's last, smaller
batch costs a compilation for one step. :class:`StaticRows` runs that batch at the full batch size, one of
two ways:

- **masked** (:meth:`StaticRows.masked_batch`), where the batch has labels: the batch is padded on the host,
  before it goes to the device, with copies of its last row whose labels are -100, the label transformers'
  losses skip. Forward, loss and backward then have the full batch's shapes: the step is the graph the full
  batches compiled. The loss's sum over real tokens and its count (``num_items_in_batch``) are the real rows'.
- **cut** (:meth:`StaticRows.padding`), otherwise: the forward sees the batch padded and every batch-first
  output is cut back to the real rows before any loss sees it (``compute_loss``, a label smoother, the model's
  ``loss_function`` given the real rows only). The loss and backward on the cut rows do not keep the full
  shape; in lazy mode they share the step's graph with the forward, so this saves no compilation there (it does
  under HPU Graphs, whose captured forward is replayed).

Padding rows must be inert, which is checked once, on the first short batch, in evaluation mode without
gradients (the random generators and each module's mode restored after): masked, the trainer's loss and the
real rows' outputs of the padded batch must equal those of the batch alone (a regression loss, which does
not skip -100, fails and falls back to cut); cut, the real rows' outputs must agree, which in-batch contrastive
logits, capacity-limited expert routing and batch statistics do not. Whenever padding cannot be shown inert
(those checks, a batch-norm layer, a loss or other batch-level reduction computed inside the forward by other
means, labels going into a model without a ``loss_function``) the batch runs unpadded, with one warning, and
so do all later short batches; an abandoned padded forward is rerun with the host's and the device's
generators restored.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..seam import Seam

logger = logging.getLogger(__name__)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor in nested dicts, ModelOutputs, lists and tuples; other objects kept."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        mapped = {key: _map_tensors(item, fn) for key, item in value.items()}
        try:
            return type(value)(**mapped)  # ModelOutput and plain dict subclasses
        except TypeError:
            return mapped
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def pad_rows(value: Any, rows: int, size: int) -> Any:
    """Every tensor whose first dimension is `rows` grown to `size` rows by repeating its last row."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.size(0) != rows:
            return t
        return torch.cat([t, t[-1:].expand(size - rows, *t.shape[1:])], dim=0)

    return _map_tensors(value, pad)


def cut_rows(value: Any, rows: int, size: int) -> Any:
    """Every tensor whose first dimension is `size` cut back to its first `rows` rows."""
    return _map_tensors(value, lambda t: t[:rows] if t.dim() > 0 and t.size(0) == size else t)


# The real rows' outputs padded and unpadded agree within these (a batch size of its own may change the matmul
# blocking, and so the last bits of a bf16 result). A difference beyond them gives up padding: at worst a
# padding that would have been inert is not used (one more graph compilation), never a changed loss.
ROW_RTOL, ROW_ATOL = 2e-2, 1e-5
LOSS_RTOL = 5e-3  # the same tokens' loss, masked or alone: only the real rows' logits may differ, in their last bits


class _NotInert(Exception):
    """The padded forward produced something computed over the padding rows."""


def _batch_coupled(model: nn.Module) -> bool:
    """Layers whose output for one row depends on the other rows (batch statistics)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class StaticRows:
    """Pads short batches to the full batch size inside the forward, keeping the padding out of every loss.

    `labels_into_forward` allows padding when labels go into the model (its ``loss_function`` then sees the
    real rows only); leave it off where forwards are replayed from captured graphs.
    """

    def __init__(
        self, label_names: list[str], labels_into_forward: bool, rng_snapshot: Callable[[], Callable[[], None]]
    ) -> None:
        self.label_names = label_names
        self.labels_into_forward = labels_into_forward
        self.rng_snapshot = rng_snapshot  # the device's: restores the generators a forward draws from
        self.enabled = True
        self.rows_checked = False
        self.masked: bool | None = None  # whether masked padding is inert: decided on the first short batch

    def _give_up(self, reason: str) -> None:
        if self.enabled:
            logger.warning(
                "Short last batches run unpadded (one extra graph compilation each): %s. "
                "--dataloader_drop_last keeps every batch the same shape.",
                reason,
            )
        self.enabled = False

    def masked_batch(
        self, inputs: Mapping, inner: nn.Module, rows: int, size: int, evaluate: Callable[[dict], tuple[Any, Any]]
    ) -> dict | None:
        """The short batch padded on the host to `size` rows, label -100 on the padding rows, where that is inert;
        None where it is not or cannot be (no labels in the batch: then :meth:`padding`). `evaluate(batch)` is
        the trainer's ``(loss, outputs)`` for a batch, used once to check."""
        labels = [name for name in self.label_names if isinstance(inputs.get(name), torch.Tensor)]
        if not self.enabled or rows >= size or not labels or self.masked is False:
            return None
        if _batch_coupled(inner):
            self._give_up("the model has batch-norm layers, whose padded rows would change the statistics")
            return None
        padded = _pad_labels(inputs, labels, rows, size)
        if self.masked is None:
            self.masked = self._masked_is_inert(inputs, padded, inner, rows, size, evaluate)
        return padded if self.masked else None

    def _masked_is_inert(
        self, inputs: Mapping, padded: dict, inner: nn.Module, rows: int, size: int, evaluate: Callable
    ) -> bool:
        restore_rng, modes = self.rng_snapshot(), [(m, m.training) for m in inner.modules()]
        try:
            inner.eval()
            with torch.no_grad():
                loss, outputs = evaluate(dict(inputs))
                padded_loss, padded_outputs = evaluate(dict(padded))
        except Exception as e:  # a compute_loss without return_outputs, ...: the cut padding is tried instead
            logger.debug("Masked padding not checked (%s); padding in the forward instead.", e)
            return False
        finally:
            for module, training in modes:
                module.training = training
            restore_rng()
        alone, cut = list(_tensors(outputs)), list(_tensors(cut_rows(padded_outputs, rows, size)))
        return (
            isinstance(loss, torch.Tensor)
            and isinstance(padded_loss, torch.Tensor)
            and torch.allclose(padded_loss.float(), loss.float(), rtol=LOSS_RTOL, atol=0)
            and len(alone) == len(cut)
            and all(a.shape == b.shape and _agree(a, b) for a, b in zip(cut, alone, strict=True))
        )

    @contextlib.contextmanager
    def padding(self, model: nn.Module, inner: nn.Module, rows: int, size: int) -> Iterator[None]:
        """While active, `model`'s forward pads `rows`-row inputs to `size` rows; `inner` is the unwrapped
        model. `size` is asked each step: --auto_find_batch_size may lower it."""
        if not self.enabled or rows >= size:
            yield
            return
        if _batch_coupled(inner):
            self._give_up("the model has batch-norm layers, whose padded rows would change the statistics")
            yield
            return
        seam = Seam.of(model, "forward")
        seam.put("static_batches", lambda run: lambda *a, **kw: self._forward(run, inner, rows, size, a, kw))
        try:
            yield
        finally:
            seam.remove("static_batches")

    def _forward(self, run: Callable, inner: nn.Module, rows: int, size: int, args: tuple, kwargs: dict) -> Any:
        if not self.enabled:
            return run(*args, **kwargs)
        labels_in = [name for name in self.label_names if kwargs.get(name) is not None]
        if labels_in and not (self.labels_into_forward and _has_loss_function(inner)):
            self._give_up(
                f"'{labels_in[0]}' goes into the model's forward, where padding rows could enter its loss"
                + ("" if self.labels_into_forward else " (captured graphs would replay a fixed row count)")
            )
            return run(*args, **kwargs)
        if not self.rows_checked:
            self.rows_checked = True
            problem = self._rows_interact(run, inner, rows, size, args, kwargs)
            if problem is not None:
                self._give_up(problem)
                return run(*args, **kwargs)
        restore_rng = self.rng_snapshot()  # so an unpadded rerun draws the same dropout masks
        try:
            with _real_rows_loss(inner, rows, size) as own_losses:
                outputs = run(*pad_rows(args, rows, size), **pad_rows(kwargs, rows, size))
                _check_inert(outputs, size, own_losses)
        except _NotInert as e:
            self._give_up(str(e))
            restore_rng()
            return run(*args, **kwargs)
        return cut_rows(outputs, rows, size)

    def _rows_interact(
        self, run: Callable, inner: nn.Module, rows: int, size: int, args: tuple, kwargs: dict
    ) -> str | None:
        """Why the padding rows would change the real rows' outputs, or None: the forward run padded and unpadded
        in evaluation mode without gradients (no dropout), the generators and each module's mode restored."""
        restore_rng, modes = self.rng_snapshot(), [(m, m.training) for m in inner.modules()]
        try:
            inner.eval()
            with torch.no_grad(), _real_rows_loss(inner, rows, size):
                padded = list(
                    _tensors(cut_rows(run(*pad_rows(args, rows, size), **pad_rows(kwargs, rows, size)), rows, size))
                )
                alone = list(_tensors(run(*args, **kwargs)))
        finally:
            for module, training in modes:
                module.training = training
            restore_rng()
        for a, b in zip(padded, alone, strict=False):
            if a.shape != b.shape or not _agree(a, b):
                return (
                    "the model's outputs for the real rows change when rows are added (rows that interact in the "
                    "forward, such as in-batch contrastive logits or capacity-limited expert routing, or a loss or "
                    "statistic over the whole batch)"
                )
        return None


def _agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not a.is_floating_point() or torch.allclose(a.float(), b.float(), rtol=ROW_RTOL, atol=ROW_ATOL)


IGNORE_INDEX = -100  # the label transformers' losses skip


def _pad_labels(inputs: Mapping, labels: list[str], rows: int, size: int) -> dict:
    """`inputs` padded to `size` rows (the last row repeated), the label tensors with rows of -100 instead."""
    padded = pad_rows({k: v for k, v in inputs.items() if k not in labels}, rows, size)
    for name in labels:
        label = inputs[name]
        filler = torch.full((size - rows, *label.shape[1:]), IGNORE_INDEX, dtype=label.dtype, device=label.device)
        padded[name] = torch.cat([label, filler], dim=0)
    return padded


def _has_loss_function(model: nn.Module) -> bool:
    prop = getattr(type(model), "loss_function", None)
    return isinstance(prop, property) and prop.fset is not None


@contextlib.contextmanager
def _real_rows_loss(model: nn.Module, rows: int, size: int) -> Iterator[list[torch.Tensor]]:
    """Make the model's own `loss_function` see only the real rows; yields the losses it returned."""
    if not _has_loss_function(model):
        yield []
        return
    returned: list[torch.Tensor] = []

    def real_rows_only(loss_function: Callable) -> Callable:
        def loss(*args: Any, **kwargs: Any) -> Any:
            returned.append(loss_function(*cut_rows(args, rows, size), **cut_rows(kwargs, rows, size)))
            return returned[-1]

        return loss

    seam = Seam.of(model, "loss_function")
    seam.put("static_batches", real_rows_only)
    try:
        yield returned
    finally:
        seam.remove("static_batches")


def _check_inert(outputs: Any, size: int, own_losses: list[torch.Tensor]) -> None:
    """Every output must be per-row (cut back afterwards) or a loss computed on the real rows only."""
    for t in _tensors(outputs):
        if any(t is loss for loss in own_losses):
            continue
        if t.dim() == 0 or t.size(0) != size:
            raise _NotInert(
                f"the model returned a {tuple(t.shape)} tensor that is not one row per sample "
                "(a loss or statistic computed over the padding rows too)"
            )
