"""The run's plan checked against its card (issue 48): a run whose memory plan does not fit says so in one line,
instead of an out-of-memory error after the first compile. ``--ignore_plan`` goes on anyway.

Two entry points, one check: :func:`check_plan_before_loading`, which a script calls with its arguments and the
model's config before it loads any weight (the examples do), and :func:`check_the_plan`, which the trainer calls
before step 1 for a script that did not (a run checked before loading is not checked again).

Only on a card (a Gaudi, a GPU): a CPU's memory is shared with the OS and the other ranks of the machine, where
`optimum-gaudi plan --card cpu` answers instead. The sequence length is the first training example's (exact for
run_clm.py's blocks; a padded dataset's longer rows are not seen); a model family the planner does not know, or a
dataset it cannot index, is not checked. Every rank computes the same numbers, so all refuse together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import UserError
from ..planning import Card, ModelShape, PlanDoesNotFit, check_run, load_model_shape

GB = 1e9


def card_of(device: Any) -> Card | None:
    """This run's card as the planner sees it: its kind and the memory the device reports; None on a CPU."""
    if not device.has_own_memory:
        return None
    _, total = device.memory_info()
    return Card(f"this {device.type}", total / GB, None, None, 0.0, "the device's own total", device.type)


def _first_sequence_length(dataset: Any) -> int | None:
    try:
        return len(dataset[0]["input_ids"])
    except Exception:  # an iterable dataset, a transform, other columns: the check is advice, never a crash
        return None


def _shape_of(config: Any) -> ModelShape | None:
    """The planner's shape of ``config`` without its name (a path here, a copy's name there), or None for a family
    the planner does not know or a config lacking a width."""
    try:
        return dataclasses.replace(load_model_shape(config), name="")
    except (UserError, TypeError, ValueError):
        return None


def _check(shape: ModelShape, args: Any, sequence: int, device: Any) -> None:
    """The one check both entry points run: raise :class:`PlanDoesNotFit` where the plan exceeds the card."""
    card = card_of(device)
    if card is None:
        return
    message = check_run(shape, args, sequence, card, world=args.world_size)
    if message is not None:
        raise PlanDoesNotFit(message)


def check_plan_before_loading(config: Any, args: Any, sequence: int | None) -> None:
    """The run's plan checked from its model config and arguments alone, before any weight is read: what a script
    calls once it has parsed its arguments and loaded the config (examples/language-modeling/run_clm.py). Raises
    :class:`PlanDoesNotFit` (one line) where it does not fit; where it does, the trainer does not check it again."""
    shape = _shape_of(config)
    if args.ignore_plan or not sequence or shape is None:
        return
    _check(shape, args, sequence, args.gaudi_device)
    args._gaudi_plan_checked = (shape, sequence)  # noqa: SLF001 (read by check_the_plan, on the same arguments)


def check_the_plan(trainer: Any) -> None:
    """Raise :class:`PlanDoesNotFit` (one line) when the run's plan needs more memory than its card holds; for a
    script that built its own model (no :func:`check_plan_before_loading`), once the weights are loaded."""
    args = trainer.args
    if args.ignore_plan or trainer.train_dataset is None or getattr(trainer.model, "config", None) is None:
        return
    if not all(parameter.requires_grad for parameter in trainer.model.parameters()):
        return  # frozen weights (LoRA, PEFT) need far less than the full fine-tuning the planner counts
    sequence = _first_sequence_length(trainer.train_dataset)
    shape = _shape_of(trainer.model.config) if sequence else None
    if shape is None or getattr(args, "_gaudi_plan_checked", None) == (shape, sequence):  # checked before loading
        return
    _check(shape, args, sequence, trainer.gaudi_device)
