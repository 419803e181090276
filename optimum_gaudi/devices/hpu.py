"""Intel Gaudi (HPU) through Habana's PyTorch bridge.

This is the only module that imports ``habana_frameworks``, and only inside functions. The bridge reads
PT_HPU_* variables (lazy mode, autocast op lists) once, when it loads, and from Gaudi software 1.21 it loads
during ``import torch`` (a ``torch.backends`` entry point) unless PT_HPU_LAZY_MODE=1. So the environment is
set here when the bridge has not loaded yet; once it has, the bridge itself is asked which mode and which
lists it runs with, and a difference is reported with the variables to set before Python starts.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..precision.fp8 import FP8_ATTENTION, Fp8Plan
from ..precision.fp8_recipe import GAUDI_RECIPE
from ..precision.op_lists import (
    BF16_LIST_ENV,
    FP32_LIST_ENV,
    HABANA_DEFAULT_BF16_OPS,
    HABANA_DEFAULT_FP32_OPS,
    op_list_environment,
)
from .base import GB, Device, private_inputs, replayable, unaliased_outputs

logger = logging.getLogger(__name__)

LAZY_ENV = "PT_HPU_LAZY_MODE"
DYNAMIC_SHAPES_ENV = "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES"
TENSOR_CACHE_ENV = "PT_HPUGRAPH_DISABLE_TENSOR_CACHE"  # read by hpu/graphs.py over its argument
TRANSFORMER_ENGINE = (
    "habana_frameworks.torch.hpex.experimental.transformer_engine"  # re-exports intel_transformer_engine
)
_LAUNCH_HINT = "run the script through `optimum-gaudi launch SCRIPT ARGS` (also for one process), which sets it"
_unavailable_reason: str | None = None


def bridge_installed() -> bool:
    try:
        return importlib.util.find_spec("habana_frameworks") is not None
    except ValueError:  # a module whose __spec__ is None stands in sys.modules
        return False


def bridge_imported() -> bool:
    return "habana_frameworks.torch" in sys.modules


def bridge_is_lazy() -> bool | None:
    """The loaded bridge's own answer (decided once when it loaded), or None when it has not loaded."""
    if not bridge_imported():
        return None
    return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())


def loaded_op_lists() -> tuple[set[str], set[str]]:
    """The (bf16, fp32) op sets the loaded bridge autocasts with: each variable's file as it reads it (one op
    per line), else Habana's default list (``hpu_ops/autocast_helpers.h``)."""

    def read(env: str, default: tuple[str, ...]) -> set[str]:
        path = os.environ.get(env)
        try:
            return set(Path(path).read_text().splitlines()) if path else set(default)
        except OSError:
            return set(default)

    return read(BF16_LIST_ENV, HABANA_DEFAULT_BF16_OPS), read(FP32_LIST_ENV, HABANA_DEFAULT_FP32_OPS)


# Set with the dynamic-shapes variable when prepare_bridge sets it: an equal value is ours, not the user's choice
DYNAMIC_SHAPES_OURS_ENV = "OPTIMUM_GAUDI_DYNAMIC_SHAPES_FROM_CONFIG"


