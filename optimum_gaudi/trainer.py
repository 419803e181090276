"""GaudiTrainer: transformers.Trainer with Gaudi features, through the narrowest hooks Trainer offers.

It never asks which device it runs on: the device object from the arguments does the device-specific
part. With every Gaudi feature off it is transformers.Trainer, step for step.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import find_batch_size

from .batching import StaticBatchCollator
from .compat import check_trainer_hooks
from .configuration import GaudiConfig
from .distributed.fast_ddp import FastDDPModel, FusedGradientAllReduce, broadcast_parameters
from .features import feature_table
from .metrics import ThroughputCallback
from .profiling import GaudiProfilerCallback
from .training_args import GaudiTrainingArguments, GaudiTrainingArgumentsMixin

logger = logging.getLogger(__name__)

# Optimizer names for which use_fused_adam swaps in the device's fused AdamW (same update rule).
_ADAMW_OPTIMIZERS = {"adamw_torch", "adamw_torch_fused"}


class _MarkStepAfterOptimizer(TrainerCallback):
    """Lazy mode: flush the graph the optimizer step queued, before the next forward starts."""

    def __init__(self, mark_step) -> None:
        self.mark_step = mark_step

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.mark_step()


def _bind_trainer_args(parent_init, cls: type, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Binds the call to the parent Trainer's own signature, so that ``args`` is found by name or position
    whatever comes before it (TRL's DPOTrainer takes ``ref_model`` first, GRPOTrainer ``reward_funcs``)."""
    signature = inspect.signature(parent_init)
    if "args" not in signature.parameters:
        raise TypeError(f"{cls.__name__}: the Trainer after GaudiTrainerMixin takes no `args` parameter.")
    return signature.bind(*args, **kwargs)


