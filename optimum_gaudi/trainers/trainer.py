"""GaudiTrainer: transformers.Trainer with Gaudi features, through the narrowest hooks Trainer offers.

It never asks which device it runs on: the device object from the arguments does the device-specific
part. With every Gaudi feature off it is transformers.Trainer, step for step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import time
import weakref
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_pt_utils import find_batch_size
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import (
    FINITE_MARKER,
    BackgroundWrites,
    check_sharded_resume,
    check_weights_fit,
    first_nonfinite,
    remove_previous_checkpoints,
    resolve_resume,
    save_sharded_async,
    staged_checkpoint,
    tidy_before_resuming,
    warn_if_pickles_are_unsafe_here,
)
from ..configuration.gaudi_config import GaudiConfig
from ..distributed import full_weights
from ..distributed.fast_ddp import FastDDPModel, FusedGradientAllReduce, broadcast_parameters, unwrap_the_marker_too
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
from ..features import attention, kernels
from ..features import linear_cross_entropy as fused_loss
from ..features.adalora import AdaLoraBudget, adalora_configs
from ..features.adam_state import keep_step_counts_on_load
from ..features.compilation import CompilationLog, CompileOptions, compile_regions, pin_loss_function
from ..features.metrics import Throughput
from ..features.preparation import Seam, undo_attribute
from ..features.profiling import EvaluationProfiler, GaudiProfilerCallback
from ..features.static_batches import StaticRows
from ..features.table import feature_table
from ..features.unused_parameters import unused_parameters
from ..precision.plan import PrecisionPlan
from .checkpoint_size import check_room_for_a_checkpoint
from .compat import TrainerShims, check_trainer_hooks, nested_gather
from .events import InternalCallbackHandler
from .internals import check_internals
from .nonfinite import IGNORE, NonFiniteGuard
from .plan_check import check_the_plan
from .preemption import Preemption, exit_after_checkpoint
from .stragglers import Stragglers
from .training_args import GaudiTrainingArguments, GaudiTrainingArgumentsMixin, check_report_to
from .watch import ProgressWatch, watchdog_wanted

logger = logging.getLogger(__name__)

# Optimizer names for which use_fused_adam swaps in the device's fused AdamW (same update rule).
_ADAMW_OPTIMIZERS = {"adamw_torch", "adamw_torch_fused"}


# The run's totals so far (loss sum, throughput clock), saved beside the trainer state in every checkpoint, so a
# resumed run reports train_loss and throughput over the whole run, as the uninterrupted run would. They are
# not trainer state: seconds and a float sum would make a resumed run's state differ from the uninterrupted one's.
RUN_TOTALS_FILE = "gaudi_run_totals.json"
# Where older checkpoints keep them: an entry of TrainerState.stateful_callbacks (still read when resuming).
RUN_TOTALS_KEY = "GaudiRunTotals"


class _LoopHooks(TrainerCallback):
    """The trainer's own reactions to loop events; called by the handler, never listed among callbacks."""

    def __init__(self, trainer: GaudiTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if args.log_throughput_and_memory:
            self.trainer.gaudi_device.reset_peak_memory_stats()  # the run's peak memory, not the process's
        self.trainer._run_totals_begin()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._lazy_mark_step is not None:
            self.trainer._lazy_mark_step()  # flush the graph the optimizer step queued

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._background_writes.poll()  # --async_save: publish a checkpoint whose shards are written
        self.trainer._throughput.step_end(state.global_step)
        self.trainer._run_totals_snapshot(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.trainer._run_totals_snapshot(control)


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
        self._grad_allreduce: FusedGradientAllReduce | None = None
        self._lazy_mark_step = self.gaudi_device.mark_step if args.use_lazy_mode else None
        self._pipelining_mark_step = self._lazy_mark_step if args.pipelining_fwd_bwd else None
        self._said_no_eval_graphs = False
        self._grad_clipper: tuple[weakref.ref, float, Any] | None = None  # (the model, max_norm, clipper)
        self.gaudi_device.set_dynamic_shapes(self.gaudi_config.use_dynamic_shapes)
        self._compile = CompileOptions.from_args(args)
        self._compilation_log = CompilationLog()
        self._eager_step: int | None = None  # --compile_from_sec_iteration: the step that runs eagerly
        if self._compile is not None:
            self._compile.apply_limits()
        # the op-list autocast, fp8, FSDP's bf16 gathers, the fp8 scaling state in checkpoints (precision/plan.py)
        self._precision = PrecisionPlan.build(args, self.gaudi_config, self.gaudi_device, args.autocast_device)
        self._background_writes = BackgroundWrites()  # --async_save: shards still being written, then the publish
        # every degree of the run, the context parallelism chosen, the process groups (distributed/layout.py)
        self._layout: ParallelLayout = args.parallel_layout
        self._sequence_parallel: SequenceParallel | None = None  # this trainer's split (ours), once distributed
        self._predicting = False  # inside prediction_step, whose batches are not split
        self._guard: NonFiniteGuard | None = None  # during train(): non-finite steps stopped or skipped
        self._watch: ProgressWatch | None = None  # during a multi-process train(): the progress watchdog
        self._stragglers: Stragglers | None = None  # during a multi-process train(): each rank's step times

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

    def _use_device_ddp_defaults(self) -> None:
        """The device's DDP settings where the user gave none, set on accelerate's DDP handler before
        ``accelerator.prepare`` wraps the model (transformers 5 builds the handler with the accelerator, 4.57 in
        ``_wrap_model``)."""
        handler = getattr(self.accelerator, "ddp_handler", None)
        if handler is None or not self.gaudi_device.ddp_defaults:
            return
        for name, value in self.gaudi_device.ddp_defaults.items():
            if getattr(self.args, f"ddp_{name}", None) is None:
                setattr(handler, name, value)

    # ---- model preparation: the stages of features/preparation.py, in its order -------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """The model prepared in ``preparation.STAGES``' order, at every train, evaluate and predict (each stage
        does its work once per model). The stages change the model's ``forward`` and ``loss_function`` only
        through ``preparation.Seam``; ``preparation.undo(model)`` takes all of it back."""
        inner = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        attention.use(inner, self.args, self.gaudi_device)
        if self._sequence_parallel is not None:
            self._sequence_parallel.use(inner)
        self._prepare_kernels(inner)
        self._precision.convert(inner)  # --fp8: the device's fp8 layers and attention, a resumed scaling state
        if self._compile is not None:
            self._prepare_compile(inner)
        if training and self._fused_loss:
            self._prepare_fused_loss(inner)
        model = super()._wrap_model(model, training, dataloader)  # accelerate
        self._use_device_ddp_defaults()
        if not training:
            return self._with_inference_graphs(model)
        self._unwrap_inference_graph(model)
        model = self._with_training_graphs(model)
        if self._use_fast_ddp() and not isinstance(model, FastDDPModel):
            model = self._wrap_for_fast_ddp(model)
        return model

    def _prepare_kernels(self, model: nn.Module) -> None:
        """The device's fused RMSNorm and rotary kernels where the Gaudi config asks for them."""
        device, config = self.gaudi_device, self.gaudi_config
        kernels.use_device_kernels(
            model,
            rms_norm=device.rms_norm_kernel() if config.use_fused_rms_norm else None,
            rotary=device.rotary_kernel() if config.use_fused_rope else None,
        )

    def _prepare_compile(self, model: nn.Module) -> None:
        """Once per model: pin its loss function (no graph break) and, if asked, compile its blocks and loss."""
        if getattr(model, "_gaudi_compile_prepared", False):
            return
        model._gaudi_compile_prepared = True
        undo_attribute(model, "_gaudi_compile_prepared")
        pin_loss_function(model)
        if not self._compile.regional:
            return
        blocks = compile_regions(model, self._compile)
        if blocks is not None:
            logger.info("Regional compilation: the blocks of %s compiled once for all of them.", blocks)
            return
        logger.warning("--use_regional_compilation: no repeated blocks in the model; compiling it whole.")
        model.compile(**self._compile.compile_kwargs())
        undo_attribute(model, "_compiled_call_impl")

    def _prepare_fused_loss(self, model: nn.Module) -> fused_loss.FusedLinearCrossEntropy | None:
        """The fused loss's hooks on the model, once; their chunk step compiled with the model."""
        fused = fused_loss.FusedLinearCrossEntropy.of(model, strict=self.args.use_fused_linear_cross_entropy)
        if fused is not None and self._compile is not None and fused.compiled_chunk is None:
            fused.compile_with(self._compile.compile_kwargs())
        return fused

    def _with_training_graphs(self, model: nn.Module) -> nn.Module:
        """--use_hpu_graphs_for_training: the device's graph cache around the model's own forward, once per model,
        under whatever wraps it (a second train() is given an earlier one's DDP or fast_ddp wrapper: ModuleCacher
        refuses fast_ddp's forward(*args), and caches the model's own signature)."""
        if not self.args.use_hpu_graphs_for_training:
            return model
        inner = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        seam = Seam.of(inner, "forward")
        if "training_graphs" in seam:
            return model
        wrap = functools.partial(self.gaudi_device.wrap_for_training, inner, self.args.max_hpu_graphs)
        graphed = seam.adopt("training_graphs", wrap)  # the bridge writes the forward itself
        return graphed if inner is model else model

    def _with_inference_graphs(self, model: nn.Module) -> nn.Module:
        """--use_hpu_graphs_for_inference: the device's inference graphs around the forward, once per model, not
        while it trains."""
        if not self.args.use_hpu_graphs_for_inference or "inference_graphs" in Seam.of(model, "forward"):
            return model
        if self.is_in_train:
            # A graph wrapper replays in every mode, so wrapping the model being trained would make the next
            # training forwards replay an inference graph (static outputs, no gradient).
            if not self._said_no_eval_graphs:
                self._said_no_eval_graphs = True
                logger.warning(
                    "Evaluations during training run without HPU Graphs (a graph would also replay in the "
                    "training forwards); evaluate() and predict() after training use them."
                )
            return model
        wrap = functools.partial(
            self.gaudi_device.wrap_for_inference,
            model,
            self.args.disable_tensor_cache_hpu_graphs,
            max_graphs=self.args.max_hpu_graphs,
        )
        return Seam.of(model, "forward").adopt("inference_graphs", wrap)

    def _unwrap_inference_graph(self, model: nn.Module) -> None:
        """Training again after evaluate(): the inference graph taken off the forward. ``model`` may be the
        wrapper of an earlier train() (DDP), with the graphed model inside."""
        for candidate in (model, self.accelerator.unwrap_model(model, keep_torch_compile=False)):
            seam = Seam.find(candidate, "forward")
            if seam is not None:
                seam.remove("inference_graphs")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The weights as transformers loads them; the fp8 scaling state once the model's fp8 modules exist (they
        are made when the model is wrapped, usually after this)."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        unwrapped = self.accelerator.unwrap_model(model if model is not None else self.model)
        self._precision.resume_scaling_from(resume_from_checkpoint, unwrapped)

    def _use_fast_ddp(self) -> bool:
        return self._layout.fast_ddp

    def _wrap_for_fast_ddp(self, model: nn.Module) -> nn.Module:
        """Autocast and placement from accelerate, but no DDP: gradients go through one fused all-reduce."""
        model = self.accelerator.prepare_model(model, evaluation_mode=True)
        broadcast_parameters(model)
        self._grad_allreduce = FusedGradientAllReduce(list(model.parameters()), dtype=self.args.fast_ddp_torch_dtype)
        return FastDDPModel(model)

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
        timed = self._stragglers is not None and self.model.training
        if (self._pipelining_mark_step is None or not self.model.training) and not timed:
            return parent
        stack = contextlib.ExitStack()
        if timed:  # the forward's time, for the straggler figures (trainers/stragglers.py)
            began = time.monotonic()
            stack.callback(lambda: self._stragglers.forward_seconds(time.monotonic() - began))
        stack.enter_context(parent)
        if self._pipelining_mark_step is not None and self.model.training:
            stack.callback(self._pipelining_mark_step)  # when the forward pass is done, inside the parent's context
        return stack

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        rows = find_batch_size(inputs)
        self._throughput.count_batch(inputs, rows)
        if self._watch is not None:
            self._watch.note_inputs(inputs)  # before the forward: new shapes compile in it (or at its next sync)
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
        if self._grad_allreduce is not None and self.accelerator.gradient_state.sync_gradients:
            self._grad_allreduce()  # before clipping, which then sees the averaged gradients
        for parameter in self._unused or ():
            parameter.grad = None  # as eager training leaves it: no weight decay, no moments on an unused parameter
        if self._guard is not None:
            self._guard.note_loss(loss)
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
            fused = self._prepare_fused_loss(self.accelerator.unwrap_model(model, keep_torch_compile=False))
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
        if self._guard is not None:
            self._guard.note_grad_norm(norm)  # checked before the optimizer step (trainers/nonfinite.py)
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
        ``overwrite_output_dir`` and no resume, first deletes the checkpoints of the previous run."""
        checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        self._resumed_from = checkpoint
        if checkpoint is not None:
            check_weights_fit(self.model, checkpoint)
            check_sharded_resume(checkpoint, self.accelerator.state.fsdp_plugin if self.is_fsdp_enabled else None)
            warn_if_pickles_are_unsafe_here(checkpoint)
        elif self.args.overwrite_output_dir and self.args.should_save:
            remove_previous_checkpoints(self.args.output_dir)
        self.accelerator.wait_for_everyone()  # every rank has chosen its checkpoint before any is deleted
        if self.args.should_save:
            tidy_before_resuming(self.args.output_dir, self.args.save_total_limit, checkpoint)
        check_room_for_a_checkpoint(self)  # a disk too small for one checkpoint: one line before step 1
        check_the_plan(self)  # a run whose memory plan does not fit its card: one line before step 1 (--ignore_plan)
        preemption = Preemption()
        self._guard = NonFiniteGuard(self)
        several = self.args.world_size > 1 and torch.distributed.is_initialized()
        watched = several and watchdog_wanted(self.args)
        self._watch = ProgressWatch(self.gaudi_device, lambda: self.model_wrapped) if watched else None
        self._stragglers = Stragglers(self.args.straggler_threshold, self._layout.host_group) if several else None
        installed = [c for c in (preemption, self._guard, self._watch, self._stragglers) if c is not None]
        for callback in installed:  # in this order: the watchdog sees the save SIGTERM asks for
            self.add_callback(callback)
        try:
            with self._loop_context(), preemption.installed():
                self._precision.check_op_lists(self.model)  # op lists mixing dtypes in one op: one line, before step 1
                result = super().train(checkpoint, *args, **kwargs)
                self._background_writes.wait()  # --async_save: a run stopped early publishes its last checkpoint
        finally:
            if self._watch is not None:
                self._watch.stop()
            for callback in installed:
                self.remove_callback(callback)
            self._guard = self._watch = self._stragglers = None
        if preemption.stopped:
            self._end_preempted_run(preemption)
        return result

    def _end_preempted_run(self, preemption: Preemption) -> None:
        """After SIGTERM: the checkpoint of the last step is published; end the process (143) at once rather
        than go on with the script's evaluation and final save, which the grace period was not meant to cover."""
        where = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{preemption.stop_step}")
        self._background_writes.wait()
        self.accelerator.wait_for_everyone()
        if not os.path.isdir(where):  # --save_strategy best with an evaluation at that step kept only a better one
            started = time.monotonic()
            self._save_checkpoint(self.model_wrapped, trial=None)
            self._background_writes.wait()
            preemption.save_seconds = time.monotonic() - started
        if self.is_world_process_zero():
            logger.warning(
                "SIGTERM: %s written in %.1f s; exiting. Resume with --resume_from_checkpoint true.",
                where,
                preemption.save_seconds or 0.0,
            )
        exit_after_checkpoint(preemption.output)

    def _get_output_dir(self, trial: Any) -> str:
        return getattr(self, "_staging_root", None) or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Written into a staging directory and renamed into place: complete or absent whenever a process dies.
        With --async_save the shards are written in the background while training goes on; the checkpoint is
        published at the first step end that finds them written, the previous one before a new save starts,
        and the last step's before this returns (no training is left to overlap)."""
        run_dir = super()._get_output_dir(trial)
        writes = self._background_writes
        writes.wait()
        if self._weights_not_finite(model):
            return
        with (
            self._out_of_throughput(),
            self._watch.paused("a save") if self._watch is not None else contextlib.nullcontext(),
            staged_checkpoint(run_dir, self.state, self.args, self.accelerator.wait_for_everyone, writes) as staging,
        ):
            self._staging_root = str(staging)
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_root = None
            saved = staging / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            if saved.is_dir():  # with fp8: the scaling state, by every rank
                self._precision.save_scaling_state(self.accelerator.unwrap_model(model), str(saved))
            totals = getattr(self, "_run_totals", None)
            if self.args.should_save and totals is not None and saved.is_dir():
                (saved / RUN_TOTALS_FILE).write_text(json.dumps(totals, indent=1), encoding="utf-8")
            if self.args.should_save and saved.is_dir() and self.args.on_nonfinite != IGNORE:
                (saved / FINITE_MARKER).write_text('{"checked": true}', encoding="utf-8")  # checked above
        if self.state.global_step >= self.state.max_steps:
            writes.wait()

    def _weights_not_finite(self, model: nn.Module) -> bool:
        """A checkpoint whose weights hold a NaN or inf is not written: it would rotate out the last finite one, and
        resuming would train on from garbage. Every rank checks its own weights; where they are sharded (FSDP,
        DeepSpeed) the ranks agree (a save is collective, every rank is here); one line says which checkpoint was
        left out. ``--on_nonfinite ignore``: written unchecked, as transformers writes it."""
        if self.args.on_nonfinite == IGNORE:
            return False
        bad = first_nonfinite(self.accelerator.unwrap_model(model).named_parameters())
        flag = torch.tensor([0.0 if bad is None else 1.0])
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled  # else every rank holds the same weights
        if sharded and self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._layout.host_group())
        if not flag.item():
            return False
        if bad is not None or self.is_world_process_zero():
            logger.warning(
                "%s-%d not written: the weights hold a NaN or inf (%s); the checkpoints already written are kept.",
                PREFIX_CHECKPOINT_DIR,
                self.state.global_step,
                f"{bad}, rank {self.args.process_index}" if bad is not None else "on another rank",
            )
        return True

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """--async_save: FSDP's model and optimizer shards as accelerate writes them, in the background; the
        scheduler as transformers saves it."""
        if not (self.args.async_save and self.is_fsdp_enabled):
            return super()._save_optimizer_and_scheduler(output_dir)
        layout = self._layout
        groups = [layout.host_group("async_save_model"), layout.host_group("async_save_optimizer")]  # one a thread
        self._background_writes.add(save_sharded_async(self.model, self.optimizer, output_dir, groups))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

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
            if self._stragglers is not None:  # multi-process runs: a gather on every rank
                logs.update(self._stragglers.log_keys(self.is_world_process_zero()))
            if self._guard is not None:
                logs.update(self._guard.log_keys())
            self._run_totals_snapshot(self.control, logged=True)
        with self._out_of_throughput():
            super().log(logs, start_time)

    # ---- a resumed run reports the whole run ------------------------------------------------------------

    def _run_totals_begin(self) -> None:
        """At train begin (after the loop reset its counters): pick up the totals a resumed checkpoint holds."""
        self._run_totals = None
        carried = self.state.stateful_callbacks.pop(RUN_TOTALS_KEY, None) or {}  # an older checkpoint's
        resumed = getattr(self, "_resumed_from", None)
        if resumed is not None and os.path.isfile(os.path.join(resumed, RUN_TOTALS_FILE)):
            with open(os.path.join(resumed, RUN_TOTALS_FILE), encoding="utf-8") as f:
                carried = json.load(f)
        self._throughput.train_begin(self.state.global_step, carried.get("throughput"))
        self._run_first_step = carried.get("first_step", self.state.global_step)
        if carried:  # transformers' train_loss = _total_loss_scalar / (global_step - _initial_global_step)
            self._total_loss_scalar = carried["loss_sum"]
            self._initial_global_step = self._run_first_step

    def _load_callback_state(self) -> None:
        """--restore_callback_states_from_checkpoint: the totals an older checkpoint keeps among the callback states
        are no callback's state; keep them out of transformers' matching, which would warn that a checkpoint
        callback is missing."""
        carried = self.state.stateful_callbacks.pop(RUN_TOTALS_KEY, None)
        try:
            super()._load_callback_state()
        finally:
            if carried is not None:
                self.state.stateful_callbacks[RUN_TOTALS_KEY] = carried

    def _run_totals_snapshot(self, control, logged: bool = False) -> None:
        """Before a possible checkpoint: note the totals so far, which _save_checkpoint saves beside the state.

        Called at each step end and again from log(), which runs before the save of a logging step. The loss
        not yet logged lives in ``_tr_loss`` from transformers 5 on; older releases keep it in a local, so
        there the totals are exact when checkpoints fall on logging steps (as transformers' own resumed loss
        logs need too).
        """
        if not (control.should_save or control.should_evaluate):
            return
        tr_loss = getattr(self, "_tr_loss", None)
        if tr_loss is None and not logged:
            return
        pending = 0.0 if tr_loss is None else nested_gather(tr_loss, self.args.parallel_mode).mean().item()
        self._run_totals = {
            "first_step": self._run_first_step,
            "loss_sum": self._total_loss_scalar + pending,
            "throughput": self._throughput.totals(self.state.global_step),
        }

    # ---- saving -------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP2 the same files as without it, streamed (distributed/full_weights.py): transformers gathers
        the whole model on rank 0 first (FULL_STATE_DICT, which then dies on rank 0's lone collective over gloo)
        or saves no weights at all (SHARDED_STATE_DICT). Checkpoints come here too (``_save_checkpoint``); those
        of SHARDED_STATE_DICT keep only their sharded weights, as transformers writes them."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        streamed = self.is_fsdp_enabled and full_weights.is_sharded(model) and full_weights.saves(model)
        if not streamed or (_internal_call and "SHARDED" in str(self.accelerator.state.fsdp_plugin.state_dict_type)):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if full_weights.is_peft(model):  # its adapters, saved by peft as transformers saves them
            self._save(output_dir, state_dict=full_weights.adapter_state_dict(model))
        else:
            full_weights.save_pretrained(
                model,
                output_dir,
                is_main_process=self.args.should_save,
                host_group=self._layout.host_group(),
                state_filter=self._precision.without_scaling_state,
            )
            if self.args.should_save:
                self._save_beside_the_weights(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        state_dict = self._precision.weights_to_save(self.model, state_dict)  # with fp8: no scaling state
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            self.gaudi_config.save_pretrained(output_dir if output_dir is not None else self.args.output_dir)

    def _save_beside_the_weights(self, output_dir: str) -> None:
        """What ``_save`` writes besides the model: the tokenizer (or processor), the arguments, the Gaudi config."""
        from transformers.trainer import TRAINING_ARGS_NAME

        processor = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        self.gaudi_config.save_pretrained(output_dir)


class GaudiTrainer(GaudiTrainerMixin, Trainer):
    """Trainer for Gaudi (HPU) that runs unchanged on CUDA and CPU: GaudiTrainerMixin + transformers.Trainer."""
