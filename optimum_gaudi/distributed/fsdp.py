"""FSDP2 where accelerate leaves it off (a multi-process CPU run), optimum-habana's FSDP files, and FSDP with the
Gaudi features.

accelerate (1.15, ``state.py``, ``AcceleratorState.__init__``) switches a run to ``DistributedType.FSDP`` only for
accelerator distributed types (MULTI_GPU, MULTI_HPU, ...); with ``MULTI_CPU`` it keeps the plugin out of the state,
and transformers then wraps the model in plain DDP while the user asked for ``--fsdp``. torch's ``fully_shard``
runs on CPU over gloo (reduce-scatter and all-gather included), so the same command line shards there too: the
state is given the plugin transformers built, as accelerate does for the other types.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UserError


class FsdpConfigError(UserError, ValueError):
    """An --fsdp_config that cannot work here; the message says what to change."""


# accelerate's FSDP1 sharding strategies, by name and by number (torch's ShardingStrategy counts from 1); FSDP2
# keeps the first two as reshard_after_forward and has no others on one device mesh dimension.
_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
# optimum-habana's model classes are transformers' under this prefix (GaudiLlamaDecoderLayer); models here are
# transformers' own.
_HABANA_CLASS_PREFIX = "Gaudi"


def read_fsdp_config(config: dict[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """--fsdp_config as a dict: a dict, a JSON object on the command line, or the path of a JSON file."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    text = str(config)
    try:
        if text.lstrip().startswith("{"):
            loaded = json.loads(text)
        else:
            if not os.path.isfile(text):
                raise FsdpConfigError(f"--fsdp_config {text}: no such file; pass a JSON file or a JSON object.")
            with open(text, encoding="utf-8") as f:
                loaded = json.load(f)
    except json.JSONDecodeError as e:
        raise FsdpConfigError(f"--fsdp_config {text}: not JSON ({e}).") from None
    if not isinstance(loaded, dict):
        raise FsdpConfigError(f"--fsdp_config {text}: expected a JSON object of settings.")
    return loaded


def fsdp2_config(config: dict[str, Any], default_version: int = 2) -> dict[str, Any]:
    """The settings transformers reads for FSDP2, from a file written for FSDP1 (optimum-habana's
    ``fsdp_config.json``, accelerate's ``fsdp_*`` keys) as well as from one written for FSDP2.

    transformers 5 drops the ``fsdp_`` prefixes but reads neither ``sharding_strategy`` nor ``offload_params``
    under FSDP2: a strategy of 2 (SHARD_GRAD_OP) would silently shard like 1, offloading would silently not
    happen. They become ``reshard_after_forward`` and ``cpu_offload``; a strategy FSDP2 has no equivalent of is
    one line. FSDP1's prefetch, ``use_orig_params`` and ``sync_module_states`` settings are what FSDP2 does
    anyway; they are left for transformers to ignore. A run of FSDP1 (``version: 1``, or ``default_version``, the
    one transformers picks, where the file names none) is left alone.
    """
    config = {key.removeprefix("fsdp_"): value for key, value in config.items()}
    if int(config.get("version", default_version)) != 2:
        return config
    strategy = config.pop("sharding_strategy", None)
    if strategy is not None:
        text = str(strategy).strip().upper()
        name = _SHARDING_STRATEGIES[int(text) - 1] if text.isdigit() and 1 <= int(text) <= 5 else text
        if name not in _RESHARD_AFTER_FORWARD:
            instead = "train without --fsdp (DDP) to keep whole replicas" if name == "NO_SHARD" else "shard fully"
            raise FsdpConfigError(
                f"fsdp_config sharding_strategy {strategy!r} ({name}) has no FSDP2 equivalent here: use 1 "
                f"(FULL_SHARD) or 2 (SHARD_GRAD_OP), or {instead}."
            )
        config.setdefault("reshard_after_forward", _RESHARD_AFTER_FORWARD[name])
    if "offload_params" in config:
        config.setdefault("cpu_offload", bool(config.pop("offload_params")))
    return config


