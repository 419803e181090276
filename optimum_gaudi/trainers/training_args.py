"""GaudiTrainingArguments: transformers' TrainingArguments plus the Gaudi flags, checked at construction.

``__post_init__`` parses, asks ``configuration_problems`` (one order, every concern's own check) and raises the
first problem as one line, before a model is ever loaded; what depends on the device is settled here, once. Its
one process-wide effect is the bridge's: the bridge reads its PT_HPU_* variables when first imported, so they
are set before detection imports it. The others (dynamo's options, the attention registry, the collective
backend, ...) are ``prepare_process``'s, applied where the process's device is set up.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch
import transformers
from transformers import TrainingArguments

from ..configuration.gaudi_config import GaudiConfig
from ..devices import CPUDevice, Device, check_torch_release, detect_device
from ..devices.hpu import bridge_installed, prepare_bridge
from ..distributed.fsdp import fsdp2_config, read_fsdp_config
from ..distributed.host_group import honour_timeout
from ..distributed.layout import ParallelLayout
from ..errors import UserError, install_excepthook
from ..features import attention
from ..features.compilation import apply_dynamo_options
from ..launch.ranks import enable_flight_recorder
from ..precision.op_lists import config_uses_op_lists, resolve_op_lists
from ..supervision import collective_count
from .configuration_problems import (
    DEFAULT_MAX_HPU_GRAPHS,
    DISTRIBUTION_STRATEGIES,
    FAST_DDP_DTYPES,
    HALF_PRECISION_BACKENDS,
    configuration_problems,
    say_what_is_ignored,
)
from .removed_args import RemovedTrainingArguments, apply_removed_arguments, removed_environment
from .use_cache import UseCacheOffTheCommandLine

logger = logging.getLogger(__name__)

# Every script builds these arguments: one that has no handler of ours (optimum-habana's, unchanged) then ends on a
# user error's one line, as the project's own examples end, not on a traceback ending in it.
install_excepthook()

# The FSDP version transformers runs when --fsdp_config names none: FSDP2 from transformers 5, FSDP1 before.
_FSDP_DEFAULT_VERSION = 2 if int(transformers.__version__.split(".")[0]) >= 5 else 1


class GaudiArgumentError(UserError, ValueError):
    """A Gaudi flag, or a combination of flags, that cannot work; the message says how to fix it."""


@dataclass
class GaudiTrainingArgumentsMixin(RemovedTrainingArguments, UseCacheOffTheCommandLine):
    """The Gaudi fields and their checks, for any TrainingArguments subclass: put it first, e.g.
    ``@dataclass class MyArgs(GaudiTrainingArgumentsMixin, Seq2SeqTrainingArguments)``. On a machine without
    a Gaudi the same flags still parse and the run falls back to CUDA or CPU (see the feature table logged
    at start-up)."""

    use_habana: bool = field(
        default=False,
        metadata={"help": "Train on a Habana Gaudi (HPU); falls back with a warning where there is none."},
    )
    use_lazy_mode: bool = field(
        default=False, metadata={"help": "HPU lazy mode: queue ops and run them as graphs at each mark_step."}
    )
    gaudi_config_name: str | None = field(
        default=None,
        metadata={
            "help": "Gaudi config: a JSON file, a directory with gaudi_config.json, a bundled name (e.g. gpt2, Habana/gpt2) or a Hub repo."
        },
    )
    use_hpu_graphs_for_training: bool = field(
        default=False, metadata={"help": "Wrap the model in HPU Graphs (ModuleCacher) for training."}
    )
    use_hpu_graphs_for_inference: bool = field(
        default=False, metadata={"help": "Wrap the model in HPU Graphs for evaluation and prediction."}
    )
    max_hpu_graphs: int = field(
        default=DEFAULT_MAX_HPU_GRAPHS,
        metadata={
            "help": "Most HPU Graphs kept per model (one per input shape), for training (ModuleCacher) and for "
            "evaluation (wrap_in_hpu_graph); forwards of other shapes run without a graph. Default: 10, the "
            "bridge's own ModuleCacher default."
        },
    )
    disable_tensor_cache_hpu_graphs: bool = field(
        default=False, metadata={"help": "Do not cache graph tensors in inference HPU Graphs (saves memory)."}
    )
    distribution_strategy: str = field(
        default="ddp",
        metadata={
            "help": "Multi-card gradient sync: 'ddp' (DistributedDataParallel) or 'fast_ddp' (one fused all-reduce).",
            "choices": list(DISTRIBUTION_STRATEGIES),
        },
    )
    fast_ddp_dtype: str = field(
        default="auto",
        metadata={
            "help": "fast_ddp fusion-buffer dtype: 'auto' (bf16 on HPU, float32 elsewhere), 'float32' or 'bfloat16'.",
            "choices": list(FAST_DDP_DTYPES),
        },
    )
    throughput_warmup_steps: int = field(
        default=0, metadata={"help": "First optimizer steps left out of the throughput (compilation, warm-up)."}
    )
    pipelining_fwd_bwd: bool = field(
        default=False, metadata={"help": "Lazy mode: extra mark_step after forward so host and device overlap."}
    )
    non_blocking_data_copy: bool = field(default=False, metadata={"help": "Copy batches to the device asynchronously."})
    half_precision_backend: str = field(
        default="auto",
        metadata={
            "help": "Where bf16 autocast runs: 'auto' (the training device), 'hpu_amp' or 'cpu_amp'.",
            "choices": list(HALF_PRECISION_BACKENDS),
        },
    )
    use_regional_compilation: bool = field(
        default=False,
        metadata={
            "help": "With --torch_compile: compile the repeated block (decoder layer) once, not the whole model."
        },
    )
    compile_dynamic: bool | None = field(
        default=None, metadata={"help": "With --torch_compile: torch.compile(dynamic=...); unset lets torch decide."}
    )
    compile_from_sec_iteration: bool = field(
        default=False, metadata={"help": "With --torch_compile: run the first training iteration eagerly."}
    )
    cache_size_limit: int | None = field(
        default=None, metadata={"help": "With --torch_compile: most graphs dynamo keeps per function (process-wide)."}
    )
    profiling_warmup_steps: int = field(default=0, metadata={"help": "Steps to skip before profiling starts."})
    profiling_steps: int = field(
        default=0, metadata={"help": "Steps to profile with torch.profiler (0 disables profiling)."}
    )
    profiling_record_shapes: bool = field(
        default=False, metadata={"help": "Record tensor shapes in the profiler trace."}
    )
    profiling_with_stack: bool = field(default=False, metadata={"help": "Record Python stacks in the profiler trace."})
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention implementation the trainer sets on the model: 'gaudi_fused_sdpa' (Gaudi's FusedSDPA; "
            "transformers' sdpa on CPU/CUDA), or any transformers name ('sdpa', 'eager', ...). Unset: the model's own."
        },
    )
    flash_attention_recompute: bool = field(
        default=False, metadata={"help": "gaudi_fused_sdpa: recompute attention in the backward (less memory)."}
    )
    flash_attention_causal_mask: bool = field(
        default=False,
        metadata={
            "help": "gaudi_fused_sdpa: the kernel's causal mode instead of the padding mask (exact for right padding)."
        },
    )
    flash_attention_fast_softmax: bool = field(
        default=False, metadata={"help": "gaudi_fused_sdpa: the kernel's fast (lower precision) softmax."}
    )
    flash_attention_fp8: bool = field(
        default=False, metadata={"help": "With --fp8 on a Gaudi 3: gaudi_fused_sdpa in fp8 (Transformer Engine)."}
    )
    sdp_on_bf16: bool = field(
        default=False, metadata={"help": "Let torch's math SDPA reduce in bf16/fp16 (torch's process-wide switch)."}
    )
    fp8: bool = field(
        default=False,
        metadata={"help": "fp8 linear layers: Intel's Gaudi Transformer Engine on a Gaudi, torchao on CPU/CUDA."},
    )
    minimize_memory: bool = field(default=False, metadata={"help": "With --fp8: keep fewer fp8 weight copies."})
    fp8_recipe: str | None = field(
        default=None,
        metadata={
            "help": "With --fp8 on a Gaudi: the Transformer Engine's delayed-scaling recipe, JSON text or a JSON file "
            "(keys margin, interval, fp8_format, amax_history_len, amax_compute_algo, reduce_amax); default "
            '{"interval": 16, "amax_history_len": 1, "amax_compute_algo": "most_recent", "reduce_amax": false}, '
            "optimum-habana's."
        },
    )
    use_fused_linear_cross_entropy: bool = field(
        default=False,
        metadata={
            "help": "Training loss of a causal LM from its hidden states in chunks, never holding [tokens, vocabulary]"
            " logits (also the Gaudi config's use_fused_linear_cross_entropy)."
        },
    )
    ignore_plan: bool = field(
        default=False,
        metadata={"help": "Train even where the memory plan (optimum-gaudi plan) does not fit the card."},
    )
    # ---- optimum-habana's other fields: same names and meanings (docs/optimum-habana.md says what each does here)
    use_hpu_graphs: bool = field(
        default=False,
        metadata={"help": "Deprecated (as in optimum-habana): use --use_hpu_graphs_for_inference, which it turns on."},
    )
    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Processes each sequence is split over (Ulysses sequence parallelism: attention heads spread by "
            "all-to-all); they train the same batches, so the data-parallel world is world_size / N."
        },
    )
    adjust_throughput: bool = field(
        default=False,
        metadata={"help": "Leave the time spent evaluating, logging and saving out of the training throughput."},
    )
    log_throughput_and_memory: bool | None = field(
        default=None,
        metadata={
            "help": "Add the Gaudi metrics to the logs: speed after --throughput_warmup_steps over the whole run "
            "(train_throughput_steps, ...), speed since the previous log (interval_samples_per_second, "
            "interval_tokens_per_second) and device memory (memory_allocated (GB), ...). Unset: on with --use_habana, "
            "--throughput_warmup_steps > 0 or --adjust_throughput; otherwise off, and the logs hold exactly "
            "transformers.Trainer's keys (multi-process runs add the slowest and fastest rank's step times, "
            "see --straggler_threshold)."
        },
    )
    ignore_eos: bool = field(
        default=False,
        metadata={
            "help": "optimum-habana: generate past EOS in Seq2Seq evaluation (its default: True). Here generation "
            "is transformers' and stops at EOS; the flag is accepted and said to do nothing."
        },
    )
    profiling_warmup_steps_eval: int = field(
        default=0, metadata={"help": "Evaluation batches to skip before the evaluation profiler starts."}
    )
    profiling_steps_eval: int = field(
        default=0, metadata={"help": "Evaluation batches to profile with torch.profiler (0 disables it)."}
    )
    use_compiled_autograd: bool = field(
        default=False,
        metadata={"help": "With --torch_compile: compile the backward too (torch._dynamo.config.compiled_autograd)."},
    )
    use_zero3_leaf_promotion: bool = field(
        default=False,
        metadata={
            "help": "optimum-habana's scripts then mark the decoder layers as DeepSpeed ZeRO-3 leaf modules; call "
            "deepspeed.utils.set_z3_leaf_modules in your script (the trainer does not)."
        },
    )
    inline_inbuilt_nn_modules: bool | None = field(
        default=None, metadata={"help": "Sets torch._dynamo.config.inline_inbuilt_nn_modules (unset: torch's)."}
    )
    allow_unspec_int_on_nn_module: bool | None = field(
        default=None, metadata={"help": "Sets torch._dynamo.config.allow_unspec_int_on_nn_module (unset: torch's)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start over in an --output_dir that holds checkpoints of another run (they are deleted)."},
    )
    async_save: bool = field(
        default=False,
        metadata={
            "help": "With --fsdp: write each checkpoint's shards in the background while training goes on "
            "(torch.distributed.checkpoint.async_save); the checkpoint is published once they are written."
        },
    )

    hang_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds a rank may make no progress before the job ends with every rank's stacks in "
            "<output_dir>/hang-<time>/ (restarted with optimum-gaudi launch --max_restarts). Multi-process runs only; "
            "default: 10x the slowest step, 2x the slowest save or evaluation, at least 60 s. The first step, saves, "
            "evaluations and compilations (on a Gaudi also steps 2-3 of each process and steps with new input "
            "shapes) have --hang_long_timeout. 0 turns it off."
        },
    )
    hang_long_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds at least that the first step, a save, an evaluation or a compilation may last before "
            "the watchdog ends the job (also at least --hang_timeout's limit; each kind of window also twice the "
            "longest of its kind measured in the run). HCCL groups have no timeout: on a Gaudi nothing else ends a "
            "hang there."
        },
    )
    on_nonfinite: str = field(
        default="stop",
        metadata={
            "help": "A NaN or inf loss or gradient norm: 'stop' the run at once with one line (step, rank, which), "
            "or 'skip' the step (optimizer, scheduler and gradient scaler untouched), at most --max_nonfinite_skips "
            "times in a row; checkpoints whose weights hold a NaN or inf are then never written. 'ignore': "
            "transformers' own behaviour (training goes on, the loss is logged as it is). Steps fp16's gradient "
            "scaler skips for overflowing are left to it."
        },
    )
    max_nonfinite_skips: int = field(
        default=10, metadata={"help": "With --on_nonfinite skip: the steps that may be skipped in a row."}
    )
    loss_spike_factor: float = field(
        default=0.0,
        metadata={
            "help": "Handle a loss above this many times the running median of the last --loss_spike_window "
            "steps as --on_nonfinite says (0: off; one scalar all-reduce per step on several processes)."
        },
    )
    loss_spike_window: int = field(default=100, metadata={"help": "Steps in --loss_spike_factor's running median."})
    straggler_threshold: float = field(
        default=0.2,
        metadata={
            "help": "Multi-process runs: name once a rank whose step time (outside backward) stays this fraction "
            "above the median rank's for 3 logging steps (0: never). The slowest and fastest rank are logged at "
            "each logging step either way."
        },
    )

    def __post_init__(self) -> None:
        """Parse the flags, check them (``configuration_problems``, the first problem raised as one line) and settle
        what depends on the device. The one process-wide effect left here is the bridge's: its environment, then
        detection, which loads it (the device's checks need the device, and the bridge reads its variables when it
        loads). The rest is ``prepare_process``'s, applied where the process's device is set up."""
        check_torch_release()
        apply_removed_arguments(self)  # transformers 4's arguments on optimum-habana command lines, first
        if self.log_throughput_and_memory is None:  # a metrics feature asked for, or a Gaudi run (as optimum-habana)
            self.log_throughput_and_memory = (
                self.use_habana or self.throughput_warmup_steps > 0 or self.adjust_throughput
            )
        _paged_adamw_without_bitsandbytes(self)
        # TrainingArguments.__post_init__ would turn torch_compile on from its mode or backend, but only after
        # the checks below ran; apply its rule first so they see the flag the run will really have.
        if self.torch_compile_mode is not None or self.torch_compile_backend is not None:
            self.torch_compile = True
        if self.use_hpu_graphs:
            warnings.warn(
                "--use_hpu_graphs is deprecated (as in optimum-habana): it now turns on --use_hpu_graphs_for_inference;"
                " pass that (or --use_hpu_graphs_for_training) instead.",
                FutureWarning,
                stacklevel=2,
            )
            self.use_hpu_graphs_for_inference = True
        world_size = _launched_world_size()  # read once: the layout keeps it (self.parallel_layout.world_size)
        _raise_first(configuration_problems(self, world_size))  # the flags alone, before the bridge loads
        say_what_is_ignored(self)
        self.gaudi_config = GaudiConfig.from_pretrained(self.gaudi_config_name) if self.gaudi_config_name else None
        self._set_bridge_environment()  # before detection loads the bridge
        self.gaudi_device: Device = detect_device(use_habana=self.use_habana, use_cpu=self.use_cpu)
        if self.fsdp:  # optimum-habana's fsdp_config.json (FSDP1's keys) as FSDP2 settings transformers reads
            self.fsdp_config = fsdp2_config(read_fsdp_config(self.fsdp_config), _FSDP_DEFAULT_VERSION)
        _raise_first(configuration_problems(self, world_size, self.gaudi_device))  # now the device's too
        self._settle_on_the_device(world_size)
        super().__post_init__()  # transformers' own checks; it sets the device up (_setup_devices: prepare_process)
        self._check_deepspeed_config()
        self._sharded_checkpoints()
        if self.non_blocking_data_copy:
            self.accelerator_config.non_blocking = True

    def _settle_on_the_device(self, world_size: int) -> None:
        """What the device decides for the arguments, before transformers reads them: where autocast runs, the
        CPU as transformers' --use_cpu, the collective backend, the layout and its context parallelism, the
        compile backend."""
        # cpu_amp: autocast on the host even when the model trains on an accelerator
        self.autocast_device: Device = CPUDevice() if self.half_precision_backend == "cpu_amp" else self.gaudi_device
        if self.gaudi_device.on_host:
            self.use_cpu = True  # lets transformers accept --bf16 on CPU instead of demanding a GPU
        if world_size > 1:  # launched on several processes
            self.ddp_backend = self.ddp_backend or self.gaudi_device.ddp_backend
        # every degree of the run, and the one choice of context parallelism (distributed/layout.py)
        self.parallel_layout = ParallelLayout.from_arguments(self, world_size)
        config = self.parallel_layout.parallelism_config()  # torch's context parallelism, as accelerate runs it
        if config is not None and getattr(self, "parallelism_config", None) is None:  # a user's own is kept
            self.parallelism_config = config
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = self.gaudi_device.compile_backend
        elif self.torch_compile_backend == "hpu_backend" != self.gaudi_device.compile_backend:
            logger.warning(  # an optimum-habana command line, run where there is no Gaudi
                "--torch_compile_backend hpu_backend is the Gaudi's; on %s torch.compile uses %s.",
                self.gaudi_device.type.upper(),
                self.gaudi_device.compile_backend,
            )
            self.torch_compile_backend = self.gaudi_device.compile_backend

    def prepare_process(self) -> None:
        """This run's process-wide settings, each safe to apply again: dynamo's options, torch's math-SDPA switch,
        TensorBoard's variable for transformers 4's --logging_dir. Applied where the run starts, by the trainer's
        constructor before the parent Trainer's (whose callbacks read the variable): building the arguments
        changes nothing outside them."""
        apply_dynamo_options(self)
        attention.prepare(self)
        os.environ.update(removed_environment(self))

    def _prepare_collectives(self) -> None:
        """On several processes, the device's collective backend and torch's flight recorder: needed before the
        default process group starts, which transformers' device setup makes."""
        if self.parallel_layout.world_size > 1:
            self.gaudi_device.register_ddp_backend()
            if self.hang_timeout != 0:
                # the watchdog's report names the collective each rank waits in
                enable_flight_recorder(nccl_variable=not collective_count.generic_flight_recorder())

    @functools.cached_property
    def _setup_devices(self) -> torch.device:
        """transformers' device setup (which makes the default process group) after the collectives' backend is
        registered, then --ddp_timeout given to that group where transformers left it out (on the CPU)."""
        self._prepare_collectives()
        device = super()._setup_devices
        honour_timeout(self.ddp_timeout)
        return device

    def gaudi_flags(self) -> dict[str, object]:
        """The Gaudi flags and their values, for the run's log."""
        removed = {f.name for f in (*fields(RemovedTrainingArguments), *fields(UseCacheOffTheCommandLine))}
        return {f.name: getattr(self, f.name) for f in fields(GaudiTrainingArgumentsMixin) if f.name not in removed}

    @property
    def fast_ddp_torch_dtype(self) -> torch.dtype:
        """The fusion buffer's dtype: bf16 on HPU unless asked otherwise (half the bytes on the wire)."""
        name = self.fast_ddp_dtype
        if name == "auto":
            name = self.gaudi_device.fast_ddp_dtype
        return getattr(torch, name)

    # ---- checks -------------------------------------------------------------------------------------

    def _sharded_checkpoints(self) -> None:
        """Under --fsdp each rank writes its shards of a checkpoint (SHARDED_STATE_DICT, resharded on load) unless
        the fsdp_config names a state_dict_type (FULL_STATE_DICT: rank 0 gathers and writes everything) or
        --save_only_model asks for what sharded checkpoints cannot be. --async_save needs sharded ones."""
        plugin = getattr(self, "fsdp_plugin_args", None)
        fsdp2 = plugin is not None and plugin.get("fsdp_version") == 2  # FSDP1's final save writes no sharded model
        if fsdp2 and "state_dict_type" not in self.fsdp_config and not self.save_only_model:
            plugin["state_dict_type"] = self.fsdp_config["state_dict_type"] = "SHARDED_STATE_DICT"
        if self.async_save and (plugin is None or str(plugin.get("state_dict_type")).upper() != "SHARDED_STATE_DICT"):
            raise GaudiArgumentError(
                "--async_save writes FSDP's sharded checkpoints in the background: add --fsdp, with the fsdp_config "
                'state_dict_type "SHARDED_STATE_DICT" (the default), or drop --async_save.'
            )
        if self.async_save and self.load_best_model_at_end:
            raise GaudiArgumentError(
                "--async_save with --load_best_model_at_end: the best checkpoint may still be written in the "
                "background when training ends and the best model is loaded; drop one of them."
            )

    def _check_deepspeed_config(self) -> None:
        """transformers reports a DeepSpeed config value that disagrees with the arguments (e.g. "bf16": {"enabled":
        true} without --bf16) only once training starts, after the model is loaded: say it now, in one line."""
        ds_config = getattr(self, "hf_deepspeed_config", None)
        if ds_config is None:
            return
        if ds_config.mismatches:
            found = "; ".join(m.lstrip("- ") for m in ds_config.mismatches)
            source = self.deepspeed if isinstance(self.deepspeed, str) else "config"
            raise GaudiArgumentError(
                f"--deepspeed {source} disagrees with the training arguments ({found}); set those values to "
                '"auto" in the config or pass matching arguments (the bundled configs train in bf16: add --bf16).'
            )
        self._keep_torch_linear_under_zero3(ds_config.config.get("zero_optimization") or {})

    def _keep_torch_linear_under_zero3(self, zero: dict) -> None:
        """ZeRO-3 swaps F.linear for its own function, whose backward re-enters torch.autocast and nothing else. The
        op-list autocast of devices whose torch.autocast cannot follow the lists is a TorchFunctionMode: that
        backward would mix bf16 and float32, so ZeRO-3 keeps torch's linear ("memory_efficient_linear": false)."""
        config = self.gaudi_config
        if zero.get("stage") != 3 or config is None or not (config.autocast_bf16_ops or config.autocast_fp32_ops):
            return
        autocast = self.autocast_device.autocast_factory(config.autocast_bf16_ops, config.autocast_fp32_ops)()
        if isinstance(autocast, torch.autocast):  # DeepSpeed's backward re-enters it
            return
        if zero.get("memory_efficient_linear"):
            raise GaudiArgumentError(
                '--deepspeed: "memory_efficient_linear": true (ZeRO-3) cannot run with the Gaudi config\'s autocast op '
                f"lists on {self.autocast_device.type}; remove that key or set it to false."
            )
        zero["memory_efficient_linear"] = False

    def _set_bridge_environment(self) -> None:
        """Lazy mode, the autocast op lists and dynamic shapes reach the bridge: set before it loads, or checked
        against the loaded bridge's own answer (Gaudi software 1.21+ loads it during `import torch`)."""
        if not bridge_installed():
            os.environ["PT_HPU_LAZY_MODE"] = "1" if self.use_lazy_mode else "0"  # for a bridge Python finds later
            return
        config = self.gaudi_config
        op_lists = None
        if config is not None and config_uses_op_lists(config):
            op_lists = resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops)
        dynamic_shapes = None if config is None else config.use_dynamic_shapes
        problem = prepare_bridge(self.use_lazy_mode, op_lists, dynamic_shapes)
        if problem is not None:
            raise GaudiArgumentError(problem)


