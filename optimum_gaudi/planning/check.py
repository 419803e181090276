"""One run's own settings checked against its card before it starts: the arithmetic of issue 48's second point,
which the trainer calls before step 1 (trainers/plan_check.py).

The run states what it is (its training arguments' names), the card what it holds; the answer is None when the
plan fits, else one line saying by how much it does not, what takes the memory, and what to do.
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from .hardware import GB, Card
from .memory import breakdown
from .model import load_model_shape
from .settings import Adapters, Assumptions, Setting, Workload

# How far a prediction may be off a measured peak: a run is stopped only where its plan exceeds the card by more than
# that. docs/benchmarks.md, the plan section: over-predicted by 8% at most in two runs with a fixed CPU workspace
# (2026-11-28 11:53 and 12:01 UTC), by 11% at most (of 24 settings, LoRA's included) in the run with the fitted one
# (16:01 UTC) and in the next (16:36 UTC, 26 settings, bf16 weights' included): the direction that could stop a run
# that fits; under-predictions (14% and 13% at most) never do.
TOLERANCE = 0.12


class PlanDoesNotFit(UserError):
    """A run whose plan needs more memory than its card holds."""


def run_setting(args: Any) -> Setting:
    """The setting a run's training arguments ask for (GaudiTrainingArguments' field names)."""
    strategy = "fsdp" if getattr(args, "fsdp", None) else getattr(args, "distribution_strategy", "ddp")
    return Setting(
        strategy=strategy if strategy in ("ddp", "fast_ddp", "fsdp") else "ddp",
        context_parallel=int(getattr(args, "context_parallel_size", 1) or 1),
        fp8=bool(getattr(args, "fp8", False)),
        checkpointing=bool(getattr(args, "gradient_checkpointing", False)),
        fused_loss=bool(getattr(args, "use_fused_linear_cross_entropy", False)),
        micro_batch=int(args.per_device_train_batch_size),
        accumulation=int(getattr(args, "gradient_accumulation_steps", 1) or 1),
    )


def check_run(
    model_config: Any,
    args: Any,
    sequence: int,
    card: Card,
    world: int = 1,
    assumptions: Assumptions | None = None,
    adapters: Adapters | None = None,
    weight_bytes: int = 4,
) -> str | None:
    """None when the run's plan fits on ``card``, else the one line a run prints instead of an OOM minutes later.
    ``adapters``: the LoRA adapters a run trains on its frozen model (None: it trains every weight).
    ``weight_bytes``: training every weight, the bytes of one as the run loads it (4 float32, 2 bf16), which its
    gradients and AdamW's moments take too (``Workload.weight_bytes``)."""
    shape = load_model_shape(model_config)
    setting = run_setting(args)
    precision = "bf16" if getattr(args, "bf16", False) else "fp32"
    hpu_graphs = bool(getattr(args, "use_hpu_graphs_for_training", False))
    batch = setting.micro_batch * setting.accumulation * world
    workload = Workload(world, 1, sequence, batch, precision, hpu_graphs, adapters, weight_bytes)
    memory = breakdown(shape, workload, setting, card, assumptions)
    if memory.peak <= card.memory_gb * GB * (1 + TOLERANCE):  # a borderline run is the user's call, not ours
        return None
    largest = max(memory.parts().items(), key=lambda item: item[1])
    what = setting.label() if adapters is None else f"{setting.label()}, {adapters.label()}"
    if adapters is None and weight_bytes == 2:
        what += ", 16-bit weights"  # bf16 or fp16 weights, trained as loaded
    return (
        f"the plan says this run needs {memory.peak / GB:.1f} GB a card of {card.memory_gb:.1f} GB "
        f"({what}, sequence {sequence}; largest part: {largest[0]} {largest[1] / GB:.1f} GB); "
        f"`optimum-gaudi plan` lists settings that fit, or pass --ignore_plan to go on anyway."
    )
