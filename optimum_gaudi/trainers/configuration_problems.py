"""One place that says what is wrong with a run's configuration: each concern checks itself, and
``configuration_problems`` asks them in one fixed order. The training arguments raise the first problem as their
one-line error (so a command line with two mistakes is told the earlier one in this order).

The order:

1. the Gaudi flags' own values (the choices, the counts);
2. run supervision: the watchdog's timeouts, non-finite steps, loss spikes, stragglers;
3. execution: HPU Graphs' count, the gradient sync against DeepSpeed and FSDP, FSDP against graphs and lazy mode,
   DeepSpeed installed and its config there, ``--pipelining_fwd_bwd`` without lazy mode;
4. compilation: against HPU Graphs and lazy mode, dynamo's cache size, torch.compile's backend and mode;
5. attention (``features/attention.py``);
6. precision: the fp8 recipe (``precision/plan.py``);
7. the parallel layout: its degrees on the launched world, and context parallelism with the other flags
   (``distributed/layout.py``);
8. optimum-habana's flags that cannot act here;
9. transformers' own flags that it rejects late (batch sizes, numeric ranges, nothing to train);
10. FSDP on this transformers release;
11. the device, once it is detected: what it cannot run, fp8 on it, FSDP on it (``devices/``). Detection loads the
    Gaudi bridge, which reads its environment when it loads, so the arguments ask for 1-10 first, set that
    environment, detect, and ask again with the device (1-10 then have nothing to say).

What needs what transformers builds from the arguments (DeepSpeed's config, FSDP's plugin) is checked after it, in
``training_args.py``. Flags that are valid but do nothing with the others are said here too, once, as warnings
(``say_what_is_ignored``), never as problems.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import transformers

from ..devices import Device
from ..distributed.layout import argument_problem as layout_problem
from ..features import attention
from ..features.compilation import check_compile_flags, compile_choice_problem
from ..precision.plan import argument_problem as precision_problem
from ..supervision.nonfinite import ON_NONFINITE

logger = logging.getLogger(__name__)

DISTRIBUTION_STRATEGIES = ("ddp", "fast_ddp")
HALF_PRECISION_BACKENDS = ("auto", "hpu_amp", "cpu_amp")
FAST_DDP_DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_MAX_HPU_GRAPHS = 10  # ModuleCacher's default in the bridge (hpu/graphs.py)
COUNTS = (  # whole numbers >= 0
    "throughput_warmup_steps",
    "profiling_warmup_steps",
    "profiling_steps",
    "profiling_warmup_steps_eval",
    "profiling_steps_eval",
)
# (flag, lowest valid value, first invalid value above it or None): transformers passes these to torch unchecked.
NUMERIC_RANGES = (
    ("learning_rate", 0, None),
    ("weight_decay", 0, None),
    ("adam_beta1", 0, 1),
    ("adam_beta2", 0, 1),
    ("adam_epsilon", 0, None),
    ("dataloader_num_workers", 0, None),
)


def configuration_problems(args: Any, world_size: int, device: Device | None = None) -> Iterator[str]:
    """The problems of these arguments on ``world_size`` launched processes, one line each, in the module's order;
    the device's last, and only when ``device`` is given. Asked lazily: a caller that raises the first (the
    arguments do) asks no concern after it."""
    concerns: tuple[Callable[[Any, int], Iterator[str | None]], ...] = (
        _flag_values,
        _supervision,
        _execution,
        _compilation,
        lambda args, _: iter([attention.argument_problem(args)]),
        lambda args, _: iter([precision_problem(args)]),
        lambda args, world: iter([layout_problem(args, world)]),
        _optimum_habana_flags,
        _transformers_flags,
        _fsdp_release,
    )
    for concern in concerns:
        yield from (problem for problem in concern(args, world_size) if problem is not None)
    if device is not None:
        yield from (problem for problem in _device(args, device) if problem is not None)


def compile_flags(args: Any) -> str:
    """The flags that turn compilation on, as the user wrote them."""
    given = [f"--{name} {getattr(args, name)}" for name in ("torch_compile_mode", "torch_compile_backend")]
    given = [flag for flag in given if not flag.endswith(" None")]
    return f"{' '.join(given)} (which turns on --torch_compile)" if given else "--torch_compile"


# ---- the concerns, in order ------------------------------------------------------------------------------------


def _flag_values(args: Any, _: int) -> Iterator[str | None]:
    for name, choices in (
        ("distribution_strategy", DISTRIBUTION_STRATEGIES),
        ("fast_ddp_dtype", FAST_DDP_DTYPES),
        ("half_precision_backend", HALF_PRECISION_BACKENDS),
    ):
        if getattr(args, name) not in choices:
            yield f"--{name} must be one of {', '.join(choices)}, got '{getattr(args, name)}'."
    for name in COUNTS:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 0:
            yield f"--{name} must be a whole number >= 0, got {value!r}."


def _supervision(args: Any, _: int) -> Iterator[str | None]:
    if args.hang_timeout is not None and not args.hang_timeout >= 0:
        yield f"--hang_timeout must be >= 0 seconds (0 turns the watchdog off), got {args.hang_timeout}."
    if not args.hang_long_timeout > 0:
        yield f"--hang_long_timeout must be > 0 seconds, got {args.hang_long_timeout}."
    if args.on_nonfinite not in ON_NONFINITE:
        yield f"--on_nonfinite must be one of {', '.join(ON_NONFINITE)}, got '{args.on_nonfinite}'."
    if args.on_nonfinite == "skip" and args.deepspeed:
        yield (
            "--on_nonfinite skip cannot be combined with --deepspeed: DeepSpeed's engine steps the optimizer "
            "itself; use --on_nonfinite stop."
        )
    for name in ("max_nonfinite_skips", "loss_spike_window"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            yield f"--{name} must be a whole number >= 1, got {value!r}."
    for name in ("loss_spike_factor", "straggler_threshold"):
        if not getattr(args, name) >= 0:
            yield f"--{name} must be >= 0 (0: off), got {getattr(args, name)}."
    if args.loss_spike_factor and args.on_nonfinite == "ignore":
        yield "--loss_spike_factor handles a spike as --on_nonfinite says, and 'ignore' does nothing: use stop or skip."
    if 0 < args.loss_spike_factor <= 1:
        yield f"--loss_spike_factor {args.loss_spike_factor} would catch ordinary steps: give a factor > 1, or 0."


def _execution(args: Any, _: int) -> Iterator[str | None]:
    if not isinstance(args.max_hpu_graphs, int) or args.max_hpu_graphs < 1:
        yield f"--max_hpu_graphs must be >= 1 (default {DEFAULT_MAX_HPU_GRAPHS}), got {args.max_hpu_graphs!r}."
    if args.distribution_strategy == "fast_ddp" and (args.deepspeed or args.fsdp):
        engine = "--deepspeed" if args.deepspeed else "--fsdp"
        yield (
            f"--distribution_strategy fast_ddp replaces DDP and cannot be combined with {engine}; use the default "
            f"'ddp' strategy with {engine}."
        )
    if args.fsdp and (args.use_hpu_graphs_for_training or args.use_hpu_graphs_for_inference):
        graphs = (
            "--use_hpu_graphs_for_training" if args.use_hpu_graphs_for_training else "--use_hpu_graphs_for_inference"
        )
        yield (
            f"{graphs} cannot be combined with --fsdp: FSDP gathers each layer's parameters into fresh memory at "
            "every forward, which a replayed graph would not see; drop one (with FSDP, --torch_compile instead)."
        )
    if args.fsdp and args.use_lazy_mode:
        yield (
            "--use_lazy_mode cannot be combined with --fsdp: FSDP frees and regrows each gathered parameter's "
            "memory at every step, which a Gaudi's lazy kernels abort on (set_); train FSDP in eager mode (drop "
            "--use_lazy_mode, or pass --use_lazy_mode False; --torch_compile to compile)."
        )
    if args.deepspeed and importlib.util.find_spec("deepspeed") is None:
        yield "--deepspeed needs DeepSpeed: pip install deepspeed (on a Gaudi, Habana's DeepSpeed fork)."
    if isinstance(args.deepspeed, str) and not args.deepspeed.lstrip().startswith("{"):
        if not os.path.isfile(args.deepspeed):
            yield f"--deepspeed {args.deepspeed}: no such file; pass a DeepSpeed JSON config."
    if args.pipelining_fwd_bwd and not args.use_lazy_mode:
        yield "--pipelining_fwd_bwd adds a mark_step in lazy mode only; add --use_lazy_mode or drop --pipelining_fwd_bwd."


def _compilation(args: Any, _: int) -> Iterator[str | None]:
    if args.torch_compile and (args.use_hpu_graphs_for_training or args.use_hpu_graphs_for_inference):
        yield f"{compile_flags(args)} cannot be combined with HPU Graphs; choose compilation or --use_hpu_graphs_for_*."
    if args.torch_compile and args.use_lazy_mode:
        yield f"{compile_flags(args)} needs eager mode; drop --use_lazy_mode when compiling."
    if args.cache_size_limit is not None and args.cache_size_limit < 1:
        yield f"--cache_size_limit must be >= 1 (or unset for torch's default), got {args.cache_size_limit}."
    yield compile_choice_problem(args.torch_compile_backend, args.torch_compile_mode)


def _optimum_habana_flags(args: Any, _: int) -> Iterator[str | None]:
    """optimum-habana's fields that cannot act here and would make the run other than asked (those that can be
    dropped with one line are in ``say_what_is_ignored``)."""
    if args.use_compiled_autograd and not args.torch_compile:
        yield "--use_compiled_autograd compiles the backward of a compiled model; add --torch_compile or drop it."


def _transformers_flags(args: Any, _: int) -> Iterator[str | None]:
    """transformers' own flags that it rejects late (a traceback from inside the data loader or a callback)."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            yield f"--{name} must be a whole number >= 1, got {value!r}."
    for name, low, high in NUMERIC_RANGES:
        value = getattr(args, name)
        if value is not None and not (low <= value and (high is None or value < high)):
            bounds = f">= {low}" if high is None else f"in [{low}, {high})"
            yield f"--{name} must be {bounds}, got {value}."
    if args.do_train and args.max_steps <= 0 and args.num_train_epochs <= 0:
        yield "nothing to train: give --max_steps > 0 or --num_train_epochs > 0."