def prepare_bridge(
    lazy: bool, op_lists: tuple[list[str], list[str]] | None, dynamic_shapes: bool | None = None
) -> str | None:
    """Give the bridge the lazy mode, the (resolved) op lists and the dynamic-shape switch a run asks for.

    Before the bridge loads this sets its variables; dynamic shapes too, unless the user exported the variable:
    in lazy mode each of the bridge's threads starts from it (the backward runs on the autograd engine's own
    thread), so switching it later from the main thread does not reach the backward. After, it asks the
    bridge: a different mode is returned as a one-line message for the caller to raise (the run cannot work as
    asked); different op lists are one warning naming the exact variables to set, and the run goes on with the
    bridge's lists.
    """
    wanted = {LAZY_ENV: "1" if lazy else "0"}
    if op_lists is not None:
        wanted.update(op_list_environment(*op_lists))
    loaded_lazy = bridge_is_lazy()
    if loaded_lazy is None:
        if dynamic_shapes is not None and os.environ.get(DYNAMIC_SHAPES_ENV) in (
            None,
            os.environ.get(DYNAMIC_SHAPES_OURS_ENV),
        ):
            value = "1" if dynamic_shapes else "0"
            wanted.update({DYNAMIC_SHAPES_ENV: value, DYNAMIC_SHAPES_OURS_ENV: value})
        os.environ.update(wanted)
        return None
    if loaded_lazy != lazy:
        if lazy:
            return (
                "habana_frameworks is already loaded in eager mode (Gaudi software 1.21+ loads it during "
                f"`import torch` unless {LAZY_ENV}=1), so --use_lazy_mode cannot take effect: start Python with "
                f"{LAZY_ENV}=1 (`{LAZY_ENV}=1 python SCRIPT ...`, or {_LAUNCH_HINT}), or drop --use_lazy_mode."
            )
        return (
            f"habana_frameworks is already loaded in lazy mode ({LAZY_ENV} unset or 1 when it was imported) but "
            f"--use_lazy_mode is not set: add --use_lazy_mode, or start Python with {LAZY_ENV}=0 (or {_LAUNCH_HINT})."
        )
    if op_lists is not None:
        warn_if_other_lists_loaded(*op_lists)
    return None


def warn_if_other_lists_loaded(bf16_ops: list[str], fp32_ops: list[str]) -> None:
    """One warning, naming the variables to set, when the loaded bridge autocasts with other lists than these:
    it reads its lists once, when it loads."""
    if loaded_op_lists() == (set(bf16_ops), set(fp32_ops)):
        return
    exports = " ".join(f"{env}={path}" for env, path in op_list_environment(bf16_ops, fp32_ops).items())
    _warn_once(
        "habana_frameworks loaded its autocast op lists before this Gaudi config was read (during `import torch` "
        "on Gaudi software 1.21+, or from other training arguments), so this run autocasts with the bridge's "
        f"lists, not the config's; to use the config's, pass it as --gaudi_config_name and {_LAUNCH_HINT}, or "
        f"start Python with {exports}, or with PT_HPU_AUTOLOAD=0."
    )


def hpu_available() -> bool:
    """True when the bridge loads and sees at least one Gaudi. A bridge that cannot load is said in one line
    and counts as no Gaudi: its import asserts the torch version, reads torch's local version tag (an
    AttributeError without one) and loads its plugin library (an OSError), ``torch/__init__.py``."""
    global _unavailable_reason
    if not bridge_installed():
        return False
    try:
        hthpu = importlib.import_module("habana_frameworks.torch.hpu")
    except ImportError:
        return False
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}" if str(e).strip() else type(e).__name__
        if reason != _unavailable_reason:
            logger.warning(
                "habana_frameworks cannot load (%s). Install the Gaudi software's own torch build (the one its "
                "habana-torch-plugin was built for) or the plugin matching torch %s.",
                reason,
                torch.__version__,
            )
        _unavailable_reason = reason
        _hide_broken_bridge()
        return False
    return bool(hthpu.is_available())


def _hide_broken_bridge() -> None:
    """Make a bridge that failed to load look absent to everyone else in the process: transformers and
    accelerate import it again on their own (``set_seed``, RNG state at checkpoints, clearing the device cache)
    and would raise the same error as a traceback. With None in ``sys.modules`` ``importlib.util.find_spec``
    answers None and an import raises ImportError, which they read as "no Gaudi"."""
    for name in [m for m in sys.modules if m == "habana_frameworks" or m.startswith("habana_frameworks.")]:
        del sys.modules[name]
    sys.modules["habana_frameworks"] = None


def unavailable_reason() -> str | None:
    """Why the installed bridge could not load, if it could not (for error messages)."""
    return _unavailable_reason


