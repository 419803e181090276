"""Room for one checkpoint, checked when training starts: a full disk found before step 1, not at the first save.

The estimate is a lower bound of what one checkpoint writes: the saved weights (the trainable ones only for a PEFT
model, which saves its adapters) in their own dtype, plus the optimizer state ``--optim`` keeps for each trainable
weight (AdamW: two tensors of the weight's dtype). The scheduler, RNG, trainer state and tokenizer files are small
and left out. Where even that bound does not fit in the free space of ``--output_dir`` (of its nearest existing
parent), training is refused in one line; ``--save_total_limit`` does not change what one checkpoint needs.

FSDP2's sharded checkpoints hold the same bytes, written by every rank, each its share: a node writes at least its
ranks' share (all of it on one node), so each node's first rank checks its own disk, and every rank refuses
together (a rank refusing alone would leave the others waiting in a collective). DeepSpeed and FSDP's other
layouts write files of their own: there the estimate is only a guess, so it is a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainingArguments

from ..checkpoints import free_bytes
from ..errors import UserError

logger = logging.getLogger(__name__)

_ADAMW = (
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adamw_apex_fused",
    "paged_adamw_32bit",
    "stable_adamw",
    "grokadamw",
    "ademamix",
    "paged_ademamix_32bit",
)
# Optimizer state per trainable weight, by --optim: (tensors, bytes per element; None: the weight's own dtype).
# An optimizer not listed (SGD without momentum, Adafactor's factored state, ...) counts none: a lower bound.
_OPTIMIZER_STATE: dict[str, tuple[int, int | None]] = {
    **dict.fromkeys(_ADAMW, (2, None)),
    **dict.fromkeys(("lion_32bit", "paged_lion_32bit", "adagrad", "rmsprop", "rmsprop_bnb_32bit"), (1, None)),
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "adamw_torch_8bit"), (2, 1)),
    **dict.fromkeys(("lion_8bit", "paged_lion_8bit", "rmsprop_bnb_8bit"), (1, 1)),
}


@dataclass(frozen=True)
class CheckpointSize:
    """At least this many bytes, in two parts; ``trusted``: a lower bound (False: sharded saves, a guess)."""

    weights: int
    optimizer: int
    trusted: bool = True

    @property
    def total(self) -> int:
        return self.weights + self.optimizer


def estimate_checkpoint_size(
    model: Any, args: TrainingArguments, *, own_optimizer: bool = False, sharded: bool = False
) -> CheckpointSize:
    """What one checkpoint of ``model`` trained with ``args`` writes at least. ``own_optimizer``: an optimizer
    given to the trainer, whose state is not known ahead (left out); ``sharded``: DeepSpeed or FSDP saves."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = trainable if hasattr(model, "peft_config") else list(model.parameters())  # parameters(): tied once
    weights = sum(p.numel() * p.element_size() for p in saved)
    optim = getattr(args.optim, "value", args.optim)
    tensors, width = (0, None) if args.save_only_model or own_optimizer else _OPTIMIZER_STATE.get(optim, (0, None))
    optimizer = sum(p.numel() * (width or p.element_size()) for p in trainable) * tensors
    return CheckpointSize(weights, optimizer, trusted=not sharded)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def check_room_for_a_checkpoint(trainer: Any) -> None:
    """Before step 1 of ``trainer.train()``: refuse (UserError) when one checkpoint cannot fit where the run saves,
    or warn where the estimate is only a guess. Nothing happens without checkpoints."""
    args = trainer.args
    if args.save_strategy == "no":
        return
    sharded = _sharded_fsdp_checkpoints(trainer)
    checks = args.should_save or (sharded and args.local_process_index == 0)  # sharded: one rank per node
    problem = _problem(trainer, sharded) if checks else None
    if args.world_size > 1 and torch.distributed.is_initialized():
        problem = _first_problem(problem, args.parallel_layout.host_group())
    if problem is not None:
        raise UserError(problem)


def _sharded_fsdp_checkpoints(trainer: Any) -> bool:
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    return plugin is not None and "SHARDED_STATE_DICT" in str(getattr(plugin, "state_dict_type", ""))


def _first_problem(problem: str | None, group: Any) -> str | None:
    """Every rank's verdict: the problem of the first rank that found one (a collective, before step 1)."""
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, problem, group=group)
    return next((p for p in found if p is not None), None)


def _problem(trainer: Any, sharded: bool) -> str | None:
    args = trainer.args
    free = free_bytes(args.output_dir)
    size = estimate_checkpoint_size(
        trainer.model,
        args,
        own_optimizer=trainer.optimizer is not None,
        sharded=trainer.is_deepspeed_enabled or (trainer.is_fsdp_enabled and not sharded),
    )
    if sharded and args.world_size > 1:  # this node writes its ranks' share (all of it on one node)
        share = min(1.0, _local_world_size(args) / args.world_size)
        size = CheckpointSize(int(size.weights * share), int(size.optimizer * share))
    if size.total <= free:
        return None
    if not size.trusted:
        logger.warning(
            "--output_dir %s has %s free; one checkpoint may need about %s (DeepSpeed and FSDP write sharded "
            "files of their own, so this is only an estimate).",
            args.output_dir,
            _mib(free),
            _mib(size.total),
        )
        return None
    parts = f"weights {_mib(size.weights)}" + (f", optimizer state {_mib(size.optimizer)}" if size.optimizer else "")
    if size.optimizer and size.weights <= free:
        remedy = "free some space, choose another --output_dir, or add --save_only_model (weights only: no resuming)"
    else:
        remedy = "free some space or choose another --output_dir"
    where = " (this node's share of the sharded checkpoint)" if sharded and args.world_size > 1 else ""
    return (
        f"--output_dir {args.output_dir}: one checkpoint needs at least {_mib(size.total)}{where} ({parts}) and "
        f"only {_mib(free)} is free there; {remedy}."
    )


def _local_world_size(args: TrainingArguments) -> int:
    import os

    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "")), 1)
    except ValueError:
        return args.world_size
