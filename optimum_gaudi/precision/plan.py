"""A run's precision, decided once per trainer: one object answers every precision question the trainer asks.

Three orthogonal axes, each off unless the run asks for it (then the trainer is transformers.Trainer here):

- the autocast: bf16 on exactly the Gaudi config's op lists (a list left out is Habana's default, the same lists
  on every device), which replaces accelerate's mixed precision; or, around a training graph whose forward
  accelerate cannot rebind, torch's autocast for the device, entered by the trainer instead of by accelerate;
- fp8: the device's fp8 layers (:class:`Fp8Plan`: torchao's, or the Transformer Engine's with its recipe and its
  context around each training forward), recomputation in fp8, fp8 attention modules, and the scaling state a
  checkpoint keeps beside weights saved without it;
- FSDP: under the op-list autocast, parameters all-gathered in bf16.

The plan knows no device class and no Gaudi config class (precision sits below both): :meth:`PrecisionPlan.build`
asks the device it is given for its own part (``autocast_factory``, ``fp8_plan``, ``fp8_attention_builder``,
``training_graph_forward_bound_elsewhere``) and reads the config's autocast keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .autocast import OpListAutocast
from .fp8 import (
    Fp8Plan,
    attach_fp8_attention,
    load_scaling_state,
    recompute_in_fp8,
    save_scaling_state,
    saved_state_dict,
    use_fp8,
    without_fp8_state,
)
from .fp8_recipe import parse_fp8_recipe
from .op_list_check import check_op_lists
from .op_lists import config_uses_op_lists, resolve_op_lists

ContextFactory = Callable[[], contextlib.AbstractContextManager]
AttentionBuilder = Callable[[float | None, float], nn.Module]


class PrecisionPlan:
    """What a trainer's precision is: ``autocast`` (what each forward enters where the trainer, not accelerate,
    autocasts; None: accelerate's mixed precision, as transformers.Trainer) and ``fp8`` (the device's fp8 plan;
    None without ``--fp8``). Its one piece of state: a resumed checkpoint whose fp8 scaling state waits for the
    model's fp8 modules to exist."""

    def __init__(
        self,
        autocast: ContextFactory | None = None,
        fp8: Fp8Plan | None = None,
        fp8_attention: Callable[[], AttentionBuilder | None] | None = None,
        ranks: Callable[[], tuple[int, int]] = lambda: (0, 1),
        autocast_text: str | None = None,
    ) -> None:
        self.autocast = autocast
        self._autocast_text = autocast_text  # what the autocast is, in words, for describe()
        self.fp8 = fp8
        self._fp8_attention = fp8_attention  # asked at each conversion: the device's builder, or None
        self._ranks = ranks  # (this process's rank, the world size), read when a checkpoint is saved or loaded
        self._scaling_from: str | None = None  # a resumed checkpoint whose fp8 scaling state is still to load

    @classmethod
    def build(cls, args: Any, config: Any, device: Any, autocast_device: Any | None = None) -> PrecisionPlan:
        """From Gaudi training arguments, a GaudiConfig and the device that trains (``autocast_device``: the one
        that autocasts, the host with ``--half_precision_backend cpu_amp``; the training device by default)."""
        autocast_device = device if autocast_device is None else autocast_device
        autocast, autocast_text = _select_autocast(args, config, device, autocast_device)
        fp8 = fp8_attention = None
        if args.fp8:
            recipe = parse_fp8_recipe(args.fp8_recipe) if args.fp8_recipe is not None else None
            fp8 = device.fp8_plan(args.minimize_memory, bool(args.torch_compile), recipe)
            if args.flash_attention_fp8:

                def fp8_attention() -> AttentionBuilder | None:
                    return device.fp8_attention_builder(args.flash_attention_recompute)

        return cls(autocast, fp8, fp8_attention, lambda: (args.process_index, args.world_size), autocast_text)

    def describe(self) -> str:
        """The plan in one line, for the run's log: what autocasts each forward (or accelerate's mixed precision)
        and what trains in fp8."""
        autocast = self._autocast_text or (
            "the trainer's autocast" if self.autocast else "accelerate's mixed precision"
        )
        fp8 = "no fp8" if self.fp8 is None else f"fp8 by {self.fp8.name}"
        if self.fp8 is not None and self._fp8_attention is not None:
            fp8 += ", fp8 attention"
        return f"{autocast}; {fp8}"

    # ---- accelerate and the forwards --------------------------------------------------------------------------

    @property
    def accelerate_mixed_precision(self) -> str | None:
        """accelerate's ``mixed_precision`` for this run: "no" where this plan's autocast replaces accelerate's
        fixed op lists; None leaves the arguments' choice (transformers.Trainer's)."""
        return "no" if self.autocast is not None else None

    def forward_context(self, training: bool, accelerate_autocast: ContextFactory) -> contextlib.AbstractContextManager:
        """Around a forward: this plan's autocast, else accelerate's (``accelerate_autocast``, asked only then); in
        a training forward, the device's fp8 context inside it where it has one (evaluation runs in the model's
        precision, as under accelerate's fp8)."""
        autocast = self.autocast() if self.autocast is not None else accelerate_autocast()
        if self.fp8 is None or self.fp8.autocast is None or not training:
            return autocast
        stack = contextlib.ExitStack()
        stack.enter_context(autocast)
        stack.enter_context(self.fp8.autocast())
        return stack

    def loop_context(self) -> contextlib.AbstractContextManager:
        """Around a whole training or evaluation loop: the op-list autocast's kernels installed once, not at every
        forward (a device that hands its lists to the bridge has nothing to keep)."""
        autocast = self.autocast() if self.autocast is not None else None
        return autocast.kept() if isinstance(autocast, OpListAutocast) else contextlib.nullcontext()

    def check_op_lists(self, model: nn.Module) -> None:
        """Before step 1: op lists that give one op of this model inputs of two dtypes are one line
        (op_list_check.py)."""
        check_op_lists(model, self.autocast)

    # ---- the model --------------------------------------------------------------------------------------------

    def convert(self, model: nn.Module) -> None:
        """With --fp8: the model's eligible linear layers in fp8, the layers checkpointed since recomputed in fp8,
        an fp8 attention module in each attention layer with --flash_attention_fp8 where the device has one, and a
        resumed checkpoint's scaling state once the fp8 modules exist. Idempotent: called at each wrap."""
        if self.fp8 is None:
            return
        use_fp8(model, self.fp8)
        recompute_in_fp8(model, self.fp8)  # layers checkpointed since (gradient checkpointing) too
        build = self._fp8_attention() if self._fp8_attention is not None else None
        if build is not None:
            attach_fp8_attention(model, build)
        self._restore_scaling(model)

    # ---- FSDP ---------------------------------------------------------------------------------------------------

    def fsdp_mixed_precision_policy(self) -> Any | None:
        """FSDP2's mixed precision under the op-list autocast: parameters all-gathered in bf16 (half the bytes
        gathered and held unsharded), gradients reduced in float32 as DDP reduces them. The autocast still decides
        each op's precision (an op on neither list runs in bf16 on the gathered weights, where DDP would run it in
        float32: the losses differ within bf16's rounding). None without it: accelerate's own choice."""
        if self.autocast is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            cast_forward_inputs=False,  # each op's inputs are the autocast's to cast, not each wrapped layer's
        )

    # ---- checkpoints and saved weights ------------------------------------------------------------------------

    def save_scaling_state(self, model: nn.Module, directory: str) -> None:
        """Into a checkpoint, by every rank (each keeps its own amax history): the fp8 scaling state the saved
        weights leave out; nothing without fp8 (or without Transformer Engine modules)."""
        if self.fp8 is not None:  # every rank its own amax history
            save_scaling_state(model, directory, *self._ranks())

    def resume_scaling_from(self, checkpoint: str, model: nn.Module) -> None:
        """A checkpoint being resumed: its fp8 scaling state goes into the model's fp8 modules, now if they exist,
        else when :meth:`convert` makes them (the model is usually wrapped after its weights are loaded)."""
        if self.fp8 is None:
            return
        self._scaling_from = checkpoint
        self._restore_scaling(model)

    def _restore_scaling(self, model: nn.Module) -> None:
        if self._scaling_from is not None and getattr(model, "_gaudi_fp8", None) is not None:
            load_scaling_state(model, self._scaling_from, *self._ranks())
            self._scaling_from = None

    def weights_to_save(self, model: nn.Module, state_dict: dict | None) -> dict | None:
        """The state dict transformers' ``_save`` writes: with fp8, the weights without scaling state, as plain
        transformers reads them; otherwise the one given (None: the model's own)."""
        if self.fp8 is None:
            return state_dict
        return without_fp8_state(state_dict) if state_dict is not None else saved_state_dict(model)

    @staticmethod
    def without_scaling_state(state_dict: dict) -> dict:
        """Weights saved tensor by tensor (FSDP's full weights) leave Transformer Engine scaling state out,
        whoever made those modules."""
        return without_fp8_state(state_dict)


