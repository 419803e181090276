"""Ranks agreeing on the step to stop after, through the job's rendezvous store: no collective on the steps where
nobody asked to stop.

A checkpoint is collective, so every rank must stop after the same step. A rank that was asked (SIGTERM) says so
in the default group's store and proposes a step with an atomic compare-and-set on one key; the first proposal
wins and every rank reads the same value. Every other step end only asks the store whether that key exists (one
round trip to node 0's store, tens of microseconds, no waiting for other ranks).

Which step: training steps keep the ranks within one step of each other (each step's gradient reduction needs
every rank), so when a rank ends step s, every other rank has ended step s - 1 and has not ended step s + 1.
When every rank was asked (Slurm and Kubernetes signal them all), they stop after the latest step one of them
was asked at: the step in flight. When only some were, a rank that was not may have ended step s already without
seeing the key, so the proposal is s + 1: no rank can pass it without having seen the key.
"""

from __future__ import annotations

import itertools
import os
import time
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

    def __init__(self, store: Any, rank: int, world_size: int, name: str = "stop", serial: int | None = None) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job may keep the same store
        self._store, self._rank, self._world_size = store, rank, world_size
        self._key = f"optimum_gaudi/{name}/{restart}/{next(_serial) if serial is None else serial}"
        self.stop_after: int | None = None

    def step_end(self, step: int, requested: bool, wait_seconds: float = 1.0) -> bool:
        if self.stop_after is None:
            if requested:
                self.stop_after = self._propose(step, wait_seconds)
            elif self._store.check([f"{self._key}/after"]):
                self.stop_after = int(self._store.get(f"{self._key}/after"))
        return self.stop_after is not None and step >= self.stop_after

    def _propose(self, step: int, wait_seconds: float) -> int:
        """This rank was asked at the end of ``step``. Where every rank was asked (a scheduler signals them all),
        they stop after the latest step any of them was asked at, as soon as all have said so; where some were
        not (after ``wait_seconds``), after the next step. The first proposal wins, for every rank."""
        decided = f"{self._key}/after"
        asked = [f"{self._key}/asked/{rank}" for rank in range(self._world_size)]
        self._store.set(asked[self._rank], str(step))
        deadline = time.monotonic() + wait_seconds
        while not self._store.check([decided]):
            if self._store.check(asked):  # every rank was asked: no rank can be past the latest of those steps
                proposal = max(int(value) for value in self._store.multi_get(asked))
                break
            if time.monotonic() >= deadline:
                proposal = step + 1
                break
            time.sleep(0.005)
        else:
            return int(self._store.get(decided))
        return int(self._store.compare_set(decided, "", str(proposal)))
