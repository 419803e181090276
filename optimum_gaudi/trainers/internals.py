"""Every private attribute or internal of another library that this package reads or writes, in one list, checked
when a trainer is built.

The Gaudi features lean on a few internals of transformers, accelerate, peft, TRL and torch (private names such as
``PartialState._shared_state``, state other code does not expect written, such as accelerate's sampler shards'
``num_processes``, Llama's rotary function recognised by its source text), and patch some public names: a method or
function replaced by ours (``Accelerator.unwrap_model`` on the run's accelerator, torch's collectives while they are
counted), or a setting written after its owner was built (the FSDP plugin's ``mixed_precision_policy``). A release that renames or retypes one
would otherwise fail far from the cause, or silently train without the feature. :func:`check_internals` looks each
one up (presence, and the kind of thing it is) and fails in one line naming the first that changed; entries of an
optional library are checked where that library is loaded, entries of a feature where the feature is on.
``tests/unit/trainers/test_internals.py`` checks that the list matches the code: each private name of another library the package
uses is listed, with the file that uses it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..supervision.collective_count import COLLECTIVES
from .compat import TRAINER_HOOKS

# What an internal is, and how its presence is checked without an instance at hand:
#   module / class / callable / dict: the attribute of the owner, of that type
#   attribute: any attribute of the owner (a property, a class attribute)
#   instance: an attribute the owner's instances get at run time: named as ``.name`` in the owner's source
#   source: a function whose source text is compared with a model's (inspect.getsource must read it)
KINDS = ("module", "class", "callable", "dict", "attribute", "instance", "source")


@dataclass(frozen=True)
class Internal:
    """One internal: ``owner.name`` (owner: a module, or a class given as ``module:Class``), what it is, which of
    our files use it (paths under optimum_gaudi/), why, when it is checked (a key of :data:`CONDITIONS`), and
    whether our code copes with its absence (``required=False``: only its type is checked where it exists)."""

    owner: str
    name: str
    kind: str
    used_by: tuple[str, ...]
    why: str
    when: str = "always"
    required: bool = True

    @property
    def library(self) -> str:
        return self.owner.split(":")[0].split(".")[0]

    @property
    def label(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


# When an entry is checked: always (its library is a dependency and already loaded by transformers), where its
# optional library is loaded (the trainer that uses it imported it), or where the feature that uses it is on.
# Each condition is given the training arguments and the Gaudi config.
CONDITIONS: dict[str, Callable[[Any, Any], bool]] = {
    "always": lambda args, config: True,
    "loaded": lambda args, config: False,  # checked only where something imported the owner's module (see due)
    "compile": lambda args, config: bool(getattr(args, "torch_compile", False)),
    "llm_kernels": lambda args, config: bool(config.use_fused_rms_norm or config.use_fused_rope),
}

_T, _ACC, _C10D = "transformers:Trainer", "accelerate.state", "torch.distributed.distributed_c10d"

INTERNALS: tuple[Internal, ...] = (
    # ---- transformers ----------------------------------------------------------------------------------------
    Internal(_T, "_total_loss_scalar", "instance", ("trainers/checkpointing.py",),
             "written on resume: train_loss over the whole run, as the uninterrupted run reports it"),
    Internal(_T, "_initial_global_step", "instance", ("trainers/checkpointing.py",),
             "written on resume: transformers 5 divides the loss sum by global_step minus it", required=False),
    Internal(_T, "_tr_loss", "instance", ("trainers/checkpointing.py",),
             "read: the loss not yet logged, in the run totals a checkpoint keeps (transformers 5)", required=False),
    Internal(_T, "_train_batch_size", "instance", ("trainers/step.py",),
             "read: the batch size static batches pad a short batch up to"),
    Internal(_T, "_prepare_inputs", "callable", ("trainers/step.py",),
             "called: inputs moved as the Trainer moves them, for graph capture and the sequence split"),
    Internal("transformers:TrainingArguments", "_setup_devices", "attribute", ("trainers/training_args.py",),
             "overridden: --ddp_timeout given to the default process group where transformers leaves it out"),
    Internal("transformers.trainer_seq2seq:Seq2SeqTrainer", "_gen_kwargs", "instance", ("trainers/seq2seq.py",),
             "read: the generation arguments evaluate() was given, for static-shape generation", "loaded", False),
    Internal("transformers.trainer_seq2seq:Seq2SeqTrainer", "_pad_tensors_to_max_len", "callable",
             ("trainers/seq2seq.py",), "called: generated tokens padded as Seq2SeqTrainer pads them", "loaded"),
    Internal("transformers:PretrainedConfig", "_attn_implementation", "attribute",
             ("seam.py", "distributed/sequence_parallel.py"),
             "read: the attention implementation a model runs, before the seam sets another"),
    Internal("transformers:AttentionInterface", "_global_mapping", "dict", ("distributed/sequence_parallel.py",),
             "an entry removed: a split's attention once no model runs it (the registry has no unregister)"),
    Internal("transformers.masking_utils:AttentionMaskInterface", "_global_mapping", "dict",
             ("distributed/sequence_parallel.py",), "an entry removed: a split's mask function, with its attention"),
    Internal("transformers:PreTrainedModel", "_no_split_modules", "attribute", ("distributed/fsdp.py",),
             "read: the blocks a model names, for FSDP's error line"),
    Internal("transformers:PreTrainedModel", "_keys_to_ignore_on_save", "attribute",
             ("checkpoints/fit.py", "distributed/full_weights.py"), "read: weights transformers never saves"),
    Internal("transformers:PreTrainedModel", "loss_function", "attribute", ("seam.py",),
             "replaced per model through its setter: the seam's contributions (pinned, compiled, fused, real rows)"),
    Internal("transformers:PreTrainedModel", "_loss_function", "instance",
             ("features/compilation.py", "seam.py"),
             "written and removed: the loss function's seam (pinned, compiled, fused, static batches' real rows)"),
    Internal("transformers.modeling_layers", "_gradient_checkpointing_func", "instance", ("precision/fp8.py",),
             "wrapped: layers recomputed under gradient checkpointing recompute in fp8 too"),
    Internal("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb", "source", ("features/kernels.py",),
             "source text: a model's rotary function that is Llama's gets the fused kernel; replaced in its modeling "
             "module by one that runs the kernel inside the fused layers", "llm_kernels"),
    Internal("transformers.models.llama.modeling_llama:LlamaRMSNorm", "forward", "source", ("features/kernels.py",),
             "source text: an RMSNorm whose forward is Llama's gets the fused kernel", "llm_kernels"),
    Internal("transformers.trainer_pt_utils:AcceleratorConfig", "non_blocking", "attribute",
             ("trainers/training_args.py",), "written: --non_blocking_data_copy, read when the Accelerator is made"),
    # ---- accelerate ------------------------------------------------------------------------------------------
    Internal("accelerate:Accelerator", "unwrap_model", "callable", ("distributed/fast_ddp.py",),
             "replaced on the run's Accelerator: fast_ddp's marker taken off before accelerate's own unwrapping"),
    Internal("accelerate:Accelerator", "clip_grad_norm_", "callable", ("trainers/compat.py",),
             "replaced on the run's Accelerator (transformers < 5.3): the loop's clipping goes through _clip_grad_norm"),
    Internal("accelerate.optimizer:AcceleratedOptimizer", "step", "callable", ("supervision/nonfinite.py",),
             "replaced for one step: a skipped non-finite step is a no-op"),
    Internal("accelerate.utils:FullyShardedDataParallelPlugin", "transformer_cls_names_to_wrap", "attribute",
             ("distributed/fsdp.py",), "written after the plugin is made: the layer classes this model has"),
    Internal("accelerate.utils:FullyShardedDataParallelPlugin", "mixed_precision_policy", "attribute",
             ("distributed/fsdp.py",), "written after the plugin is made: FSDP2's policy from the precision plan"),
    Internal("accelerate.utils:DistributedDataParallelKwargs", "bucket_cap_mb", "attribute", ("devices/hpu.py",),
             "written on the Accelerator's DDP handler by the trainer before DDP wraps the model (ddp_defaults)"),
    Internal("accelerate.utils:DistributedDataParallelKwargs", "gradient_as_bucket_view", "attribute",
             ("devices/hpu.py",), "written as bucket_cap_mb"),
    Internal(f"{_ACC}:PartialState", "_shared_state", "dict", ("distributed/fsdp.py",),
             "written: the distributed type of a CPU run turned to FSDP, which later AcceleratorState() copy"),
    Internal(f"{_ACC}:AcceleratorState", "fsdp_plugin", "instance", ("distributed/fsdp.py",),
             "written: the FSDP plugin of a CPU run turned to FSDP after transformers made the Accelerator"),
    Internal(f"{_ACC}:AcceleratorState", "distributed_type", "instance", ("distributed/fsdp.py",),
             "written: MULTI_CPU turned to FSDP"),
    Internal("accelerate.data_loader:BatchSamplerShard", "num_processes", "instance",
             ("distributed/sequence_parallel.py",), "written: the ranks splitting one sequence read the same batches"),
    Internal("accelerate.data_loader:BatchSamplerShard", "process_index", "instance",
             ("distributed/sequence_parallel.py",), "written: as num_processes"),
    Internal("accelerate.data_loader:IterableDatasetShard", "num_processes", "instance",
             ("distributed/sequence_parallel.py",), "written: as for BatchSamplerShard"),
    Internal("accelerate.data_loader:IterableDatasetShard", "process_index", "instance",
             ("distributed/sequence_parallel.py",), "written: as for BatchSamplerShard"),
    Internal("accelerate.optimizer:AcceleratedOptimizer", "_is_overflow", "instance", ("supervision/nonfinite.py",),
             "written: a skipped non-finite step reads as skipped, so the scheduler is left alone"),
    # ---- peft and TRL (checked where loaded) -----------------------------------------------------------------
    Internal("peft:AdaLoraConfig", "__post_init__", "callable", ("features/adalora.py",),
             "wrapped: an AdaLoraConfig without total_step passes peft's check until the run sets it", "loaded"),
    Internal("peft:AdaLoraConfig", "total_step", "attribute", ("features/adalora.py",),
             "written: the run's step count, set when training starts", "loaded"),
    Internal("trl:DPOTrainer", "_prepare_dataset", "callable", ("trainers/trl.py",),
             "overridden: prompts cut to max_prompt_length as TRL < 1 cut them", "loaded"),
    Internal("trl:GRPOTrainer", "_tokenize_prompts", "callable", ("trainers/trl.py",),
             "overridden: prompts cut to max_prompt_length as TRL < 1 cut them", "loaded"),
    # ---- torch -----------------------------------------------------------------------------------------------
    Internal("torch", "_C", "module", ("precision/op_lists.py", "precision/autocast.py",
             "features/linear_cross_entropy.py", "devices/base.py", "supervision/collective_count.py"),
             "the dispatcher and c10d bindings"),
    Internal("torch._C", "_ExcludeDispatchKeyGuard", "class", ("precision/autocast.py",),
             "op-list autocast: a cast kernel calls the op below the autocast key"),
    Internal("torch._C", "DispatchKeySet", "class", ("precision/autocast.py",), "op-list autocast's key set"),
    Internal("torch._C", "DispatchKey", "class", ("precision/autocast.py",), "op-list autocast's key"),
    Internal("torch._C", "_dispatch_get_registrations_for_dispatch_key", "callable", ("precision/autocast.py",),
             "op-list autocast: the kernels torch's own autocast registers, replaced while ours are installed"),
    Internal("torch._C", "_dispatch_get_all_op_names", "callable", ("precision/op_lists.py",),
             "the op names an op list may use", required=False),
    Internal("torch._C", "_dispatch_key_for_device", "callable", ("features/linear_cross_entropy.py", "devices/base.py"),
             "whether the device has a kernel for the fused loss's fp32 matmul, or for fp8 matmuls"),
    Internal("torch._C", "_dispatch_has_kernel_for_dispatch_key", "callable",
             ("features/linear_cross_entropy.py", "devices/base.py"),
             "as _dispatch_key_for_device"),
    # FSDP2 on torch 2.6 and 2.7 (no switch to sum): each unit's parameter group given ReduceOp.SUM
    Internal("torch.distributed.fsdp:FSDPModule", "_get_fsdp_state", "callable", ("distributed/fsdp.py",),
             "called on torch < 2.8: a unit's state, whose parameter group reduce-scatters", when="loaded",
             required=False),
    Internal("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", "_fsdp_param_group", "instance",
             ("distributed/fsdp.py",), "read on torch < 2.8: the group whose reduce-scatter op is set to SUM",
             when="loaded", required=False),
    Internal("torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup", "_is_hsdp", "attribute",
             ("distributed/fsdp.py",), "read on torch < 2.8: replicated shards, whose all-reduce averages",
             when="loaded", required=False),
    Internal("torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup", "reduce_scatter_reduce_op",
             "instance", ("distributed/fsdp.py",), "written on torch < 2.8: SUM, passed to the reduce-scatter as is",
             when="loaded", required=False),
    Internal("torch._C", "_distributed_c10d", "module", ("supervision/collective_count.py",), "the flight recorder"),
    Internal("torch._C._distributed_c10d", "_dump_fr_trace_json", "callable", ("supervision/collective_count.py",),
             "the watchdog's report names the collective each gloo rank waits in (torch 2.8+; before, the project's "
             "count)", required=False),
    Internal("torch._C._distributed_c10d", "_dump_nccl_trace_json", "callable", ("supervision/collective_count.py",),
             "the watchdog's report names the collective each NCCL rank waits in (NCCL's own recorder; a build "
             "without NCCL lacks it)", required=False),
    Internal("torch._C._distributed_c10d:Backend.Options", "_timeout", "attribute", ("distributed/host_group.py",),
             "read: the default group's timeout, given to the groups made here", required=False),
    Internal("torch", "_ops", "module", ("precision/autocast.py",), "OpOverload, the ops op lists name"),
    Internal("torch.nn:Module", "forward", "callable",
             ("seam.py", "devices/cuda.py", "devices/hpu.py"),
             "replaced per model or module: the seam's contributions, the devices' graph wrappers"),
    Internal("torch.compiler", "is_exporting", "callable", ("features/compilation.py",),
             "added where missing (torch < 2.7): transformers asks it while a compile traces the masks",
             "compile", required=False),
    Internal("torch._ops:OpOverload", "_schema", "instance", ("precision/autocast.py",),
             "read: an op's out= overloads are left out of the op list"),
    Internal("torch.library:Library", "_destroy", "callable", ("precision/autocast.py",),
             "op-list autocast's kernels removed when the trainer is done"),
    Internal("torch", "_foreach_copy_", "callable", ("distributed/fast_ddp.py",),
             "fast_ddp: gradients copied into and out of the fused buffer in one call"),
    Internal("torch", "_dynamo", "module", ("features/compilation.py", "supervision/watch.py"),
             "dynamo's config (optimum-habana's flags), graph counters and compile callbacks"),
    Internal("torch._dynamo.utils", "counters", "attribute", ("features/compilation.py",),
             "the graphs torch.compile built, counted and named"),
    Internal("torch._dynamo.callback", "callback_handler", "attribute", ("supervision/watch.py",),
             "compilations do not count as a stall", required=False),
    Internal("torch._dynamo.eval_frame:OptimizedModule", "_orig_mod", "instance", ("precision/op_list_check.py",),
             "read: a compiled model is recognised"),
    Internal("torch.nn:Module", "_compiled_call_impl", "instance",
             ("precision/op_list_check.py", "features/compilation.py", "preparation/pipeline.py"),
             "read: a module compiled with module.compile() is recognised; removed: seam.undo uncompiles"),
    Internal("torch", "_inductor", "module", ("features/compilation.py",), "inductor's options", "compile"),
    Internal("torch._inductor", "config", "module", ("features/compilation.py",), "inductor's options", "compile"),
    Internal("torch._inductor", "list_mode_options", "callable", ("features/compilation.py",),
             "--torch_compile_mode's options checked", "compile"),
    Internal("torch.nn.modules.batchnorm", "_BatchNorm", "class", ("features/static_batches.py",),
             "static batches refuse models with batch norm, whose padded rows would change the statistics"),
    Internal("torch.autograd", "_profiler_enabled", "callable", ("features/profiling.py",),
             "profiling regions recorded only while a profiler runs"),
    Internal("torch.amp.grad_scaler", "_refresh_per_optimizer_state", "callable", ("supervision/nonfinite.py",),
             "a skipped step's unscaling forgotten by the gradient scaler"),
    Internal("torch.amp.grad_scaler:GradScaler", "_per_optimizer_states", "instance", ("supervision/nonfinite.py",),
             "written: as _refresh_per_optimizer_state", required=False),
    Internal("torch.utils", "_pytree", "module", ("devices/base.py", "devices/cuda.py"),
             "tree_map_only, tree_flatten, tree_unflatten over nested batches"),
    Internal(_C10D, "_set_pg_timeout", "callable", ("distributed/host_group.py",),
             "--ddp_timeout given to the default group where transformers left it out", required=False),
    Internal(_C10D, "_get_default_store", "callable", ("supervision/agreement.py",),
             "the ranks' agreements (preemption) through the default group's store"),
    Internal("torch.distributed:ProcessGroup", "_get_backend", "callable", ("distributed/host_group.py",),
             "read: the default group's timeout"),
    Internal("torch.distributed:ProcessGroup", "_device_types", "attribute", ("distributed/host_group.py",),
             "read: the default group's backends", required=False),
    Internal("torch.distributed:ProcessGroup", "_get_sequence_number_for_group", "callable",
             ("supervision/watchdog.py", "supervision/collective_count.py"),
             "the watchdog's report: how many collectives each rank issued (asked whether the backend counts)"),
    Internal("torch.nn.parallel:DistributedDataParallel", "_comm_hooks", "instance",
             ("supervision/collective_count.py",),
             "read: whether a DDP module has a communication hook already (the collective count adds none then)",
             required=False),
    # ---- others --------------------------------------------------------------------------------------------
    Internal("tqdm.std:tqdm", "_instances", "attribute", ("errors.py",),
             "a failed run's open progress bars closed before its error line", required=False),
) + tuple(
    Internal(_T, hook, "callable", ("trainers/trainer.py", "trainers/compat.py"),
             "overridden hook (compat.TRAINER_HOOKS; older releases get a shim)", required=False)
    for hook in TRAINER_HOOKS
    if hook.startswith("_")
) + tuple(
    Internal(_C10D, name, "callable", ("supervision/collective_count.py",),
             "replaced (here and in torch.distributed) while the watchdog counts collectives on a backend that keeps "
             "no count", required=False)
    for name in COLLECTIVES
)  # fmt: skip

# Private names of Python's own library the package uses (documented, stable): listed, not checked.
STDLIB = {
    "_exit": "os._exit: a rank that must stop now (watchdog, preemption)",
    "_Environ": "os._Environ: the type of os.environ, for a type hint",
    "_current_frames": "sys._current_frames: the stacks the watchdog reports",
    "_getframe": "sys._getframe: the call site of a collective the watchdog's count records",
    "_run_exitfuncs": "atexit._run_exitfuncs: exit handlers run before os._exit",
    "_SubParsersAction": "argparse._SubParsersAction: the CLI's subcommands",
    "_fields": "a named tuple's field names (batches and outputs that are named tuples)",
}


class InternalsError(UserError, RuntimeError):
    """An internal of another library that a Gaudi feature relies on is missing or changed in the installed
    release; the message names it and what to do."""


def _resolve(path: str) -> Any:
    """``module`` or ``module:Class.Attr``, imported."""
    module_name, _, attrs = path.partition(":")
    obj = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def _source(owner: Any) -> str:
    """The text of the files that define the owner and, for a class, every class it builds on (an attribute
    may be set by a base). Whole files, read as text: parsing out one class's source costs seconds."""
    classes = inspect.getmro(owner) if inspect.isclass(owner) else ()
    modules = [sys.modules.get(c.__module__) for c in classes] if classes else [owner]
    return "\n".join(_file_text(m) for m in dict.fromkeys(modules) if m is not None)