def _select_autocast(args: Any, config: Any, device: Any, autocast_device: Any) -> tuple[ContextFactory | None, str]:
    """bf16 autocast on the Gaudi config's op lists (a list left out is Habana's default list), the same lists on
    every device; with what it is, in words.

    Plain ``--bf16`` without a config that autocasts is left to accelerate, exactly as transformers.Trainer does
    it, except around a training graph whose forward accelerate cannot rebind (see
    ``Device.training_graph_forward_bound_elsewhere``): there the trainer enters the same autocast accelerate
    would, torch's own for the device.
    """
    if config.use_torch_autocast or (args.bf16 and config_uses_op_lists(config)):
        bf16_ops, fp32_ops = resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops)
        text = (
            f"bf16 autocast on {autocast_device.type} by the op lists ({len(bf16_ops)} bf16, {len(fp32_ops)} fp32 ops)"
        )
        return autocast_device.autocast_factory(bf16_ops, fp32_ops), text
    if args.bf16 and args.use_hpu_graphs_for_training and device.training_graph_forward_bound_elsewhere:
        return (
            autocast_device.autocast_factory(),
            f"bf16 torch.autocast on {autocast_device.type}, around training graphs",
        )
    mixed = "bf16" if args.bf16 else "fp16" if getattr(args, "fp16", False) else None
    return None, f"{mixed} mixed precision by accelerate" if mixed else "float32, no mixed precision"


def argument_problem(args: Any) -> str | None:
    """The precision flags' own problem, in one line, on every device before one is detected: an ``--fp8_recipe``
    that does not parse. What fp8 needs of the device is the device's to say (``Device.fp8_problem``)."""
    if getattr(args, "fp8_recipe", None) is None:
        return None
    try:
        parse_fp8_recipe(args.fp8_recipe)
    except UserError as e:
        return str(e)
    return None
