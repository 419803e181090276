"""GaudiTrainer: transformers.Trainer with Gaudi features, through the narrowest hooks Trainer offers.

It never asks which device it runs on: the device object from the arguments does the device-specific
part. With every Gaudi feature off it is transformers.Trainer, step for step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
import weakref
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import find_batch_size

from ..configuration.gaudi_config import GaudiConfig
from ..distributed import full_weights
from ..distributed.fast_ddp import unwrap_the_marker_too
from ..distributed.fsdp import (
    GradientDivisor,
    check_fp8_under_fsdp,
    check_fsdp_arguments,
    check_sum_reductions,
    fsdp_of_this_run_only,
    reduce_with_sum,
    shard_where_accelerate_would_not,
    use_mixed_precision_policy,
    wrap_this_models_layers,
)
from ..distributed.layout import ParallelLayout
from ..distributed.sequence_parallel import SequenceParallel
from ..features import linear_cross_entropy as fused_loss
from ..features.adalora import AdaLoraBudget, adalora_configs
from ..features.adam_state import keep_step_counts_on_load
from ..features.compilation import CompilationLog, CompileOptions
from ..features.metrics import Throughput
from ..features.profiling import EvaluationProfiler, GaudiProfilerCallback
from ..features.static_batches import StaticRows
from ..features.table import feature_table
from ..features.unused_parameters import unused_parameters
from ..precision.plan import PrecisionPlan
from ..preparation import ModelPreparation
from ..supervision.run import RunSupervision
from .checkpointing import Checkpointing
from .compat import TrainerShims, check_trainer_hooks
from .events import InternalCallbackHandler
from .internals import check_internals
from .plan_check import check_the_plan
from .training_args import GaudiTrainingArguments, GaudiTrainingArgumentsMixin, check_report_to

logger = logging.getLogger(__name__)

# Optimizer names for which use_fused_adam swaps in the device's fused AdamW (same update rule).
_ADAMW_OPTIMIZERS = {"adamw_torch", "adamw_torch_fused"}


class _LoopHooks(TrainerCallback):
    """The trainer's own reactions to loop events; called by the handler, never listed among callbacks."""

    def __init__(self, trainer: GaudiTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if args.log_throughput_and_memory:
            self.trainer.gaudi_device.reset_peak_memory_stats()  # the run's peak memory, not the process's
        self.trainer._checkpointing.totals_begin()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._lazy_mark_step is not None:
            self.trainer._lazy_mark_step()  # flush the graph the optimizer step queued

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._checkpointing.writes.poll()  # --async_save: publish a checkpoint whose shards are written
        self.trainer._throughput.step_end(state.global_step)
        self.trainer._checkpointing.totals_snapshot(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.trainer._checkpointing.totals_snapshot(control)


@functools.cache
def _args_position(cls: type) -> int:
    """Where ``args`` sits among the positional parameters of the Trainer that ``cls`` builds on: TRL's
    DPOTrainer takes ``ref_model`` before it, GRPOTrainer ``reward_funcs``. A class whose ``__init__`` only
    passes ``*args, **kwargs`` through is skipped for the next one that names its parameters."""
    mro = cls.__mro__
    for klass in mro[mro.index(GaudiTrainerMixin) + 1 :]:
        if "__init__" not in vars(klass):
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]
        positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if "args" in positional:
            return positional.index("args")
    raise TypeError(f"{cls.__name__}: no Trainer after GaudiTrainerMixin takes an `args` parameter.")


def _habana_order(trainer_args: tuple, position: int, gaudi_config: Any) -> tuple[tuple, Any]:
    """optimum-habana's ``GaudiTrainer(model, gaudi_config, args, ...)``: a GaudiConfig (or None followed by
    training arguments) where the parent Trainer takes ``args`` is the ``gaudi_config``; the other positional
    arguments keep the parent's order. ``GaudiTrainer(model, args, ...)`` (transformers' order) is unchanged."""
    if len(trainer_args) <= position:
        return trainer_args, gaudi_config
    slot, following = trainer_args[position], trainer_args[position + 1 : position + 2]
    if not (
        isinstance(slot, GaudiConfig) or (slot is None and following and isinstance(following[0], TrainingArguments))
    ):
        return trainer_args, gaudi_config
    if gaudi_config is not None:
        raise TypeError("gaudi_config was given twice: by position (optimum-habana's order) and by keyword.")
    return (*trainer_args[:position], *trainer_args[position + 1 :]), slot


class GaudiTrainerMixin(TrainerShims):
    """The Gaudi features as narrow overrides of Trainer hooks; put it first to make any Trainer a Gaudi one.

    ``class MyGaudiTrainer(GaudiTrainerMixin, MyTrainer)`` keeps MyTrainer's signature and adds one keyword,
    ``gaudi_config`` (a GaudiConfig, or anything ``GaudiConfig.from_pretrained`` takes); by default it comes
    from ``args.gaudi_config_name``, else every Gaudi feature is off; optimum-habana's positional order,
    ``GaudiTrainer(model, gaudi_config, args, ...)``, works too. ``args`` must carry the Gaudi fields
    (an instance of GaudiTrainingArgumentsMixin); when it is left out, ``gaudi_args_class`` builds one.
    """

    gaudi_args_class: type = GaudiTrainingArguments

    def __init__(
        self,
        *trainer_args: Any,
        gaudi_config: GaudiConfig | dict[str, Any] | str | os.PathLike | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        position = _args_position(type(self))
        trainer_args, gaudi_config = _habana_order(trainer_args, position, gaudi_config)
        by_position = "args" not in trainer_kwargs and len(trainer_args) > position
        args = trainer_args[position] if by_position else trainer_kwargs.get("args")
        if args is None:
            args = self.gaudi_args_class(output_dir="trainer_output")
            if by_position:
                trainer_args = (*trainer_args[:position], args, *trainer_args[position + 1 :])
            else:
                trainer_kwargs["args"] = args
        if not isinstance(args, GaudiTrainingArgumentsMixin):
            raise TypeError(
                f"{type(self).__name__} needs GaudiTrainingArguments (or arguments built with "
                f"GaudiTrainingArgumentsMixin), got {type(args).__name__}; build {self.gaudi_args_class.__name__}(...) "
                "with the same keyword arguments."
            )
        self._move_removed_keywords(args, trainer_kwargs)
        check_trainer_hooks(type(self), GaudiTrainerMixin)
        if isinstance(gaudi_config, dict):
            gaudi_config = GaudiConfig.from_dict(gaudi_config)
        elif gaudi_config is not None and not isinstance(gaudi_config, GaudiConfig):
            gaudi_config = GaudiConfig.from_pretrained(gaudi_config)
        self.gaudi_config: GaudiConfig = gaudi_config or args.gaudi_config or GaudiConfig()
        check_internals(args, self.gaudi_config)  # other libraries' internals the features use (internals.py)
        self.gaudi_device = args.gaudi_device
        self._lazy_mark_step = self.gaudi_device.mark_step if args.use_lazy_mode else None
        self._pipelining_mark_step = self._lazy_mark_step if args.pipelining_fwd_bwd else None
        self._grad_clipper: tuple[weakref.ref, float, Any] | None = None  # (the model, max_norm, clipper)
        self.gaudi_device.set_dynamic_shapes(self.gaudi_config.use_dynamic_shapes)
        self._compile = CompileOptions.from_args(args)
        self._compilation_log = CompilationLog()
        self._eager_step: int | None = None  # --compile_from_sec_iteration: the step that runs eagerly
        if self._compile is not None:
            self._compile.apply_limits()
        # the op-list autocast, fp8, FSDP's bf16 gathers, the fp8 scaling state in checkpoints (precision/plan.py)
        self._precision = PrecisionPlan.build(args, self.gaudi_config, self.gaudi_device, args.autocast_device)
        # every degree of the run, the context parallelism chosen, the process groups (distributed/layout.py)
        self._layout: ParallelLayout = args.parallel_layout
        self._sequence_parallel: SequenceParallel | None = None  # this trainer's split (ours), once distributed
        self._predicting = False  # inside prediction_step, whose batches are not split
        self._supervision = RunSupervision()  # during train(): preemption, non-finite steps, stalls, stragglers
        self._checkpointing = Checkpointing(self, self._precision, self._layout)
        self._preparation = ModelPreparation(self, super()._wrap_model)  # the model's stages, in order

        super().__init__(*trainer_args, **trainer_kwargs)

        self._static_rows = self._select_static_rows(args)
        self._unused: list[nn.Parameter] | None = None  # under training graphs that zero them: found at step 1
        self._summing: nn.Module | None = None  # the FSDP2 model last told to reduce with SUM (a device without AVG)
        self._gradient_divisor = 1  # what the loss's gradient is divided by where FSDP2 sums for AVG (torch < 2.8)
        self._throughput = Throughput(args.throughput_warmup_steps)
        self.callback_handler = InternalCallbackHandler.adopt(self.callback_handler, [_LoopHooks(self)])
        profiler = GaudiProfilerCallback.from_training_args(args)
        if profiler is not None:
            self.add_callback(profiler)
        if adalora_configs(self.model):  # as optimum-habana's trainer: AdaLoRA's ranks adapt during training
            self.add_callback(AdaLoraBudget())
        self._eval_profiler = EvaluationProfiler.from_training_args(args)
        self._fused_loss = fused_loss.applies(self, GaudiTrainerMixin)
        if self._sequence_parallel is not None:
            self._sequence_parallel.check_loss(self.compute_loss_func)
        self._timing_out_of_throughput = False
        if self.is_world_process_zero():
            table = feature_table(self.gaudi_device, args, self.gaudi_config)
            flags = ", ".join(f"{k}={v}" for k, v in args.gaudi_flags().items())
            logger.warning("Gaudi features on this run:\n%s\nGaudi arguments: %s", table, flags)
            logger.warning("Parallel layout: %s", self._layout.describe())
            logger.warning("Precision: %s", self._precision.describe())
            if self.is_deepspeed_enabled:
                self._say_what_deepspeed_replaces()

    def _say_what_deepspeed_replaces(self) -> None:
        """DeepSpeed clips the gradients itself ("gradient_clipping"), and builds the optimizer its config names;
        the trainer's optimizer (the fused AdamW included) is used, partitioned, only when the config names none."""
        replaced = []
        if self.gaudi_config.use_fused_clip_norm:
            replaced.append('use_fused_clip_norm (DeepSpeed clips by its "gradient_clipping")')
        if self.gaudi_config.use_fused_adam and "optimizer" in self.accelerator.state.deepspeed_plugin.deepspeed_config:
            replaced.append("use_fused_adam (the DeepSpeed config names its own optimizer)")
        if replaced:
            logger.warning("DeepSpeed replaces these Gaudi features on this run: %s.", "; ".join(replaced))

    def _move_removed_keywords(self, args: GaudiTrainingArguments, trainer_kwargs: dict[str, Any]) -> None:
        """Keywords the parent Trainer no longer takes, moved in place to where it reads them now (one line
        each) before it sees them. None here; the TRL trainers move TRL < 1's (trainers/trl_legacy.py)."""

    def _select_static_rows(self, args: GaudiTrainingArguments) -> StaticRows | None:
        """Pad short batches only where the device compiles a graph per input shape."""
        if not self.gaudi_device.static_shapes(args.use_lazy_mode):  # HPU Graphs need lazy mode on a Gaudi
            return None
        label_names = sorted({*self.label_names, "labels", "label", "label_ids"})
        return StaticRows(
            label_names,
            labels_into_forward=not args.use_hpu_graphs_for_training,
            rng_snapshot=self.gaudi_device.rng_snapshot,
        )

    def create_accelerator_and_postprocess(self) -> None:
        check_report_to(self.args)  # where transformers fails for it, early in Trainer.__init__ (every release)
        with fsdp_of_this_run_only(self.args):  # not an earlier trainer's of this process
            super().create_accelerator_and_postprocess()
        if shard_where_accelerate_would_not(self.accelerator, self.args):  # --fsdp on CPU processes: FSDP, not DDP
            self.is_fsdp_enabled = True
            check_fsdp_arguments(self.accelerator, self.args)
        if self.is_fsdp_enabled:
            check_fp8_under_fsdp(self._precision.fp8)
            check_sum_reductions(self.gaudi_device)
            full_weights.check_saves(self.model)  # now, not after the run, at its final save_model
            wrap_this_models_layers(self.accelerator.state.fsdp_plugin, self.model)
            use_mixed_precision_policy(
                self.accelerator.state.fsdp_plugin, self._precision.fsdp_mixed_precision_policy()
            )
        self._sequence_parallel = self._layout.sequence_parallel()  # None unless the split is ours
        if self._use_fast_ddp():
            unwrap_the_marker_too(self.accelerator)

    def get_cp_size(self) -> int:
        """The ranks that share a training batch (transformers divides the data-parallel world and the token count
        by it); 1 in prediction_step, where each rank evaluates its own batches whole."""
        if self._sequence_parallel is None:
            return super().get_cp_size()
        return 1 if self._predicting else self._sequence_parallel.size

    def get_train_dataloader(self) -> Any:
        dataloader = super().get_train_dataloader()
        if self._sequence_parallel is not None:
            self._sequence_parallel.share_batches(dataloader)
        return dataloader

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        if self._precision.accelerate_mixed_precision is not None:  # our autocast replaces accelerate's fixed lists
            accelerator_args["mixed_precision"] = self._precision.accelerate_mixed_precision
        if self._compile is not None:
            accelerator_args["dynamo_plugin"] = self._compile.dynamo_plugin()
        return accelerator_args

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """The model prepared by the stages of ``preparation.STAGES``, in their order, at every train, evaluate
        and predict (each stage does its work once per model)."""
        return self._preparation.run(model, training, dataloader)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._checkpointing.load_fp8_scaling(resume_from_checkpoint, model)

    def _use_fast_ddp(self) -> bool:
        return self._layout.fast_ddp

    # ---- step hooks ---------------------------------------------------------------------------------

    def _loop_context(self) -> contextlib.ExitStack:
        """Around a whole training or evaluation loop: the op-list autocast's kernels installed once, not at
        every forward, and the device's memory kept from one step to the next."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._precision.loop_context())
        sharded = self.is_fsdp_enabled or self._sequence_parallel is not None
        stack.enter_context(self.gaudi_device.loop_memory(sharded))
        return stack

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        accelerate_autocast = functools.partial(super().autocast_smart_context_manager, cache_enabled)
        return self._precision.forward_context(self.model.training, accelerate_autocast)

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager:
        parent = super().compute_loss_context_manager()  # any context manager a user's Trainer returns
        timed = self._supervision.stragglers is not None
        if not self.model.training or (self._pipelining_mark_step is None and not timed):
            return parent
        stack = contextlib.ExitStack()
        self._supervision.time_forward(stack)  # the forward's time, for the straggler figures
        stack.enter_context(parent)
        if self._pipelining_mark_step is not None:
            stack.callback(self._pipelining_mark_step)  # when the forward pass is done, inside the parent's context
        return stack

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        rows = find_batch_size(inputs)
        self._throughput.count_batch(inputs, rows)
        self._supervision.note_inputs(inputs)  # before the forward: new shapes compile in it (or at its next sync)
        if self.is_fsdp_enabled and not self.gaudi_device.collectives_average and self._summing is not model:
            # fully_shard ran in accelerator.prepare; the first reduce-scatter is ahead
            self._gradient_divisor = reduce_with_sum(model)
            self._summing = model
        if (
            self._unused is None
            and self.args.use_hpu_graphs_for_training
            and self.gaudi_device.training_graphs_zero_unused_grads
        ):
            self._unused = self._find_unused_parameters(model, inputs)
        with contextlib.ExitStack() as stack:
            if self._static_rows is not None and rows is not None:
                unwrapped, size = self.accelerator.unwrap_model(model), self._train_batch_size
                padded = self._static_rows.masked_batch(
                    inputs,
                    unwrapped,
                    rows,
                    size,
                    lambda batch: self._loss_and_outputs(model, batch, num_items_in_batch),
                )
                if padded is not None:
                    inputs = padded  # the whole step at the full batch's shapes
                else:
                    stack.enter_context(self._static_rows.padding(model, unwrapped, rows, size))
            if self._compile is not None:
                stack.enter_context(self._compiled_step(inputs))
            if self._sequence_parallel is not None:  # forward and backward (recomputation included) on a slice
                inputs = stack.enter_context(self._sequence_parallel.splitting(inputs))
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self._lazy_mark_step is not None:
            self._lazy_mark_step()  # after backward
        grad_allreduce = self._preparation.grad_allreduce  # fast_ddp's
        if grad_allreduce is not None and self.accelerator.gradient_state.sync_gradients:
            grad_allreduce()  # before clipping, which then sees the averaged gradients
        for parameter in self._unused or ():
            parameter.grad = None  # as eager training leaves it: no weight decay, no moments on an unused parameter
        self._supervision.note_loss(loss)
        return loss

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ):
        """--use_fused_linear_cross_entropy: a training step's loss from the hidden states, without the logits
        (features/linear_cross_entropy.py); evaluation computes the model's own logits and loss. Under FSDP2 summing
        for a device without AVG on torch < 2.8, the training loss's gradient is divided by the world size."""
        if not (self._fused_loss and model.training and "labels" in inputs):
            found = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        else:
            fused = self._preparation.fused_loss_of(self.accelerator.unwrap_model(model, keep_torch_compile=False))
            with fused.step() if fused is not None else contextlib.nullcontext():
                found = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._gradient_divisor == 1 or not model.training:
            return found
        # FSDP2 summed the gradients for a device without AVG on a torch without its switch (distributed/fsdp.py)
        if return_outputs:
            return GradientDivisor.apply(found[0], self._gradient_divisor), found[1]
        return GradientDivisor.apply(found, self._gradient_divisor)

    def _find_unused_parameters(self, model: nn.Module, inputs: dict[str, Any]) -> list[nn.Parameter]:
        """The trainable parameters one eager forward of this batch does not reach (features/unused_parameters.py);
        the generators and buffers (batch-norm statistics) are put back after it."""
        inner = self.accelerator.unwrap_model(model)
        restore_rng, buffers = self.gaudi_device.rng_snapshot(), [(b, b.detach().clone()) for b in inner.buffers()]
        try:
            with self.autocast_smart_context_manager():
                outputs = type(inner).forward(inner, **self._prepare_inputs(inputs))  # the class's, not the graph's
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
        """This trainer's loss and outputs for a batch, as its training step computes them (static batches'
        check; the caller sets evaluation mode and no gradients)."""
        batch = self._prepare_inputs(batch)
        with self.compute_loss_context_manager():
            return self.compute_loss(model, batch, return_outputs=True, num_items_in_batch=num_items_in_batch)

    def _compiled_step(self, inputs: dict[str, Any]) -> contextlib.ExitStack:
        """Eager on the first iteration with --compile_from_sec_iteration; graphs built counted and logged."""
        if self._eager_step is None:
            self._eager_step = self.state.global_step
        stack = contextlib.ExitStack()
        stack.enter_context(self._compile.step_context(self.state.global_step == self._eager_step))
        stack.enter_context(self._compilation_log.watch(inputs, self.state.global_step))
        return stack

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        self._throughput.eval_begin()
        with self._loop_context(), self._out_of_throughput(), contextlib.ExitStack() as stack:
            if self._eval_profiler is not None:
                prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
                stack.enter_context(self._eval_profiler.loop(prefix))  # the trace is named like the metrics
            return super().evaluation_loop(*args, **kwargs)

    @contextlib.contextmanager
    def _out_of_throughput(self):
        """--adjust_throughput: time spent here during training is left out of the throughput."""
        if not (self.args.adjust_throughput and self.is_in_train) or self._timing_out_of_throughput:
            yield
            return
        self._timing_out_of_throughput, start = True, time.perf_counter()
        try:
            yield
        finally:
            self._timing_out_of_throughput = False
            self._throughput.exclude(time.perf_counter() - start)

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None, **kwargs: Any
    ):
        with contextlib.ExitStack() as stack:
            if self._compile is not None:
                stack.enter_context(self._compile.compiler_context())
                stack.enter_context(self._compilation_log.watch(inputs, self.state.global_step))
            stack.callback(setattr, self, "_predicting", False)
            self._predicting = True
            outputs = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        if self._lazy_mark_step is not None:
            self._lazy_mark_step()  # run the queued evaluation graph before the next batch
        self._throughput.eval_batch(find_batch_size(inputs) or 0)
        if self._eval_profiler is not None:
            self._eval_profiler.batch_end()
        return outputs

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """With ``use_fused_adam``, the device's fused AdamW; any AdamW made here resumes from a checkpoint of
        the other kind (features/adam_state.py)."""
        made_here = self.optimizer is None
        optimizer = self._create_optimizer(model)
        if made_here:
            fused_cls, _ = self.gaudi_device.fused_adamw() if self.gaudi_config.use_fused_adam else (None, None)
            if fused_cls is not None and isinstance(optimizer, fused_cls):
                keep_step_counts_on_load(optimizer, self.gaudi_device.fused_adamw_counts_steps_per_group)
            elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                keep_step_counts_on_load(optimizer, counts_per_group=False)
        return optimizer

    def _create_optimizer(self, model: nn.Module | None) -> torch.optim.Optimizer:
        if (
            self.optimizer is not None
            or self.optimizer_cls_and_kwargs is not None
            or not self.gaudi_config.use_fused_adam
        ):
            return super().create_optimizer(model)
        if self.args.optim not in _ADAMW_OPTIMIZERS:
            logger.warning("use_fused_adam is ignored because --optim %s is not AdamW.", self.args.optim)
            return super().create_optimizer(model)
        if self.is_fsdp_enabled and not self.gaudi_device.fused_adamw_takes_dtensors:
            logger.warning(
                "use_fused_adam: the device's fused AdamW does not take FSDP's sharded (DTensor) parameters; "
                "torch's AdamW (--optim %s) updates the shards.",
                self.args.optim,
            )
            return super().create_optimizer(model)
        _, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model or self.model)
        kwargs.pop("fused", None)
        fused_cls, fused_kwargs = self.gaudi_device.fused_adamw()
        self.optimizer_cls_and_kwargs = (fused_cls, {**kwargs, **fused_kwargs})
        try:
            return super().create_optimizer(model)
        finally:
            self.optimizer_cls_and_kwargs = None

    def _clip_grad_norm(self, model: nn.Module):
        norm = self._clip_with_the_device(model)
        if callable(getattr(norm, "full_tensor", None)):  # a DTensor: FSDP2's norm on torch < 2.8 is left partial
            norm = norm.full_tensor()  # the whole model's, as logged elsewhere, not this rank's shards' (1/sqrt(2))
        self._supervision.note_grad_norm(norm)  # checked before the optimizer step (supervision/nonfinite.py)
        return norm

    def _clip_with_the_device(self, model: nn.Module):
        if not self.gaudi_config.use_fused_clip_norm or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        max_norm = self.args.max_grad_norm
        cached = self._grad_clipper
        if cached is None or cached[0]() is not model or cached[1] != max_norm:
            # a weak reference, not id(): a new model (model_init, hyperparameter search) may reuse a freed id
            cached = (weakref.ref(model), max_norm, self.gaudi_device.grad_clipper(model.parameters(), max_norm))
            self._grad_clipper = cached
        return cached[2]()

    # ---- checkpoints --------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """Resumes only from a complete checkpoint that fits the model (``True``: the newest complete one); with
        ``overwrite_output_dir`` and no resume, first deletes the checkpoints of the previous run. Supervised
        (supervision/run.py) from start to end."""
        checkpoint = self._checkpointing.before_training(resume_from_checkpoint)
        check_the_plan(self)  # a run whose memory plan does not fit its card: one line before step 1 (--ignore_plan)
        with self._supervision.installed(self) as preemption:
            with self._loop_context(), preemption.installed():
                self._precision.check_op_lists(self.model)  # op lists mixing dtypes in one op: one line, before step 1
                result = super().train(checkpoint, *args, **kwargs)
                self._checkpointing.after_training()
        if preemption.stopped:
            self._checkpointing.save_before_exit(preemption)
        return result

    # ---- checkpoints: the hooks hand their parent's implementation to Checkpointing ---------------------

    def _get_output_dir(self, trial: Any) -> str:
        return self._checkpointing.output_dir(trial, super()._get_output_dir)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._checkpointing.save(model, trial, super()._save_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._checkpointing.save_optimizer_and_scheduler(output_dir, super()._save_optimizer_and_scheduler)

    def _load_callback_state(self) -> None:
        self._checkpointing.load_callback_state(super()._load_callback_state)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._checkpointing.save_model(output_dir, _internal_call, super().save_model)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        self._checkpointing.save_weights(output_dir, state_dict, super()._save)

    # ---- logging ------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        world = self.args.world_size
        data_world = self._layout.data_parallel_size  # the ranks splitting a sequence train (and count) one batch
        eval_prefixes = [k.removesuffix("_runtime") for k in logs if k.endswith("_runtime") and k != "train_runtime"]
        measured = self.args.log_throughput_and_memory  # off: transformers' keys only (a true subclass)
        if "train_runtime" in logs:
            if measured:
                self._throughput.rewrite(logs, self.state.global_step, data_world)
        elif eval_prefixes:
            if measured:
                self._throughput.rewrite_eval(logs, eval_prefixes[0], world)
        elif "loss" in logs:
            if measured:
                logs.update(self._throughput.interval(self.state.global_step, data_world))
                # each rank's own figures in its own log history (rank 0's are printed): under FSDP or DeepSpeed
                # the ranks hold different shares, and the largest is the one that runs out
                logs.update(self.gaudi_device.memory_stats())
            logs.update(self._supervision.log_keys(self.is_world_process_zero()))  # a gather where several ranks
            self._checkpointing.totals_snapshot(self.control, logged=True)
        with self._out_of_throughput():
            super().log(logs, start_time)


class GaudiTrainer(GaudiTrainerMixin, Trainer):
    """Trainer for Gaudi (HPU) that runs unchanged on CUDA and CPU: GaudiTrainerMixin + transformers.Trainer."""
