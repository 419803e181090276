"""The Gaudi parts of one training step, around the parent Trainer's ``training_step``.

In the order a step meets them: the batch counted (throughput) and noted (new shapes compile), FSDP2 told to
sum where the device has no AVG, the parameters a training graph would zero found at step 1, the short batch
padded to the static shape, the compiled step's context, the sequence split; after the parent's step, lazy
mode's mark step, fast_ddp's all-reduce, and the unused parameters' gradients cleared.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn
from transformers.trainer_pt_utils import find_batch_size

from ..distributed.fsdp import reduce_with_sum
from ..features.static_batches import StaticRows
from ..features.unused_parameters import unused_parameters

logger = logging.getLogger(__name__)


def static_rows_of(trainer: Any) -> StaticRows | None:
    """Pad short batches only where the device compiles a graph per input shape."""
    args, device = trainer.args, trainer.gaudi_device
    if not device.static_shapes(args.use_lazy_mode):  # HPU Graphs need lazy mode on a Gaudi
        return None
    label_names = sorted({*trainer.label_names, "labels", "label", "label_ids"})
    return StaticRows(
        label_names, labels_into_forward=not args.use_hpu_graphs_for_training, rng_snapshot=device.rng_snapshot
    )


class TrainingStep:
    """One per trainer, built once the parent Trainer is (it reads the label names)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.static_rows = static_rows_of(trainer)
        self.unused: list[nn.Parameter] | None = None  # under training graphs that zero them: found at step 1
        self.summing: nn.Module | None = None  # the FSDP2 model last told to reduce with SUM (a device without AVG)
        self.gradient_divisor = 1  # what the loss's gradient is divided by where FSDP2 sums for AVG (torch < 2.8)
        self.eager_step: int | None = None  # --compile_from_sec_iteration: the step that runs eagerly

    def run(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any, parent: Any) -> torch.Tensor:
        """``parent(model, inputs, num_items_in_batch)`` (the parent Trainer's step) with the Gaudi parts around."""
        trainer = self.trainer
        rows = find_batch_size(inputs)
        trainer._throughput.count_batch(inputs, rows)
        trainer._supervision.note_inputs(inputs)  # before the forward: new shapes compile in it (or at its next sync)
        self._before(model, inputs)
        with contextlib.ExitStack() as stack:
            inputs = self._shaped(stack, model, inputs, rows, num_items_in_batch)
            if trainer._compile is not None:
                stack.enter_context(self._compiled(inputs))
            if trainer._sequence_parallel is not None:  # forward and backward (recomputation included) on a slice
                inputs = stack.enter_context(trainer._sequence_parallel.splitting(inputs))
            loss = parent(model, inputs, num_items_in_batch)
        if trainer._lazy_mark_step is not None:
            trainer._lazy_mark_step()  # after backward
        grad_allreduce = trainer._preparation.grad_allreduce  # fast_ddp's
        if grad_allreduce is not None and trainer.accelerator.gradient_state.sync_gradients:
            grad_allreduce()  # before clipping, which then sees the averaged gradients
        for parameter in self.unused or ():
            parameter.grad = None  # as eager training leaves it: no weight decay, no moments on an unused parameter
        trainer._supervision.note_loss(loss)
        return loss

    def _before(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        """FSDP2 summing where the device has no AVG; the parameters a training graph would zero, at step 1."""
        trainer = self.trainer
        if trainer.is_fsdp_enabled and not trainer.gaudi_device.collectives_average and self.summing is not model:
            # fully_shard ran in accelerator.prepare; the first reduce-scatter is ahead
            self.gradient_divisor = reduce_with_sum(model)
            self.summing = model
        if (
            self.unused is None
            and trainer.args.use_hpu_graphs_for_training
            and trainer.gaudi_device.training_graphs_zero_unused_grads
        ):
            self.unused = self._find_unused_parameters(model, inputs)

    def _shaped(
        self, stack: contextlib.ExitStack, model: nn.Module, inputs: dict[str, Any], rows: int | None, num_items: Any
    ) -> dict[str, Any]:
        """A short batch at the full batch's shapes, where the device compiles per shape: padded whole, or its
        rows masked inside ``stack`` (features/static_batches.py chooses)."""
        if self.static_rows is None or rows is None:
            return inputs
        trainer = self.trainer
        unwrapped, size = trainer.accelerator.unwrap_model(model), trainer._train_batch_size
        padded = self.static_rows.masked_batch(
            inputs, unwrapped, rows, size, lambda batch: self._loss_and_outputs(model, batch, num_items)
        )
        if padded is not None:
            return padded  # the whole step at the full batch's shapes
        stack.enter_context(self.static_rows.padding(model, unwrapped, rows, size))
        return inputs

    def _find_unused_parameters(self, model: nn.Module, inputs: dict[str, Any]) -> list[nn.Parameter]:
        """The trainable parameters one eager forward of this batch does not reach (features/unused_parameters.py);
        the generators and buffers (batch-norm statistics) are put back after it."""
        trainer = self.trainer
        inner = trainer.accelerator.unwrap_model(model)
        restore_rng, buffers = trainer.gaudi_device.rng_snapshot(), [(b, b.detach().clone()) for b in inner.buffers()]
        try:
            with trainer.autocast_smart_context_manager():
                outputs = type(inner).forward(inner, **trainer._prepare_inputs(inputs))  # the class's, not the graph's
            unused = unused_parameters(inner, outputs)
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
            restore_rng()
        if unused:
            logger.info(
                "%d trainable parameters the forward does not use get no gradient, as in eager training.", len(unused)
            )
        return unused

    def _loss_and_outputs(self, model: nn.Module, batch: dict[str, Any], num_items_in_batch: Any) -> tuple[Any, Any]:
        """The trainer's loss and outputs for a batch, as its training step computes them (static batches'
        check; the caller sets evaluation mode and no gradients)."""
        trainer = self.trainer
        batch = trainer._prepare_inputs(batch)
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, batch, return_outputs=True, num_items_in_batch=num_items_in_batch)

    def _compiled(self, inputs: dict[str, Any]) -> contextlib.ExitStack:
        """Eager on the first iteration with --compile_from_sec_iteration; graphs built counted and logged."""
        step = self.trainer.state.global_step
        if self.eager_step is None:
            self.eager_step = step
        stack = contextlib.ExitStack()
        stack.enter_context(self.trainer._compile.step_context(step == self.eager_step))
        stack.enter_context(self.trainer._compilation_log.watch(inputs, step))
        return stack