class GaudiTrainerMixin:
    """The Gaudi features as narrow overrides of Trainer hooks; put it first to make any Trainer a Gaudi one.

    ``class MyGaudiTrainer(GaudiTrainerMixin, MyTrainer)`` keeps MyTrainer's signature and adds one keyword,
    ``gaudi_config`` (a GaudiConfig, or anything ``GaudiConfig.from_pretrained`` takes); by default it comes
    from ``args.gaudi_config_name``, else every Gaudi feature is off. ``args`` must carry the Gaudi fields
    (an instance of GaudiTrainingArgumentsMixin); when it is left out, ``gaudi_args_class`` builds one.
    """

    gaudi_args_class: type = GaudiTrainingArguments

    def __init__(
        self, *trainer_args: Any, gaudi_config: GaudiConfig | str | os.PathLike | None = None, **trainer_kwargs: Any
    ) -> None:
        bound = _bind_trainer_args(super().__init__, type(self), trainer_args, trainer_kwargs)
        args = bound.arguments.get("args")
        if args is None:
            args = bound.arguments["args"] = self.gaudi_args_class(output_dir="trainer_output")
        if not isinstance(args, GaudiTrainingArgumentsMixin):
            raise TypeError(
                f"{type(self).__name__} needs GaudiTrainingArguments (or arguments built with "
                f"GaudiTrainingArgumentsMixin), got {type(args).__name__}; build {self.gaudi_args_class.__name__}(...) "
                "with the same keyword arguments."
            )
        check_trainer_hooks(type(self))
        if gaudi_config is not None and not isinstance(gaudi_config, GaudiConfig):
            gaudi_config = GaudiConfig.from_pretrained(gaudi_config)
        self.gaudi_config: GaudiConfig = gaudi_config or args.gaudi_config or GaudiConfig()
        self.gaudi_device = args.gaudi_device
        self._grad_allreduce: FusedGradientAllReduce | None = None
        self._lazy_mark_step = self.gaudi_device.mark_step if args.use_lazy_mode else None
        self._pipelining_mark_step = self._lazy_mark_step if args.pipelining_fwd_bwd else None
        self._autocast = self._select_autocast(args)
        self._graph_wrapped: set[tuple[bool, int]] = set()

        super().__init__(*bound.args, **bound.kwargs)

        self._throughput = ThroughputCallback(args.throughput_warmup_steps)
        self.add_callback(self._throughput)
        profiler = GaudiProfilerCallback.from_training_args(args)
        if profiler is not None:
            self.add_callback(profiler)
        if self._lazy_mark_step is not None:
            self.add_callback(_MarkStepAfterOptimizer(self._lazy_mark_step))
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

    def _select_autocast(self, args: GaudiTrainingArgumentsMixin):
        """bf16 autocast from the Gaudi config's op lists, or from `use_torch_autocast` alone.

        Plain ``--bf16`` without op lists is left to accelerate, exactly as transformers.Trainer does it.
        """
        config = self.gaudi_config
        has_lists = bool(config.autocast_bf16_ops or config.autocast_fp32_ops)
        if not (config.use_torch_autocast or args.bf16) or (args.bf16 and not has_lists):
            return None
        return args.autocast_device.autocast_factory(config.autocast_bf16_ops, config.autocast_fp32_ops)

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        if self._autocast is not None:
            accelerator_args["mixed_precision"] = "no"  # our autocast replaces accelerate's fixed op lists
        return accelerator_args

    # ---- graphs -------------------------------------------------------------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        model = super()._wrap_model(model, training, dataloader)
        if training and self._use_fast_ddp() and not isinstance(model, FastDDPModel):
            model = self._wrap_for_fast_ddp(model)
        # The device wrappers patch the module in place; wrap each module once across train/evaluate calls.
        graphs = self.args.use_hpu_graphs_for_training if training else self.args.use_hpu_graphs_for_inference
        if graphs and (training, id(model)) not in self._graph_wrapped:
            self._graph_wrapped.add((training, id(model)))
            if training:
                model = self.gaudi_device.wrap_for_training(model, self.args.max_hpu_graphs)
            else:
                model = self.gaudi_device.wrap_for_inference(model, self.args.disable_tensor_cache_hpu_graphs)
        return model

    def _use_fast_ddp(self) -> bool:
        return self.args.distribution_strategy == "fast_ddp" and self.args.world_size > 1

    def _wrap_for_fast_ddp(self, model: nn.Module) -> nn.Module:
        """Autocast and placement from accelerate, but no DDP: gradients go through one fused all-reduce."""
        model = self.accelerator.prepare_model(model, evaluation_mode=True)
        broadcast_parameters(model)
        self._grad_allreduce = FusedGradientAllReduce(list(model.parameters()), dtype=self.args.fast_ddp_torch_dtype)
        return FastDDPModel(model)

    # ---- data ---------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """With graphs (lazy mode, HPU Graphs) pad the last batch so its shape compiles no new graph."""
        static = self.args.use_lazy_mode or self.args.use_hpu_graphs_for_training
        if not static or self.args.dataloader_drop_last or self.data_collator is None:
            return super().get_train_dataloader()
        collator = self.data_collator
        self.data_collator = StaticBatchCollator(collator, self._train_batch_size)
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    # ---- step hooks ---------------------------------------------------------------------------------

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        return self._autocast() if self._autocast is not None else super().autocast_smart_context_manager(cache_enabled)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = super().compute_loss_context_manager()
        if self._pipelining_mark_step is not None and self.model.training:
            stack.callback(self._pipelining_mark_step)  # runs when the forward pass is done
        return stack

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self._throughput.count_tokens(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._lazy_mark_step is not None:
            self._lazy_mark_step()  # after backward
        if self._grad_allreduce is not None and self.accelerator.gradient_state.sync_gradients:
            self._grad_allreduce()  # before clipping, which then sees the averaged gradients
        return loss

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        self._throughput.eval_begin()
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None, **kwargs: Any
    ):
        outputs = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        if self._lazy_mark_step is not None:
            self._lazy_mark_step()  # run the queued evaluation graph before the next batch
        self._throughput.eval_batch(find_batch_size(inputs) or 0)
        return outputs

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if (
            self.optimizer is not None
            or self.optimizer_cls_and_kwargs is not None
            or not self.gaudi_config.use_fused_adam
        ):
            return super().create_optimizer(model)
        if self.args.optim not in _ADAMW_OPTIMIZERS:
            logger.warning("use_fused_adam is ignored because --optim %s is not AdamW.", self.args.optim)
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
        if not self.gaudi_config.use_fused_clip_norm or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return self.gaudi_device.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    # ---- logging ------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        batch, world = self.get_total_train_batch_size(self.args), self.args.world_size
        eval_prefixes = [k.removesuffix("_runtime") for k in logs if k.endswith("_runtime") and k != "train_runtime"]
        if "train_runtime" in logs:
            self._throughput.rewrite(logs, self.state.global_step, batch, world)
        elif eval_prefixes:
            self._throughput.rewrite_eval(logs, eval_prefixes[0])
        elif "loss" in logs:
            logs.update(self._throughput.interval(self.state.global_step, batch, world))
            if self.is_world_process_zero():
                logs.update(self.gaudi_device.memory_stats())
        super().log(logs, start_time)

    # ---- saving -------------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            self.gaudi_config.save_pretrained(output_dir if output_dir is not None else self.args.output_dir)


class GaudiTrainer(GaudiTrainerMixin, Trainer):
    """Trainer for Gaudi (HPU) that runs unchanged on CUDA and CPU: GaudiTrainerMixin + transformers.Trainer."""
