"""The run's plan checked against its card when training starts (issue 48): a run whose memory plan does not fit
says so in one line before step 1, instead of an out-of-memory error after the first compile. ``--ignore_plan``
goes on anyway.

Only on a card (a Gaudi, a GPU): a CPU's memory is shared with the OS and the other ranks of the machine, where
`optimum-gaudi plan --card cpu` answers instead. The sequence length is the first training example's (exact for
run_clm.py's blocks; a padded dataset's longer rows are not seen); a model family the planner does not know, or a
dataset it cannot index, is not checked. Every rank computes the same numbers, so all refuse together.
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from ..planning import Card, PlanDoesNotFit, check_run, load_model_shape

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


def check_the_plan(trainer: Any) -> None:
    """Raise :class:`PlanDoesNotFit` (one line) when the run's plan needs more memory than its card holds."""
    args = trainer.args
    if args.ignore_plan or trainer.train_dataset is None or getattr(trainer.model, "config", None) is None:
        return
    sequence = _first_sequence_length(trainer.train_dataset)
    card = card_of(trainer.gaudi_device) if sequence else None
    if card is None:
        return
    try:
        shape = load_model_shape(trainer.model.config)
    except (UserError, TypeError, ValueError):  # a family the planner does not know, a config lacking a width
        return
    message = check_run(shape, args, sequence, card, world=args.world_size)
    if message is not None:
        raise PlanDoesNotFit(message)