def _fsdp_release(args: Any, _: int) -> Iterator[str | None]:
    """--fsdp here is transformers 5's (FSDP2, its plugin arguments, sharded checkpoints, the streamed final save).
    On 4.57 accelerate's FSDP plugin stops a CPU run inside the Trainer ("There are currently no available devices
    found": sync_module_states wants an accelerator) and the final save needs 5.x's helpers: one line first."""
    if args.fsdp and int(transformers.__version__.split(".")[0]) < 5:
        yield (
            f"--fsdp needs transformers 5 here (this is {transformers.__version__}): pip install -U "
            "'transformers>=5', or train without --fsdp (DDP, or --deepspeed)."
        )


def _device(args: Any, device: Device) -> Iterator[str | None]:
    """The device's own checks (it may also warn about what it runs otherwise than asked)."""
    yield device.argument_problem(args)
    if args.fp8:
        yield device.fp8_problem(compiling=bool(args.torch_compile))
    if args.fsdp:  # after FSDP's settings are read: their own errors hold on any torch
        yield device.fsdp_problem()


# ---- what is ignored -------------------------------------------------------------------------------------------


def say_what_is_ignored(args: Any) -> None:
    """One warning for each flag that is valid but does nothing with the others (never a problem: the run is
    what was asked, without it)."""
    if args.minimize_memory and not args.fp8:
        logger.warning("--minimize_memory only acts with --fp8; it is ignored.")
    if args.fp8_recipe is not None and not args.fp8:
        logger.warning("--fp8_recipe only acts with --fp8; it is ignored.")
    check_compile_flags(args)
    if args.ignore_eos:
        logger.warning(
            "--ignore_eos does nothing here: generation is transformers' and stops at EOS (optimum-habana's "
            "Seq2Seq evaluation generated past it for static shapes; a Gaudi gets them from a static cache)."
        )
    if args.use_zero3_leaf_promotion:
        logger.warning(
            "--use_zero3_leaf_promotion is not applied by the trainer (in optimum-habana its scripts do it): with "
            "DeepSpeed ZeRO-3 call optimum_gaudi.distributed.apply_zero3_leaf_promotion(model) before the trainer."
        )
    if args.half_precision_backend != "auto" and not args.bf16:
        logger.warning(
            "--half_precision_backend %s has no effect without --bf16 or a Gaudi config with use_torch_autocast.",
            args.half_precision_backend,
        )
    graphs = args.use_hpu_graphs_for_training or args.use_hpu_graphs_for_inference
    if args.max_hpu_graphs != DEFAULT_MAX_HPU_GRAPHS and not graphs:
        logger.warning("--max_hpu_graphs is ignored without --use_hpu_graphs_for_training/inference.")
    if args.disable_tensor_cache_hpu_graphs and not args.use_hpu_graphs_for_inference:
        logger.warning("--disable_tensor_cache_hpu_graphs is ignored without --use_hpu_graphs_for_inference.")
    for flag in ("profiling_record_shapes", "profiling_with_stack"):
        if getattr(args, flag) and args.profiling_steps == 0 and args.profiling_steps_eval == 0:
            logger.warning("--%s is ignored while --profiling_steps and --profiling_steps_eval are 0.", flag)
    if args.profiling_warmup_steps_eval and not args.profiling_steps_eval:
        logger.warning("--profiling_warmup_steps_eval is ignored while --profiling_steps_eval is 0.")