def wrap_this_models_layers(plugin: Any, model: nn.Module | None) -> None:
    """The layer classes the FSDP config names (``transformer_layer_cls_to_wrap``), as this model calls them.

    optimum-habana's files name its own classes (``GaudiLlamaDecoderLayer``); a name the model lacks is taken
    without that prefix when the model has that. A name the model has in neither form is one line here, where
    accelerate would fail when it wraps the model, after loading it.
    """
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if not names or model is None:
        return
    present = {type(module).__name__ for module in model.modules()}
    found = []
    for name in names:
        plain = name.removeprefix(_HABANA_CLASS_PREFIX)
        if name not in present and plain not in present:
            base = getattr(model, "get_base_model", lambda: model)()
            blocks = ", ".join(getattr(base, "_no_split_modules", None) or []) or "none named"
            raise FsdpConfigError(
                f"fsdp_config transformer_layer_cls_to_wrap names {name}, which {type(base).__name__} does not have; "
                f"its repeated layers: {blocks}."
            )
        found.append(name if name in present else plain)
    plugin.transformer_cls_names_to_wrap = found


def use_mixed_precision_policy(plugin: Any, policy: Any | None) -> None:
    """FSDP2's mixed precision as the run's precision plan asks (precision/plan.py: bf16 gathers under the
    op-list autocast); None leaves accelerate's. accelerate sets no policy where the autocast replaces its own
    bf16, and a policy the user's fsdp_config gives is kept."""
    if policy is None or plugin.fsdp_version != 2 or plugin.mixed_precision_policy is not None:
        return
    plugin.mixed_precision_policy = policy


# accelerate's Accelerator exports ACCELERATE_USE_FSDP=true when it is given an FSDP plugin (``accelerator.py``), and
# every later Accelerator of the process builds a default plugin from it: set by an earlier trainer of this process.
_ACCELERATE_FSDP = "ACCELERATE_USE_FSDP"
_fsdp_exported_by_a_trainer = False


@contextlib.contextmanager
def fsdp_of_this_run_only(args: Any) -> Iterator[None]:
    """Around the building of a trainer's accelerator: a run that asks for no FSDP does not inherit the variable an
    earlier FSDP trainer of this process (a notebook, a sweep) made accelerate export, which would shard it too (a
    DDP run sharded, a fast_ddp run left on the CPU). A variable the user exported (``accelerate launch
    --use_fsdp``) is theirs and stays."""
    global _fsdp_exported_by_a_trainer
    wants_fsdp = bool(args.fsdp) or getattr(args, "fsdp_plugin_args", None) is not None
    if _fsdp_exported_by_a_trainer and not wants_fsdp:
        os.environ.pop(_ACCELERATE_FSDP, None)
        _fsdp_exported_by_a_trainer = False
    before = os.environ.get(_ACCELERATE_FSDP)
    yield
    if before is None and os.environ.get(_ACCELERATE_FSDP) is not None:
        _fsdp_exported_by_a_trainer = True


def shard_where_accelerate_would_not(accelerator: Any, args: Any) -> bool:
    """Give a multi-process CPU run the FSDP plugin of ``args``; True where the state changed."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    # transformers 5 builds the plugin's arguments; 4.57 sets accelerate's FSDP_* variables, which the plugin reads
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if plugin_args is None and not (args.fsdp and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"):
        return False
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**(plugin_args or {}))
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    # As AcceleratorState.__init__ records it: every later AcceleratorState() (AcceleratedOptimizer makes one)
    # copies PartialState's fields over its own, which would turn the run back to MULTI_CPU before a resume.
    PartialState._shared_state["distributed_type"] = state.distributed_type
    state.fsdp_plugin = plugin
    return True


def check_fsdp_arguments(accelerator: Any, args: Any) -> None:
    """The argument checks transformers makes once FSDP is on (``create_accelerator_and_postprocess``), for a run
    turned to FSDP after them."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.activation_checkpointing and getattr(args, "activation_checkpointing", False):  # transformers 5
        raise FsdpConfigError(
            "fsdp_config activation_checkpointing and --activation_checkpointing are both set; keep FSDP's only."
        )
    if args.save_only_model and args.load_best_model_at_end:
        raise FsdpConfigError("--fsdp with --save_only_model cannot --load_best_model_at_end; drop one of them.")
    if args.save_only_model and "SHARDED_STATE_DICT" in str(plugin.state_dict_type):
        raise FsdpConfigError(
            '--save_only_model needs whole weights: set the fsdp_config state_dict_type to "FULL_STATE_DICT".'
        )


