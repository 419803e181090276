"""FSDP2 where accelerate leaves it off: a multi-process CPU run.

accelerate (1.15, ``state.py``, ``AcceleratorState.__init__``) switches a run to ``DistributedType.FSDP`` only for
accelerator distributed types (MULTI_GPU, MULTI_HPU, ...); with ``MULTI_CPU`` it keeps the plugin out of the state,
and transformers then wraps the model in plain DDP while the user asked for ``--fsdp``. torch's ``fully_shard``
runs on CPU over gloo (reduce-scatter and all-gather included), so the same command line shards there too: the
state is given the plugin transformers built, as accelerate does for the other types.
"""

from __future__ import annotations

from typing import Any


def shard_where_accelerate_would_not(accelerator: Any, args: Any) -> bool:
    """Give a multi-process CPU run the FSDP plugin of ``args``; True where the state changed."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if args.fsdp_plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
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
        raise ValueError(
            "fsdp_config['activation_checkpointing'] and --activation_checkpointing can't both be set: use FSDP's."
        )
    if args.save_only_model and args.load_best_model_at_end:
        raise ValueError("FSDP can't be used with `save_only_model` along with `load_best_model_at_end`.")
    if args.save_only_model and "SHARDED_STATE_DICT" in str(plugin.state_dict_type):
        raise ValueError("save_only_model option is not compatible with FSDP state dict type 'SHARDED_STATE_DICT'")
