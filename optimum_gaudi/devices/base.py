"""The one interface the trainer talks to; each device implements it with its nearest native equivalent."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map_only

from ..errors import quiet_logger
from ..precision.fp8 import Fp8Plan

logger = logging.getLogger(__name__)


def torch_release(version: str = torch.__version__) -> tuple[int, ...]:
    """(major, minor) of a torch version string ("2.6.0+hpu.synapse.v1.21.0" -> (2, 6))."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def has_fp8_matmul(device_type: str) -> bool:
    """Whether this torch has an fp8 matmul (``aten::_scaled_mm``) for the device: CPU's came with torch 2.8."""
    key = torch._C._dispatch_key_for_device(device_type)
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm", key)


# Gaudi feature -> what it means, in a word, on the device. Each subclass fills the same keys.
FEATURES = (
    "use_habana",
    "use_lazy_mode",
    "pipelining_fwd_bwd",
    "use_hpu_graphs_for_training",
    "use_hpu_graphs_for_inference",
    "use_fused_adam",
    "use_fused_clip_norm",
    "use_torch_autocast",
    "distribution_strategy",
    "torch_compile",
    "attn_implementation",
    "use_fused_rms_norm",
    "use_fused_rope",
    "use_fused_linear_cross_entropy",
    "fp8",
    "fsdp",
    "context_parallel_size",
)


