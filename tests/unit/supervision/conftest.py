"""Fixtures the supervision tests share."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from optimum_gaudi.supervision import collective_count


@pytest.fixture
def group_without_a_count(tmp_path, monkeypatch):
    """A gloo group of one process whose backend reads as one that numbers no collectives (as HCCL); every share
    of the collective count a test left is stopped after it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(collective_count, "backend_counts", lambda group=None: False)
    try:
        yield
    finally:
        while collective_count.active() is not None:
            collective_count.stop()
        dist.destroy_process_group()
