"""Model preparation as code in order: :data:`STAGES` is the list of (name, function) pairs one loop runs, at every
train, evaluate and predict, as torchtitan's ``parallelize_llama`` runs its steps in the order they are written.

Each stage does its work once per model and changes the model's ``forward`` and ``loss_function`` only through
``features.seam.Seam``; ``features.seam.undo(model)`` takes all of it back. The stages before ``accelerate`` work
on the model itself (under whatever wraps it from an earlier train()), the ones after on what accelerate made.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from ..distributed.fast_ddp import FastDDPModel, FusedGradientAllReduce, broadcast_parameters
from ..features import attention, kernels
from ..features import linear_cross_entropy as fused_loss
from ..features.compilation import compile_regions, pin_loss_function
from ..seam import Seam, undo_attribute

logger = logging.getLogger(__name__)


class ModelPreparation:
    """One per trainer: runs :data:`STAGES` on a model and keeps what a stage made that the training step uses
    (fast_ddp's fused all-reduce). ``accelerate_wrap`` is the parent Trainer's ``_wrap_model``."""

    def __init__(self, trainer: Any, accelerate_wrap: Callable[[nn.Module, bool, Any], nn.Module]) -> None:
        self.trainer = trainer
        self._accelerate_wrap = accelerate_wrap
        self.grad_allreduce: FusedGradientAllReduce | None = None  # fast_ddp: called after each backward
        self._said_no_eval_graphs = False

    def run(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        for _, stage in STAGES:
            model = stage(self, model, training, dataloader)
        return model

    def _inner(self, model: nn.Module) -> nn.Module:
        return self.trainer.accelerator.unwrap_model(model, keep_torch_compile=False)

    # ---- the stages, in STAGES' order -------------------------------------------------------------------

    def attention(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """The attention implementation asked for; gaudi_fused_sdpa's kernel bound to the model's layers."""
        attention.use(self._inner(model), self.trainer.args, self.trainer.gaudi_device)
        return model

    def sequence_parallel(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """The model's attention split over the sequence-parallel group (ours, per trainer); a trainer with no split
        takes an earlier trainer's off the model, which would otherwise run it."""
        inner = self._inner(model)
        if self.trainer._sequence_parallel is not None:
            self.trainer._sequence_parallel.use(inner)
            return model
        seam = Seam.find(getattr(inner, "get_base_model", lambda: inner)(), "attn_implementation")
        if seam is not None:
            seam.remove("sequence_parallel")
        return model

    def kernels(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """The device's fused RMSNorm and rotary kernels where the Gaudi config asks for them."""
        device, config = self.trainer.gaudi_device, self.trainer.gaudi_config
        kernels.use_device_kernels(
            self._inner(model),
            rms_norm=device.rms_norm_kernel() if config.use_fused_rms_norm else None,
            rotary=device.rotary_kernel() if config.use_fused_rope else None,
        )
        return model

    def precision(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """--fp8: the device's fp8 layers and attention, a resumed scaling state (precision/plan.py)."""
        self.trainer._precision.convert(self._inner(model))
        return model

    def compile(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """Once per model: its loss function pinned (no graph break) and, with --use_regional_compilation, its
        repeated blocks and loss compiled."""
        options, inner = self.trainer._compile, self._inner(model)
        if options is None or getattr(inner, "_gaudi_compile_prepared", False):
            return model
        inner._gaudi_compile_prepared = True
        undo_attribute(inner, "_gaudi_compile_prepared")
        pin_loss_function(inner)
        if not options.regional:
            return model
        blocks = compile_regions(inner, options)
        if blocks is not None:
            logger.info("Regional compilation: the blocks of %s compiled once for all of them.", blocks)
            return model
        logger.warning("--use_regional_compilation: no repeated blocks in the model; compiling it whole.")
        inner.compile(**options.compile_kwargs())
        undo_attribute(inner, "_compiled_call_impl")
        return model

    def fused_loss(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """Training: the output layer's hook and the loss function that skips the logits."""
        if training and self.trainer._fused_loss:
            self.fused_loss_of(self._inner(model))
        return model

    def accelerate(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """transformers' own wrap (DDP, FSDP2, DeepSpeed), with the device's DDP defaults where the user set none."""
        model = self._accelerate_wrap(model, training, dataloader)
        self.use_device_ddp_defaults()
        return model

    def graphs(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """HPU or CUDA graphs around the forward: for inference, or (an inference graph taken off) for training."""
        if not training:
            return self._with_inference_graphs(model)
        self._unwrap_inference_graph(model)
        return self._with_training_graphs(model)

    def fast_ddp(self, model: nn.Module, training: bool, dataloader: Any) -> nn.Module:
        """Training: autocast and placement from accelerate, but no DDP: gradients go through one fused
        all-reduce."""
        if not training or not self.trainer._layout.fast_ddp or isinstance(model, FastDDPModel):
            return model
        model = self.trainer.accelerator.prepare_model(model, evaluation_mode=True)
        broadcast_parameters(model)
        self.grad_allreduce = FusedGradientAllReduce(
            list(model.parameters()), dtype=self.trainer.args.fast_ddp_torch_dtype
        )
        return FastDDPModel(model)

    # ---- what the stages share with the training step -----------------------------------------------------

    def fused_loss_of(self, model: nn.Module) -> fused_loss.FusedLinearCrossEntropy | None:
        """The fused loss's hooks on the model, once; their chunk step compiled with the model."""
        options = self.trainer._compile
        fused = fused_loss.FusedLinearCrossEntropy.of(model, strict=self.trainer.args.use_fused_linear_cross_entropy)
        if fused is not None and options is not None and fused.compiled_chunk is None:
            fused.compile_with(options.compile_kwargs())
        return fused

    def use_device_ddp_defaults(self) -> None:
        """The device's DDP settings where the user gave none, set on accelerate's DDP handler before
        ``accelerator.prepare`` wraps the model (transformers 5 builds the handler with the accelerator, 4.57 in
        ``_wrap_model``)."""
        trainer = self.trainer
        handler = getattr(trainer.accelerator, "ddp_handler", None)
        if handler is None or not trainer.gaudi_device.ddp_defaults:
            return
        for name, value in trainer.gaudi_device.ddp_defaults.items():
            if getattr(trainer.args, f"ddp_{name}", None) is None:
                setattr(handler, name, value)

    def _with_training_graphs(self, model: nn.Module) -> nn.Module:
        """--use_hpu_graphs_for_training: the device's graph cache around the model's own forward, once per model,
        under whatever wraps it (a second train() is given an earlier one's DDP or fast_ddp wrapper: ModuleCacher
        refuses fast_ddp's forward(*args), and caches the model's own signature)."""
        args = self.trainer.args
        if not args.use_hpu_graphs_for_training:
            return model
        inner = self.trainer.accelerator.unwrap_model(model, keep_torch_compile=False)
        seam = Seam.of(inner, "forward")
        if "training_graphs" in seam:
            return model
        wrap = functools.partial(self.trainer.gaudi_device.wrap_for_training, inner, args.max_hpu_graphs)
        graphed = seam.adopt("training_graphs", wrap)  # the bridge writes the forward itself
        return graphed if inner is model else model

    def _with_inference_graphs(self, model: nn.Module) -> nn.Module:
        """--use_hpu_graphs_for_inference: the device's inference graphs around the forward, once per model, not
        while it trains."""
        args = self.trainer.args
        if not args.use_hpu_graphs_for_inference or "inference_graphs" in Seam.of(model, "forward"):
            return model
        if self.trainer.is_in_train:
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
            self.trainer.gaudi_device.wrap_for_inference,
            model,
            args.disable_tensor_cache_hpu_graphs,
            max_graphs=args.max_hpu_graphs,
        )
        return Seam.of(model, "forward").adopt("inference_graphs", wrap)

    def _unwrap_inference_graph(self, model: nn.Module) -> None:
        """Training again after evaluate(): the inference graph taken off the forward. ``model`` may be the
        wrapper of an earlier train() (DDP), with the graphed model inside."""
        for candidate in (model, self.trainer.accelerator.unwrap_model(model, keep_torch_compile=False)):
            seam = Seam.find(candidate, "forward")
            if seam is not None:
                seam.remove("inference_graphs")


Stage = Callable[[ModelPreparation, nn.Module, bool, Any], nn.Module]

# The stages, in the order they run: the order is this list (a test reads it).
STAGES: tuple[tuple[str, Stage], ...] = (
    ("attention", ModelPreparation.attention),
    ("sequence_parallel", ModelPreparation.sequence_parallel),
    ("kernels", ModelPreparation.kernels),
    ("precision", ModelPreparation.precision),
    ("compile", ModelPreparation.compile),
    ("fused_loss", ModelPreparation.fused_loss),
    ("accelerate", ModelPreparation.accelerate),
    ("graphs", ModelPreparation.graphs),
    ("fast_ddp", ModelPreparation.fast_ddp),
)