@dataclass
class GaudiTrainingArguments(GaudiTrainingArgumentsMixin, TrainingArguments):
    """TrainingArguments with Habana Gaudi options: GaudiTrainingArgumentsMixin + TrainingArguments."""


# Package to install for each --report_to integration transformers offers.
_REPORT_TO_PACKAGES = {
    "tensorboard": "pip install 'optimum-gaudi[tensorboard]' (or: pip install tensorboard)",
    "azure_ml": "pip install azureml-core",
    "flyte": "pip install flytekit",
}


def _launched_world_size() -> int:
    """The number of processes the launcher (torchrun, ours, mpirun) started: 1 without one. Read once, when the
    arguments are built (the layout keeps it). Under mpirun also its own variable, which the bridge's hccl module
    copies to WORLD_SIZE when it loads, as accelerate reads it on the CPU: the world is the one the run's process
    group will have."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))


def _raise_first(problems: Iterator[str]) -> None:
    """The first of the configuration's problems, as the arguments' one-line error."""
    problem = next(iter(problems), None)
    if problem is not None:
        raise GaudiArgumentError(problem)


def _paged_adamw_without_bitsandbytes(args: TrainingArguments) -> None:
    """optimum-habana's TRL command lines pass --optim paged_adamw_32bit, bitsandbytes' AdamW whose state pages
    out to host memory under pressure: the update is AdamW's (on a Gaudi its scripts' use_fused_adam trains with
    Habana's fused AdamW instead). Where bitsandbytes is not installed the run takes torch's AdamW, with one line."""
    optim = getattr(args.optim, "value", args.optim)
    if optim != "paged_adamw_32bit" or importlib.util.find_spec("bitsandbytes") is not None:
        return
    args.optim = "adamw_torch"
    logger.warning(
        "--optim paged_adamw_32bit needs bitsandbytes, which is not installed: training with adamw_torch, the same "
        "AdamW update without paging its state to host memory."
    )


def check_report_to(args: TrainingArguments) -> None:
    """One line for a --report_to integration that is unknown or not installed, raised when the trainer is built:
    transformers lets such arguments exist (they serialize, a script may only read them) and fails there, with
    a traceback."""
    requested = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
    requested = [name.strip() for name in requested if name.strip() not in ("all", "none")]
    if not requested:
        return
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    installed = set(get_available_reporting_integrations())
    for name in requested:
        if name not in INTEGRATION_TO_CALLBACK:
            raise GaudiArgumentError(  # transformers' words first (get_reporting_integration_callbacks')
                f"{name} is not supported, only {', '.join(INTEGRATION_TO_CALLBACK.keys())} are supported. "
                f"--report_to {name} is not an integration transformers knows; use one of them, 'all' or 'none'."
            )
        if name not in installed:
            install = _REPORT_TO_PACKAGES.get(name, f"pip install {name}")
            raise GaudiArgumentError(f"--report_to {name} needs {name}, which is not installed: {install}.")
