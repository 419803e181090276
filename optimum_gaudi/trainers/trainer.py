"""GaudiTrainer: transformers.Trainer with Gaudi features, through the narrowest hooks Trainer offers.

It never asks which device it runs on: the device object from the arguments does the device-specific
part. With every Gaudi feature off it is transformers.Trainer, step for step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
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
    shard_where_accelerate_would_not,
    use_mixed_precision_policy,
    wrap_this_models_layers,
)
from ..distributed.layout import ParallelLayout
from ..distributed.sequence_parallel import SequenceParallel
from ..features import linear_cross_entropy as fused_loss
from ..features.adalora import AdaLoraBudget, adalora_configs
from ..features.compilation import CompilationLog, CompileOptions
from ..features.metrics import Throughput
from ..features.profiling import EvaluationProfiler, GaudiProfilerCallback
from ..precision.plan import PrecisionPlan
from ..preparation import ModelPreparation
from ..supervision.run import RunSupervision
from .checkpointing import Checkpointing
from .compat import TrainerShims, check_trainer_hooks
from .construction import gaudi_config_of, say_the_run, trainer_arguments
from .events import InternalCallbackHandler
from .internals import check_internals
from .optimization import DeviceClipping, fused_adamw_choice, keep_step_counts
from .plan_check import check_the_plan
from .step import TrainingStep
from .training_args import GaudiTrainingArguments, check_report_to

logger = logging.getLogger(__name__)


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
        trainer_args, args, gaudi_config = trainer_arguments(
            self, GaudiTrainerMixin, trainer_args, trainer_kwargs, gaudi_config
        )
        self._move_removed_keywords(args, trainer_kwargs)
        check_trainer_hooks(type(self), GaudiTrainerMixin)
        self.gaudi_config: GaudiConfig = gaudi_config_of(gaudi_config, args)
        check_internals(args, self.gaudi_config)  # other libraries' internals the features use (internals.py)
        self.gaudi_device = args.gaudi_device
        args.prepare_process()  # the run's process-wide settings, where it starts (not with the arguments)
        self._lazy_mark_step = self.gaudi_device.mark_step if args.use_lazy_mode else None
        self._pipelining_mark_step = self._lazy_mark_step if args.pipelining_fwd_bwd else None
        self._clipping = DeviceClipping(self.gaudi_device)  # use_fused_clip_norm's
        self.gaudi_device.set_dynamic_shapes(self.gaudi_config.use_dynamic_shapes)
        self._compile = CompileOptions.from_args(args)
        self._compilation_log = CompilationLog()
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
        self._throughput = Throughput(args.throughput_warmup_steps)

        super().__init__(*trainer_args, **trainer_kwargs)

        self._gaudi_step = TrainingStep(self)  # the step's Gaudi parts (trainers/step.py)
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
        say_the_run(self)

    def _move_removed_keywords(self, args: GaudiTrainingArguments, trainer_kwargs: dict[str, Any]) -> None:
        """Keywords the parent Trainer no longer takes, moved in place to where it reads them now (one line
        each) before it sees them. None here; the TRL trainers move TRL < 1's (trainers/trl_legacy.py)."""

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
        if self._layout.fast_ddp:
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
        return self._gaudi_step.run(model, inputs, num_items_in_batch, super().training_step)

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
        divisor = self._gaudi_step.gradient_divisor
        if divisor == 1 or not model.training:
            return found
        # FSDP2 summed the gradients for a device without AVG on a torch without its switch (distributed/fsdp.py)
        if return_outputs:
            return GradientDivisor.apply(found[0], divisor), found[1]
        return GradientDivisor.apply(found, divisor)

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        self._throughput.eval_begin()
        with (
            self._loop_context(),
            self._throughput.left_out(self.args.adjust_throughput and self.is_in_train),
            contextlib.ExitStack() as stack,
        ):
            if self._eval_profiler is not None:
                prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
                stack.enter_context(self._eval_profiler.loop(prefix))  # the trace is named like the metrics
            return super().evaluation_loop(*args, **kwargs)

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
        the other kind (trainers/optimization.py)."""
        made_here = self.optimizer is None
        fused = fused_adamw_choice(self, model)
        if fused is None:
            optimizer = super().create_optimizer(model)
        else:
            self.optimizer_cls_and_kwargs = fused
            try:
                optimizer = super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = None
        if made_here:
            keep_step_counts(self, optimizer)
        return optimizer

    def _clip_grad_norm(self, model: nn.Module):
        if not self.gaudi_config.use_fused_clip_norm or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            norm = super()._clip_grad_norm(model)
        else:
            self.accelerator.unscale_gradients()
            norm = self._clipping.clip(model, self.args.max_grad_norm)
        if callable(getattr(norm, "full_tensor", None)):  # a DTensor: FSDP2's norm on torch < 2.8 is left partial
            norm = norm.full_tensor()  # the whole model's, as logged elsewhere, not this rank's shards' (1/sqrt(2))
        self._supervision.note_grad_norm(norm)  # checked before the optimizer step (supervision/nonfinite.py)
        return norm

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
        with self._throughput.left_out(self.args.adjust_throughput and self.is_in_train):
            super().log(logs, start_time)


class GaudiTrainer(GaudiTrainerMixin, Trainer):
    """Trainer for Gaudi (HPU) that runs unchanged on CUDA and CPU: GaudiTrainerMixin + transformers.Trainer."""