@functools.cache
def _file_text(module: types.ModuleType) -> str:
    try:
        path = inspect.getsourcefile(module)
    except TypeError:  # a built-in module
        return ""
    if path is None:
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def problem(entry: Internal) -> str | None:
    """What is wrong with ``entry`` in the installed release, or None."""
    try:
        owner = _resolve(entry.owner)
    except (ImportError, AttributeError) as err:
        return f"{entry.owner.replace(':', '.')} cannot be loaded ({err})"
    if entry.kind == "instance":
        if hasattr(owner, entry.name) or re.search(rf"\.{re.escape(entry.name)}\b", _source(owner)):
            return None
        return None if not entry.required else f"{entry.label} is no longer set anywhere in its source"
    if not hasattr(owner, entry.name):
        return None if not entry.required else f"{entry.label} is missing"
    value = getattr(owner, entry.name)
    if entry.kind == "source":
        try:
            return None if inspect.getsource(inspect.unwrap(value)).strip() else f"{entry.label} has no source"
        except (OSError, TypeError):
            return f"{entry.label}'s source cannot be read"
    expected = {"module": types.ModuleType, "class": type, "dict": dict}.get(entry.kind)
    if expected is not None and not isinstance(value, expected):
        return f"{entry.label} is a {type(value).__name__}, no longer a {entry.kind}"
    if entry.kind == "callable" and not callable(value):
        return f"{entry.label} is a {type(value).__name__}, no longer callable"
    return None


def _versions(entry: Internal) -> str:
    module = sys.modules.get(entry.library)
    version = getattr(module, "__version__", None)
    return f"{entry.library} {version}" if version else entry.library


def due(entry: Internal, args: Any, gaudi_config: Any) -> bool:
    """Whether ``entry`` is checked for a run: its condition holds, or its owner's module is loaded anyway."""
    if entry.when == "always":
        return True
    return entry.owner.split(":")[0] in sys.modules or CONDITIONS[entry.when](args, gaudi_config)


def check_internals(args: Any, gaudi_config: Any, entries: Iterable[Internal] = INTERNALS) -> None:
    """Fail in one line on the first internal that the run's features need and the installed libraries no
    longer have as expected (at construction of every Gaudi trainer)."""
    for entry in entries:
        if not due(entry, args, gaudi_config):
            continue
        found = problem(entry)
        if found is not None:
            raise InternalsError(
                f"{found} in {_versions(entry)}; optimum_gaudi/{entry.used_by[0]} relies on it ({entry.why}): "
                "install a release that make test-compat covers, or report this line to optimum-gaudi."
            )
