"""Ranks agreeing on the step to stop after, through the job's rendezvous store: no collective on the steps where
nobody asked to stop.

A checkpoint is collective, so every rank must stop after the same step. A rank that was asked (SIGTERM) proposes
the step after the one it just finished, with an atomic compare-and-set on one key of the default group's store;
the first proposal wins and every rank reads the same value. Every other step end only asks the store whether the
key exists (one round trip to node 0's store, tens of microseconds, no waiting for other ranks).

Why the step after: training steps keep the ranks within one step of each other (each step's gradient
reduction needs every rank), so when a rank ends step s, every other rank has ended step s - 1 and has not ended
step s + 1: none can have passed step s + 1 without having seen the key.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

_serial = itertools.count()  # one key per agreement made in this process (every rank makes them in the same order)


def default_store() -> Any:
    """The store the default process group was made with (the job's rendezvous store), or None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a process group made without a store (an MPI backend)
        return None


class StopAgreement:
    """One per ``train()``: ``step_end(step, requested)`` says whether this rank stops after ``step``."""

    def __init__(self, store: Any, name: str = "stop") -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job may keep the same store
        self._store = store
        self._key = f"optimum_gaudi/{name}/{restart}/{next(_serial)}"
        self.stop_after: int | None = None

    def step_end(self, step: int, requested: bool) -> bool:
        if self.stop_after is None:
            if requested:
                agreed = self._store.compare_set(self._key, "", str(step + 1))
                self.stop_after = int(agreed)
            elif self._store.check([self._key]):
                self.stop_after = int(self._store.get(self._key))
        return self.stop_after is not None and step >= self.stop_after