class Device:
    """A training device as the trainer sees it: no caller ever asks which kind it is."""

    type: ClassVar[str]
    ddp_backend: ClassVar[str]
    compile_backend: ClassVar[str] = "inductor"
    inductor_options: ClassVar[dict[str, Any]] = {}  # inductor config this device compiles with
    fast_ddp_dtype: ClassVar[str] = "float32"  # dtype of the fast_ddp fusion buffer by default
    # DistributedDataParallel settings this device trains faster with, where the user set none; they change
    # speed and memory, never the gradients
    ddp_defaults: ClassVar[dict[str, Any]] = {}
    # where fused_adamw()'s optimizer counts its steps: per param group, or per parameter as torch's AdamW
    fused_adamw_counts_steps_per_group: ClassVar[bool] = False
    # Whether fused_adamw()'s optimizer steps FSDP2's sharded parameters (DTensors): torch's fused AdamW has DTensor
    # rules; a device kernel without them is left out under FSDP.
    fused_adamw_takes_dtensors: ClassVar[bool] = True
    # Whether the device's collectives take ReduceOp.AVG (and PREMUL_SUM): FSDP2 reduce-scatters float32 / bf16
    # gradients with AVG unless told to sum and divide (torch's set_force_sum_reduction_for_comms).
    collectives_average: ClassVar[bool] = True
    behaviour: ClassVar[dict[str, str]]

    on_host: ClassVar[bool] = False  # the model trains in host memory (transformers' --use_cpu)
    # wrap_for_training patches the model's forward with a method bound to another object (the bridge's
    # ModuleCacher). accelerate's mixed precision rebinds ``model.forward.__func__`` to the model, which breaks
    # such a forward: the trainer then keeps accelerate's mixed precision off and enters the autocast itself.
    training_graph_forward_bound_elsewhere: ClassVar[bool] = False
    # --context_parallel_size under --fsdp runs torch's context parallelism (transformers' parallelism_config): its
    # ring attention shards this device's SDPA kernels. Elsewhere (no sharding rule for the CPU's kernels nor for
    # FusedSDPA) the sequences split around the attention registry (distributed/sequence_parallel.py). The choice
    # is made in one place, distributed/layout.py.
    torch_context_parallel: ClassVar[bool] = False
    # training graphs give trainable parameters the forward does not use a zero gradient (not None)
    training_graphs_zero_unused_grads: ClassVar[bool] = False
    # steps that may compile for minutes outside torch.compile's callbacks (the progress watchdog gives them its
    # compile limit): the first N steps of each process, and with ``compiles_new_shapes`` a step whose inputs have
    # shapes not seen before and the step after it
    compiling_first_steps: ClassVar[int] = 0
    compiles_new_shapes: ClassVar[bool] = False
    # memory of its own, which a run's memory plan is checked against (a CPU shares the machine's with the OS)
    has_own_memory: ClassVar[bool] = False

    def count(self) -> int:
        return 1

    def argument_problem(self, args: Any) -> str | None:
        """Why these training arguments cannot run on this device, in one line for the caller to raise;
        None when they can (after a warning for any this device runs otherwise than asked)."""
        if args.half_precision_backend == "hpu_amp":
            logger.warning("--half_precision_backend hpu_amp: no Gaudi here, autocast runs on %s.", self.type)
        return None

    def register_ddp_backend(self) -> None:
        """Make `ddp_backend` known to torch.distributed before the process group starts."""

    def is_lazy(self) -> bool:
        """Whether the device runs in lazy mode (ops queued until mark_step); only a Gaudi can."""
        return False

    def mark_step(self) -> None:
        """Flush the queued lazy graph; only a lazy-mode device has anything to do."""

    def set_dynamic_shapes(self, enabled: bool) -> None:
        """Switch the device's dynamic-shape support where it has a switch (a Gaudi does)."""

    def reset_peak_memory_stats(self) -> None:
        """Start the peak-memory count afresh (at train start), where the device can."""

    def manual_seed(self, seed: int) -> None:
        """Seed the device's own random generator where torch.manual_seed does not reach it (a Gaudi's); CPU
        and CUDA are seeded by torch.manual_seed."""

    def rng_snapshot(self) -> Callable[[], None]:
        """Capture the random generators a forward draws from (dropout); the returned function restores them."""
        state = torch.get_rng_state()
        return lambda: torch.set_rng_state(state)

    def loop_memory(self, sharded: bool = False) -> contextlib.AbstractContextManager:
        """Around a training or evaluation loop: how the device keeps memory freed from one step for the
        next. Device memory has its caching allocator already; host memory is the host's business.
        ``sharded``: the run splits its state or its sequences over ranks to save memory (FSDP, sequence
        parallelism)."""
        return contextlib.nullcontext()

    def fused_adamw(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """The optimizer class (and extra kwargs) of the fastest AdamW on this device."""
        return torch.optim.AdamW, {"fused": True}

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Fused/foreach gradient clipping; returns the total norm before clipping, like torch's."""
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, foreach=True)

    def grad_clipper(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> Callable[[], torch.Tensor]:
        """A clipper built once for these parameters: each call clips their gradients and returns the norm."""
        params = list(parameters)
        return lambda: self.clip_grad_norm_(params, max_norm)

    @property
    def native_bf16(self) -> bool:
        """Whether the device computes in bf16 natively. Where it only emulates bf16, autocasting to it trains
        slower than float32: a run that picks its own precision (the demo) trains in float32 there."""
        return True

    def bf16_note(self) -> str | None:
        """One line on what bf16 costs here, where it is emulated; None where it is native."""
        return None if self.native_bf16 else f"bf16 is emulated on this {self.type.upper()}: slower than float32 here"

    def autocast_factory(
        self, bf16_ops: list[str] | None = None, fp32_ops: list[str] | None = None
    ) -> Callable[[], contextlib.AbstractContextManager]:
        """What to enter around each forward for bf16 autocast: the op lists exactly when given, else
        torch's own autocast for this device."""
        if bf16_ops or fp32_ops:
            from ..precision.autocast import OpListAutocast

            autocast = OpListAutocast(bf16_ops, fp32_ops, device_type=self.type)  # re-entrant: built once
            return lambda: autocast
        return lambda: torch.autocast(device_type=self.type, dtype=torch.bfloat16)

    # ---- LLM kernels: None means the model's own code (transformers' sdpa for gaudi_fused_sdpa) ---------------

    def attention_kernel(self, options: Any) -> Callable[..., torch.Tensor] | None:
        """The fused attention kernel behind ``attn_implementation="gaudi_fused_sdpa"`` in the modes ``options``
        names (features/attention.py); None: transformers' own sdpa integration runs instead."""
        return None

    def rms_norm_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
        """A fused RMSNorm ``(hidden, weight, eps) -> normalized`` with Llama's result, or None."""
        return None

    def rotary_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """A fused rotate-half rotary embedding ``(x, cos, sin) -> x rotated``, cos/sin per position, or None."""
        return None

    def fp8_attention_builder(self, recompute: bool) -> Callable[[float | None, float], torch.nn.Module] | None:
        """--flash_attention_fp8: what builds one attention layer's fp8 attention from its scale and dropout;
        None where attention has no fp8 kernel (the flag changes nothing)."""
        return None

    def fsdp_problem(self) -> str | None:
        """Why --fsdp cannot run here, in one line; None when it can. FSDP2 overlaps its collectives on streams of
        the device's module and records events on them: torch 2.6's CPU streams have no ``record_event``."""
        if hasattr(torch.get_device_module(self.type).Stream, "record_event"):
            return None
        return (
            f"--fsdp on {self.type.upper()} needs torch 2.7 or newer (FSDP2 records events on the device's streams, "
            f"which torch {torch.__version__}'s {self.type.upper()} streams lack): train with DDP, or --deepspeed."
        )

    # ---- fp8 (precision/fp8.py): torchao's float8 training here, the Gaudi Transformer Engine on a Gaudi ------------

    def fp8_problem(self, compiling: bool = False) -> str | None:
        """Why --fp8 cannot train here, in one line; None when it can (``compiling``: with --torch_compile)."""
        if importlib.util.find_spec("torchao") is None:
            return f"--fp8 on {self.type.upper()} uses torchao's float8 training: pip install 'optimum-gaudi[fp8]'."
        return None

    def fp8_plan(self, minimize_memory: bool, compiling: bool, recipe: dict[str, Any] | None = None) -> Fp8Plan:
        """torchao's ``Float8Linear`` (dynamic per-tensor scaling, fp8 matmuls through ``torch._scaled_mm``).
        ``recipe``: the user's ``--fp8_recipe`` (delayed scaling, a Gaudi's), which dynamic scaling has no use for."""
        if recipe is not None:
            logger.warning("--fp8_recipe sets a Gaudi's delayed scaling; torchao scales dynamically here: ignored.")
        if minimize_memory:
            logger.warning(
                "--minimize_memory has no effect with torchao's float8 training (it keeps no fp8 weight copy)."
            )
        with quiet_logger(
            "torchao"
        ):  # its prebuilt CUDA extensions for another torch fail to load, harmlessly, at import
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(emulate=not has_fp8_matmul(self.type))
        if config.emulate:
            logger.info(
                "torch %s has no fp8 matmul on %s (torch 2.8 brought it): torchao rounds through fp8 and multiplies "
                "in higher precision, the same numerics.",
                torch.__version__,
                self.type.upper(),
            )

        def convert(model: torch.nn.Module, layers: set[torch.nn.Linear]) -> None:
            convert_to_float8_training(model, config=config, module_filter_fn=lambda module, _: module in layers)

        return Fp8Plan("torchao Float8Linear", convert)

    def wrap_for_training(self, model: torch.nn.Module, max_graphs: int | None) -> torch.nn.Module:
        """Graph-cache the training forward where the device can; elsewhere the model as it is."""
        return model

    def wrap_for_inference(
        self, model: torch.nn.Module, disable_tensor_cache: bool, max_graphs: int | None = None
    ) -> torch.nn.Module:
        """Replay the evaluation forward as a graph where the device can; elsewhere the model as it is."""
        return model

    def static_shapes(self, lazy_mode: bool) -> bool:
        """Whether to keep shapes fixed (inputs padded to buckets, a fixed-size generation cache): worth it
        only where each new shape compiles a new graph."""
        return False

    def capture_graph(self, fn: Callable[..., Any], static_inputs: tuple) -> tuple[Any, Callable[[], None]]:
        """Run `fn` once on `static_inputs`; return its outputs and a replay function that refreshes them.

        Without graph hardware, replay re-runs `fn` and copies the results into the same output tensors,
        which is what a replayed graph does to its static outputs. It re-runs in the grad mode of the capture:
        a captured training step (forward, backward, optimizer step) needs grad on.
        """
        grad_enabled = torch.is_grad_enabled()
        outputs = fn(*static_inputs)

        def replay() -> None:
            with torch.set_grad_enabled(grad_enabled):
                fresh = fn(*static_inputs)
            with torch.no_grad():
                _copy_into(outputs, fresh)

        return outputs, replay

    def make_graphed_callables(self, callables: Any, sample_args: tuple) -> Any:
        return callables

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        return [torch.profiler.ProfilerActivity.CPU]

    def memory_stats(self) -> dict[str, float]:
        """Memory in GB: allocated now, peak allocated, and total available."""
        raise NotImplementedError

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory, whoever uses it: what a bug report needs."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.type


GB = 1024**3


def unaliased_outputs(outputs: Any) -> Any:
    """A replayed graph's outputs, with each tensor cloned when grad is off.

    A replay writes into the same output tensors every call, and the evaluation loop keeps a batch's logits
    while the next batch replays. With grad on, backward uses the outputs before the next call.
    """
    if torch.is_grad_enabled():
        return outputs
    return tree_map_only(torch.Tensor, torch.clone, outputs)


_PLAIN = (torch.Tensor, type(None), bool, int, float, str, torch.dtype, torch.device)


def replayable(inputs: Any) -> bool:
    """Whether a graph captured with these inputs can be replayed for another call with them: tensors and plain
    values only (in dicts, lists and tuples). A replay runs the captured device ops without the forward's
    Python, so decisions the forward took from a stateful object's state at capture would be replayed as they
    were: a generation cache (transformers' encoder-decoder cache computes the cross-attention once and then
    flags it done; its static layers advance a position tensor), whatever the model."""
    if isinstance(inputs, dict):
        return all(replayable(value) for value in inputs.values())
    if isinstance(inputs, (list, tuple)):
        return all(replayable(value) for value in inputs)
    return isinstance(inputs, _PLAIN)


def private_inputs(inputs: Any) -> Any:
    """``inputs`` with a fresh copy of each tensor a replay would write into: those in dicts, lists and tuples,
    the structures the bridge's ``copy_to`` walks (``hpu/graphs.py``); anything else (a generation cache) is
    passed as it is.

    A graph wrapper keeps the tensors of its capture call as the graph's inputs and copies each later call's
    inputs into them. Given the caller's own tensors, the evaluation loop's kept labels and inputs of the first
    batch would be overwritten by every later one; given copies, only the graph owns them.
    """
    if isinstance(inputs, torch.Tensor):
        return inputs.clone()
    if isinstance(inputs, dict):
        copied = copy.copy(inputs)  # keeps the class (the bridge asserts a replay's types are the capture's)
        for key in inputs:
            copied[key] = private_inputs(inputs[key])
        return copied
    if isinstance(inputs, (list, tuple)) and not isinstance(inputs, torch.Size):
        items = [private_inputs(item) for item in inputs]
        return type(inputs)(*items) if hasattr(inputs, "_fields") else type(inputs)(items)
    return inputs


def _copy_into(static: Any, fresh: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (list, tuple)):
        for s, f in zip(static, fresh, strict=True):
            _copy_into(s, f)
    elif isinstance(static, dict):
        for key in static:
            _copy_into(static[key], fresh[key])