class HPUDevice(Device):
    type = "hpu"
    ddp_backend = "hccl"
    compile_backend = "hpu_backend"
    fast_ddp_dtype = "bfloat16"
    # optimum-habana's on a Gaudi: bigger buckets (fewer HCCL calls per step) and gradients stored in the
    # buckets (no copy per step, less memory); its default ddp_find_unused_parameters=False is not taken: a model
    # with an unused parameter would stop with a DDP error where transformers' default trains it
    ddp_defaults = {"bucket_cap_mb": 230, "gradient_as_bucket_view": True}
    fused_adamw_counts_steps_per_group = True  # hpex/optimizers/FusedAdamW.py: group["step"]
    # hpex/optimizers/FusedAdamW.py hands the parameters to torch.ops.hpu.optimizer_adamw, for which the bridge
    # registers no DTensor sharding rule, and sizes each moment from the global shape of the parameter.
    fused_adamw_takes_dtensors = False
    # backend/helpers/collective_utils.cpp getHCCLReduceOp maps MIN, MAX, SUM and PRODUCT only: AVG and PREMUL_SUM
    # are "Unsupported ReduceOp for HCCL process group"
    collectives_average = False
    # lazy mode compiles its graphs at mark_step on the bridge's execution thread: step 1's lands in step 2's first
    # sync, step 2 compiles the optimizer's stateful graph, a new shape compiles again (at the next sync); the
    # recipes of hpu_backend compile at first execution, outside dynamo's callbacks. Recipes are not cached on
    # disk by default, so a restarted process compiles again. optimum-habana: "the first two or three iterations
    # typically take longer".
    compiling_first_steps = 3
    compiles_new_shapes = True
    has_own_memory = True
    behaviour = {
        "use_habana": "Gaudi device hpu",
        "use_lazy_mode": "PT_HPU_LAZY_MODE=1, mark_step() after backward and optimizer step",
        "pipelining_fwd_bwd": "extra mark_step() after forward",
        "use_hpu_graphs_for_training": "ModuleCacher(max_graphs=...) (lazy mode)",
        "use_hpu_graphs_for_inference": "wrap_in_hpu_graph(max_graphs=...) (lazy mode; not during training)",
        "use_fused_adam": "hpex.optimizers.FusedAdamW",
        "use_fused_clip_norm": "hpex.normalization.FusedClipNorm, built once",
        "use_torch_autocast": "torch.autocast('hpu', bfloat16) with the PT_HPU_AUTOCAST_* op lists",
        "distribution_strategy": "hccl process group",
        "torch_compile": "hpu_backend",
        "attn_implementation": "gaudi_fused_sdpa: hpex.kernels.FusedSDPA (recompute / causal / fast softmax flags)",
        "use_fused_rms_norm": "hpex.normalization.FusedRMSNorm in Llama-style RMSNorm modules",
        "use_fused_rope": "hpex.kernels.RotaryPosEmbeddingHelperV1 for Llama-style rotary embedding",
        "use_fused_linear_cross_entropy": "training loss from the hidden states in chunks, no full logits",
        "fp8": "Intel Gaudi Transformer Engine: te.Linear under te.fp8_autocast (delayed scaling, HYBRID format)",
        "fsdp": "FSDP2 fully_shard over hccl, eager mode, gradients reduced with SUM then divided (HCCL has no AVG); "
        "use_fused_adam: torch's AdamW (FusedAdamW takes no DTensor shards)",
        "context_parallel_size": "sequences split over the cards: all-to-all (hccl) around FusedSDPA / the attention kernel",
    }

    # Modules are looked up per call (sys.modules makes that cheap) so the device object stays picklable:
    # transformers saves the training arguments, which carry it, with torch.save.

    def count(self) -> int:
        return int(importlib.import_module("habana_frameworks.torch.hpu").device_count())

    def argument_problem(self, args: Any) -> str | None:
        if (
            args.flash_attention_fp8
            and (name := importlib.import_module("habana_frameworks.torch.hpu").get_device_name()) != "GAUDI3"
        ):
            return f"--flash_attention_fp8 needs a Gaudi 3 (fp8 attention); this is {name}. Drop it to keep --fp8 elsewhere."
        if (args.use_hpu_graphs_for_training or args.use_hpu_graphs_for_inference) and not args.use_lazy_mode:
            return "HPU Graphs need lazy mode on a Gaudi; add --use_lazy_mode."
        if args.use_hpu_graphs_for_training and args.fp16:  # accelerate's fp16 would rebind ModuleCacher's forward
            return "--use_hpu_graphs_for_training takes bf16 mixed precision only on a Gaudi; use --bf16, not --fp16."
        if args.torch_compile_mode is not None and args.torch_compile_backend in (None, self.compile_backend):
            logger.warning(
                "--torch_compile_mode %s: the Gaudi's %s takes no mode (torch hands it only to inductor); it is "
                "ignored here.",
                args.torch_compile_mode,
                self.compile_backend,
            )
        return None

    def is_lazy(self) -> bool:
        """The bridge's own answer, decided once when it loaded (``utils/internal.py``)."""
        importlib.import_module("habana_frameworks.torch")
        return bool(bridge_is_lazy())

    def register_ddp_backend(self) -> None:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")  # registers the 'hccl' backend

    def mark_step(self) -> None:
        importlib.import_module("habana_frameworks.torch.core").mark_step()

    def set_dynamic_shapes(self, enabled: bool) -> None:
        """The config's switch, unless the user exported the bridge's own variable: the bridge starts from it
        (``backend/helpers/dynamic_shape_info.cpp``), and an exported value is the user's explicit choice."""
        exported = os.environ.get(DYNAMIC_SHAPES_ENV)
        if exported is not None and exported != os.environ.get(DYNAMIC_SHAPES_OURS_ENV):
            if (exported == "1") != enabled:
                _warn_once(
                    f"{DYNAMIC_SHAPES_ENV}={exported} is exported: it decides dynamic shapes, not the Gaudi "
                    f"config's use_dynamic_shapes={str(enabled).lower()}; unset it to follow the config."
                )
            return
        hthpu = importlib.import_module("habana_frameworks.torch.hpu")
        (hthpu.enable_dynamic_shape if enabled else hthpu.disable_dynamic_shape)()
        loaded_with = exported or "0"  # what the bridge's other threads started from
        if self.is_lazy() and (loaded_with == "1") != enabled:
            _warn_once(
                f"use_dynamic_shapes={str(enabled).lower()} reaches this thread only: in lazy mode the bridge's other "
                f"threads (the backward's) keep {DYNAMIC_SHAPES_ENV}={loaded_with} from when it loaded. Give this Gaudi "
                "config to the training arguments (--gaudi_config_name), not only to the trainer."
            )

    def reset_peak_memory_stats(self) -> None:
        importlib.import_module("habana_frameworks.torch.hpu").reset_peak_memory_stats()

    def manual_seed(self, seed: int) -> None:
        importlib.import_module("habana_frameworks.torch.hpu.random").manual_seed_all(seed)

    def rng_snapshot(self) -> Callable[[], None]:
        """The host's generator and the Gaudi's (``hpu/random.py``): dropout on the device draws from the latter."""
        hpu_random = importlib.import_module("habana_frameworks.torch.hpu.random")
        restore_host, state = super().rng_snapshot(), hpu_random.get_rng_state()

        def restore() -> None:
            restore_host()
            hpu_random.set_rng_state(state)

        return restore

    def fused_adamw(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        from habana_frameworks.torch.hpex.optimizers import FusedAdamW

        return FusedAdamW, {}

    def grad_clipper(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> Callable[[], torch.Tensor]:
        """One FusedClipNorm (it copies max_norm to the device when built) for these parameters; each call
        clips and returns the pre-clip norm as a scalar tensor, as torch's clip_grad_norm_ does. All of them
        are kept, as the base clipper does: clip_norm skips those without a gradient at each call
        (``hpex/normalization/FusedClipNorm.py``), so a parameter unfrozen later is still clipped."""
        from habana_frameworks.torch.hpex.normalization import FusedClipNorm

        params = list(parameters)
        clipper = FusedClipNorm(params, max_norm)
        return lambda: clipper.clip_norm(params).reshape(())

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return self.grad_clipper(parameters, max_norm)()

    def autocast_factory(
        self, bf16_ops: list[str] | None = None, fp32_ops: list[str] | None = None
    ) -> Callable[[], contextlib.AbstractContextManager]:
        """torch.autocast('hpu'): the bridge took its op lists from the environment when it loaded (set by the
        training arguments or the launcher); lists it did not load (a config given to the trainer, not to the
        arguments) are said once."""
        if bf16_ops is not None and fp32_ops is not None:
            warn_if_other_lists_loaded(bf16_ops, fp32_ops)
        return lambda: torch.autocast(device_type="hpu", dtype=torch.bfloat16)

    # ---- graphs: the bridge exports its graph API in lazy mode only (hpu/__init__.py) ------------------------

    # ModuleCacher sets model.forward to its own bound method, which reads the cacher's state (hpu/graphs.py)
    training_graph_forward_bound_elsewhere = True
    training_graphs_zero_unused_grads = True  # allow_unused_input materializes them (hpu/graphs.py)

    def _graphs_or_warn(self, what: str) -> Any | None:
        if self.is_lazy():
            return importlib.import_module("habana_frameworks.torch.hpu")
        _warn_once(
            f"HPU Graphs ({what}) are a lazy-mode feature of the bridge, which runs in eager mode here: running "
            f"without graphs. Start with {LAZY_ENV}=1 (and --use_lazy_mode) for graphs, or use torch.compile."
        )
        return None

    def wrap_for_training(self, model: torch.nn.Module, max_graphs: int | None) -> torch.nn.Module:
        hthpu = self._graphs_or_warn("ModuleCacher")
        if hthpu is None:
            return model
        cacher = hthpu.ModuleCacher() if max_graphs is None else hthpu.ModuleCacher(max_graphs=max_graphs)
        # The capture differentiates every trainable parameter (hpu/graphs.py); by default one the forward does
        # not use (LayerDrop, an unused pooler) fails the first step, so they are allowed here (optimum-habana
        # keeps the default and fails). The bridge then gives them zero gradients (materialize_grads), where
        # eager training leaves None; the trainer drops them (features/unused_parameters.py).
        return cacher(model=model, inplace=True, allow_unused_input=True)

    def wrap_for_inference(
        self, model: torch.nn.Module, disable_tensor_cache: bool, max_graphs: int | None = None
    ) -> torch.nn.Module:
        """wrap_in_hpu_graph keeps the tensors its capture call was given and copies every replay's inputs into
        them, and returns the same output tensors at every replay (``hpu/graphs.py``). The evaluation loop keeps
        each batch's labels and inputs (for compute_metrics) and predictions by reference, so the graph gets
        private copies of its inputs, and its outputs are cloned without grad. A forward given a stateful object
        (generate's decoding steps, with their cache) runs without the graph (``bypass_hpu_graphs``): see
        :func:`replayable`."""
        hthpu = self._graphs_or_warn("wrap_in_hpu_graph")
        if hthpu is None:
            return model
        exported = os.environ.get(TENSOR_CACHE_ENV)
        if exported is not None and (exported == "1") != disable_tensor_cache:
            _warn_once(
                f"{TENSOR_CACHE_ENV}={exported} is exported: the bridge takes it over "
                f"--disable_tensor_cache_hpu_graphs={str(disable_tensor_cache).lower()}; unset it to follow the argument."
            )
        model = hthpu.wrap_in_hpu_graph(model, disable_tensor_cache=disable_tensor_cache, max_graphs=max_graphs)
        graphed = model.forward

        @functools.wraps(graphed)  # keeps the signature the Trainer reads to select input columns
        def forward(*args: Any, **kwargs: Any) -> Any:
            cache_tensors = kwargs.pop("cache_tensors_list", None)  # the bridge writes into these: keep them
            if not replayable((args, kwargs)):
                return graphed(*args, bypass_hpu_graphs=True, **kwargs)  # the bridge runs the plain forward
            args, kwargs = private_inputs((args, kwargs))
            if cache_tensors is not None:
                kwargs["cache_tensors_list"] = cache_tensors
            return unaliased_outputs(graphed(*args, **kwargs))

        model.forward = forward
        return model

    def static_shapes(self, lazy_mode: bool) -> bool:
        """Lazy mode compiles (and HPU Graphs capture) one graph per input shape."""
        return lazy_mode

    def capture_graph(self, fn: Callable[..., Any], static_inputs: tuple) -> tuple[Any, Callable[[], None]]:
        hthpu = self._graphs_or_warn("HPUGraph")
        if hthpu is None:
            return super().capture_graph(fn, static_inputs)
        hpu_graph = hthpu.HPUGraph()
        with hthpu.graph(hpu_graph):
            outputs = fn(*static_inputs)
        return outputs, hpu_graph.replay

    def make_graphed_callables(self, callables: Any, sample_args: tuple) -> Any:
        hthpu = self._graphs_or_warn("make_graphed_callables")
        if hthpu is None:
            return callables
        return hthpu.make_graphed_callables(callables, sample_args)

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """HPU activity where this torch knows it (the bridge swaps in an enum that has it when it loads)."""
        activity = torch.profiler.ProfilerActivity
        return [activity.CPU, activity.HPU] if hasattr(activity, "HPU") else [activity.CPU]

    # ---- LLM kernels (hpex/kernels, hpex/normalization) -------------------------------------------------------

    def attention_kernel(self, options: Any) -> Callable[..., torch.Tensor]:
        """FusedSDPA, whose ``apply`` takes its arguments by position (an autograd Function,
        ``hpex/kernels/FusedSDPA.py``). Its fast softmax trains only in causal mode: for a batch with padding (a
        mask, not the causal mode) the call uses the default softmax, said once."""
        from habana_frameworks.torch.hpex.kernels import FusedSDPA

        softmax = "fast" if options.fast_softmax else "None"
        if options.fp8:
            return self._fp8_attention_kernel(options, softmax)

        def kernel(q, k, v, mask, dropout_p, is_causal, scale, layer=None):
            mode = softmax
            if mode == "fast" and not is_causal and (q.requires_grad or k.requires_grad or v.requires_grad):
                _warn_once(
                    "--flash_attention_fast_softmax: FusedSDPA trains with fast softmax only in causal mode; batches "
                    "with padding use the default softmax (add --flash_attention_causal_mask for right padding)."
                )
                mode = "None"
            return FusedSDPA.apply(q, k, v, mask, dropout_p, is_causal, scale, mode, options.recompute, None, "None")

        return kernel

    def _fp8_attention_kernel(self, options: Any, softmax: str) -> Callable[..., torch.Tensor]:
        """--flash_attention_fp8: each attention layer's own Transformer Engine ``FusedAttention`` (its registered
        submodule, :meth:`fp8_attention_builder`), called with (q, k, v, mask, is_causal, softmax_mode); key/value
        heads repeated to the query heads. In fp8 inside the training forwards' ``fp8_autocast`` (--fp8), in the
        model's precision elsewhere; its dropout follows the layer's ``train()``/``eval()``."""

        def kernel(q, k, v, mask, dropout_p, is_causal, scale, layer=None):
            attention = getattr(layer, FP8_ATTENTION, None)
            if attention is None:
                raise RuntimeError(
                    f"--flash_attention_fp8: {type(layer).__name__} has no {FP8_ATTENTION}; the trainer attaches one "
                    "to each attention layer before training (precision/fp8.py attach_fp8_attention)."
                )
            groups = q.shape[1] // k.shape[1]
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            return attention(q, k, v, mask, is_causal, softmax)

        return kernel

    def fp8_attention_builder(self, recompute: bool) -> Callable[[float | None, float], torch.nn.Module]:
        """``FusedAttention(scale, attention_dropout, enable_recompute)`` for one layer, as optimum-habana builds it
        when it converts a model (``accelerate/utils/transformer_engine.py``): from the layer's scale and the
        model's attention dropout, not from the dropout of whichever call comes first (0 in evaluation)."""
        te = importlib.import_module(TRANSFORMER_ENGINE)
        return lambda scale, dropout: te.FusedAttention(
            scale=scale, attention_dropout=dropout, enable_recompute=recompute
        )

    def rms_norm_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
        """FusedRMSNorm returns float32 when input and weight dtypes differ (``hpu_ops/backend/rms_norm_gen.cpp``):
        both go in as the dtype Llama's RMSNorm returns (the wider of the two), so the result matches it."""
        from habana_frameworks.torch.hpex.normalization import FusedRMSNorm

        def kernel(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
            return FusedRMSNorm.apply(hidden.to(dtype), weight.to(dtype), eps)

        return kernel

    def rotary_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """RotaryPosEmbeddingHelperV1: rotate-half (BLOCKWISE) with cos/sin already per position, offset 0
        (``hpex/kernels/RotaryPosEmbeddingHelper.py``)."""
        from habana_frameworks.torch.hpex.kernels import RotaryPosEmbeddingHelperV1

        return lambda x, cos, sin: RotaryPosEmbeddingHelperV1.apply(x, cos, sin, 0)

    def fp8_problem(self, compiling: bool = False) -> str | None:
        if importlib.import_module("habana_frameworks.torch.hpu").get_device_name() == "GAUDI":
            return "--fp8 needs Gaudi 2 or later; this is a first-generation Gaudi. Train with --bf16."
        _custom_ops_before_import(compiling)
        try:
            importlib.import_module(TRANSFORMER_ENGINE)
        except ImportError as e:
            return f"--fp8 needs Intel's Gaudi Transformer Engine, which this Gaudi software lacks ({e}). Train with --bf16."
        return None

    def fp8_plan(self, minimize_memory: bool, compiling: bool, recipe: dict[str, Any] | None = None) -> Fp8Plan:
        """``te.Linear`` built without weights and given the layer's own (``skip_weight_param_allocation``, as
        optimum-habana converts), under ``te.fp8_autocast`` with the delayed-scaling ``recipe`` (optimum-habana's
        by default: HYBRID, e4m3 forward and e5m2 gradients, the most recent amax, every 16 steps). Compiled,
        Transformer Engine runs its ops as custom ops (PT_TE_CUSTOM_OP=1, read when it is first imported)."""
        _custom_ops_before_import(compiling)
        te = importlib.import_module(TRANSFORMER_ENGINE)
        recipe = recipe or GAUDI_RECIPE
        fields = {**recipe, "fp8_format": getattr(te.recipe.Format, recipe["fp8_format"])}
        delayed = te.recipe.DelayedScaling(**fields)

        def make(linear: torch.nn.Linear) -> torch.nn.Module:
            has_bias = linear.bias is not None
            layer = te.Linear(linear.in_features, linear.out_features, bias=has_bias, params_dtype=linear.weight.dtype,
                              skip_weight_param_allocation=True, minimize_memory=minimize_memory)  # fmt: skip
            layer.weight = linear.weight
            if has_bias:
                layer.bias = linear.bias
            return layer

        def convert(model: torch.nn.Module, layers: set[torch.nn.Linear]) -> None:
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if child in layers:
                        setattr(parent, name, make(child))

        return Fp8Plan(
            "Intel Gaudi Transformer Engine te.Linear",
            convert,
            lambda: te.fp8_autocast(enabled=True, fp8_recipe=delayed),
            lambda function: te.distributed.activation_checkpointing()(function),
            # te.Linear's parameters and fp8 metadata under fully_shard are untested; on the simulator accelerate's
            # sharded loading meets a parameter FSDP did not shard
            shards_with_fsdp=False,
        )

    def memory_info(self) -> tuple[int, int]:
        free, total = importlib.import_module("habana_frameworks.torch.hpu").mem_get_info()
        return int(free), int(total)

    def memory_stats(self) -> dict[str, float]:
        stats = importlib.import_module("habana_frameworks.torch.hpu").memory_stats()
        return {
            "memory_allocated (GB)": round(stats.get("InUse", 0) / GB, 3),
            "max_memory_allocated (GB)": round(stats.get("MaxInUse", 0) / GB, 3),
            "total_memory_available (GB)": round(stats.get("Limit", 0) / GB, 2),
        }


_warned: set[str] = set()


def _custom_ops_before_import(compiling: bool) -> None:
    """Compiled fp8 needs Transformer Engine's custom ops, a switch it reads when first imported: set it before
    (unless the user set it), or say in one line that the import came too early for it."""
    if not compiling or os.environ.get("PT_TE_CUSTOM_OP") is not None:
        return
    if "intel_transformer_engine" in sys.modules:
        _warn_once(
            "--fp8 --torch_compile: Intel's Transformer Engine was imported before the training arguments could set "
            "PT_TE_CUSTOM_OP=1; export PT_TE_CUSTOM_OP=1 before starting Python so compiled fp8 uses its custom ops."
        )
    os.environ["PT_TE_CUSTOM_OP"] = "1"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