def check_fp8_under_fsdp(plan: Any) -> None:
    """``--fp8`` under FSDP where the device's fp8 layers are not known to shard (the Transformer Engine's): one
    line when the trainer is built, before the model is loaded into FSDP."""
    if plan is not None and not plan.shards_with_fsdp:
        raise FsdpConfigError(f"--fp8 with --fsdp: {plan.name} layers are not sharded by FSDP here; drop one of them.")


# torch 2.8 added it (FSDPModule.set_force_sum_reduction_for_comms); before it FSDP2 reduce-scatters float32 and bf16
# gradients with ReduceOp.AVG and has no switch, but each unit's parameter group passes the op it holds
# (`reduce_scatter_reduce_op`, what torch's own set_reduce_scatter_divide_factor sets, 2.6+) to the reduce-scatter
# as it is: SUM there, and the mean's division done on the loss's gradient (GradientDivisor), is what torch 2.6 and
# 2.7 (Gaudi software 1.20-1.22) take.
_SUM_SWITCH = "set_force_sum_reduction_for_comms"
_OP_OF_THE_GROUP = "set_reduce_scatter_divide_factor"  # came with the group's op: whether the group carries one


def check_sum_reductions(device: Any) -> None:
    """FSDP2 on a device whose collectives only sum needs a way to reduce gradients with SUM: without it the first
    backward fails inside the reduce-scatter. One line when the trainer is built instead."""
    if device.collectives_average:
        return
    from torch.distributed.fsdp import FSDPModule

    if not (hasattr(FSDPModule, _SUM_SWITCH) or hasattr(FSDPModule, _OP_OF_THE_GROUP)):
        raise FsdpConfigError(
            f"--fsdp on {device.type.upper()}: its collectives take no ReduceOp.AVG, and this torch "
            f"({torch.__version__}) cannot reduce FSDP2's gradients with SUM; use torch >= 2.6 or train without --fsdp."
        )


def reduce_with_sum(model: nn.Module) -> int:
    """Every FSDP2 unit of ``model`` reduces its gradients with SUM, as the data-parallel mean in collectives a
    device without AVG runs (HCCL). With torch's switch (2.8+) torch divides by the world size itself (its
    pre/post-divide factors) and this returns 1; before it, each unit's group sums and this returns the divisor
    the loss's gradient takes (GradientDivisor), the same mean."""
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if hasattr(FSDPModule, _SUM_SWITCH):
        for unit in units:
            getattr(unit, _SUM_SWITCH)(True)
        return 1
    sizes = set()
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:  # a unit that holds no parameter of its own
            continue
        if getattr(group, "_is_hsdp", False):  # its all-reduce across replicas averages too
            raise FsdpConfigError(
                f"--fsdp with replicated shards (HSDP) on a device without ReduceOp.AVG needs torch >= 2.8 (this is "
                f"torch {torch.__version__}); shard over every rank."
            )
        group.reduce_scatter_reduce_op = dist.ReduceOp.SUM
        sizes.add(group.mesh_info.shard_mesh_size)
    if len(sizes) > 1:
        raise FsdpConfigError(
            f"--fsdp units sharded over different world sizes {sorted(sizes)}: shard over every rank."
        )
    return sizes.pop() if sizes else 1


class GradientDivisor(torch.autograd.Function):
    """The loss as it is, its gradient divided: every gradient of the backward comes out divided, as FSDP2's AVG
    would leave them after a SUM reduce-scatter (torch < 2.8). The logged loss is unchanged."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, divisor: int) -> torch.Tensor:
        ctx.divisor = divisor
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.divisor, None
