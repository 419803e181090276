"""TEST DOUBLE of ``habana_frameworks.torch.core.torch_overwrites``: the torch functions the bridge replaces when
``core`` is imported (``overwrite_torch_functions``), as far as they change what a training run does.

Follows ``core/torch_overwrites.py`` (1.19.0):

- ``torch.manual_seed(seed)`` also seeds the HPU generator (``hpu.random.manual_seed``), ``torch.seed()`` seeds it
  with the seed it drew, and ``torch.random.fork_rng`` forks the hpu generator when no ``device_type`` is named
  (with ``devices`` unset that is every index below ``device_count()``: on a machine of several Gaudis
  ``get_rng_state`` then refuses index 1, as on the bridge);
- ``Tensor.record_stream`` of an hpu tensor calls ``hpu.record_stream`` (torch's has no HPU kernel);

and the process-group functions of ``torch.distributed`` (the package's names: torch's own modules, DeviceMesh and
FSDP2 among them, call ``distributed_c10d``'s and are not affected):

- ``new_group(ranks=None, timeout=default_pg_timeout, backend=None, pg_options=None)``: those four parameters only
  (``use_local_synchronization``, ``group_desc`` or ``device_id`` are a TypeError), passed on by position, and a
  group left without a timeout gets torch's default_pg_timeout (30 minutes) whatever the default group's;
- ``init_process_group(backend, init_method=None, timeout=timedelta(seconds=1800), world_size=-1, rank=-1,
  store=None, group_name="", pg_options=None)``: ``backend`` required, nothing after ``pg_options`` (``device_id``
  is a TypeError);
- with ``PT_ENABLE_COMM_GROUP_CACHE`` on (the default, ``scripts/env_flags.yaml``) and an hccl backend (or none
  named), a cache of groups by backend and sorted ranks. In 1.19.0 each call first empties its backend's cache
  (``ranks_cache[backend] = {}``), so ``new_group`` builds a new group every time all the same; and
  ``init_process_group`` then returns nothing. Both wrappers record their calls and what the cache did.
"""

import datetime
import functools
import os

import torch
from torch.distributed.constants import default_pg_timeout

import habana_frameworks as _hf


def _seconds(timeout):
    return None if timeout is None else timeout.total_seconds()


def _comm_group_cache() -> bool:
    """``bridge_config.get_pt_enable_comm_group_cache()``: PT_ENABLE_COMM_GROUP_CACHE, a bool defaulting to true."""
    return os.environ.get("PT_ENABLE_COMM_GROUP_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def overwrite_torch_functions() -> None:
    _overwrite_random()
    _overwrite_record_stream()
    _overwrite_process_groups()


def _overwrite_record_stream() -> None:
    """``Tensor.record_stream`` of an hpu tensor goes to ``hpu.record_stream`` (torch's own has no HPU kernel)."""
    from .. import hpu

    record_orig = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(self, torch.Tensor) and self.device.type == "hpu":
            hpu.record_stream(self, stream)
        else:
            record_orig(self, stream)

    torch.Tensor.record_stream = functools.wraps(record_orig)(record_stream)
    _hf.on_unload(lambda: setattr(torch.Tensor, "record_stream", record_orig))


def _overwrite_random() -> None:
    from ..hpu import random as rand_hpu

    manual_seed_orig, seed_orig, fork_rng_orig = torch.manual_seed, torch.seed, torch.random.fork_rng

    def manual_seed(seed):
        rand_hpu.manual_seed(seed)
        return manual_seed_orig(seed)

    def seed() -> int:
        drawn = seed_orig()
        rand_hpu.manual_seed_all(drawn)
        return drawn

    def fork_rng(devices=None, enabled=True, _caller="fork_rng", _devices_kw="devices", device_type=None):
        return fork_rng_orig(devices=devices, enabled=enabled, _caller=_caller, _devices_kw=_devices_kw,
                             device_type=device_type if device_type else "hpu")  # fmt: skip

    torch.manual_seed = functools.wraps(manual_seed_orig)(manual_seed)
    torch.seed = functools.wraps(seed_orig)(seed)
    torch.random.fork_rng = functools.wraps(fork_rng_orig)(fork_rng)

    def undo() -> None:
        torch.manual_seed, torch.seed, torch.random.fork_rng = manual_seed_orig, seed_orig, fork_rng_orig

    _hf.on_unload(undo)


def _overwrite_process_groups() -> None:
    dist = torch.distributed
    if not dist.is_available():
        return
    new_group_orig, init_process_group_orig = dist.new_group, dist.init_process_group
    ranks_cache: dict = {}

    def new_group(ranks=None, timeout=default_pg_timeout, backend=None, pg_options=None):
        if _comm_group_cache() and (backend is None or "hccl" in backend):
            ranks_cache[backend] = {}  # 1.19.0: emptied at every call, so the lookup below never hits
            if ranks is None:
                key = tuple(range(dist.distributed_c10d.get_world_size()))
            else:
                key = tuple(sorted(ranks))
            cached = key in ranks_cache[backend]
            _hf.record("core.new_group", ranks=list(key), backend=backend, timeout=_seconds(timeout),
                       cached=cached)  # fmt: skip
            if not cached:
                ranks_cache[backend][key] = new_group_orig(ranks, timeout, backend, pg_options)
            return ranks_cache[backend][key]
        _hf.record("core.new_group", ranks=ranks, backend=backend, timeout=_seconds(timeout), cached=None)
        return new_group_orig(ranks, timeout, backend, pg_options)

    def init_process_group(
        backend,
        init_method=None,
        timeout=datetime.timedelta(seconds=1800),
        world_size=-1,
        rank=-1,
        store=None,
        group_name="",
        pg_options=None,
    ):
        _hf.record("core.init_process_group", backend=backend, timeout=_seconds(timeout))
        if _comm_group_cache() and (backend is None or "hccl" in backend):
            ranks_cache[backend] = {}
            init_process_group_orig(
                backend, init_method, timeout, world_size, rank, store, group_name, pg_options
            )  # fmt: skip
            key = tuple(range(dist.distributed_c10d.get_world_size()))
            ranks_cache[backend].setdefault(key, dist.distributed_c10d._get_default_group())
            return None
        return init_process_group_orig(backend, init_method, timeout, world_size, rank, store, group_name, pg_options)

    dist.new_group = functools.wraps(new_group_orig)(new_group)
    dist.init_process_group = functools.wraps(init_process_group_orig)(init_process_group)

    def undo() -> None:
        dist.new_group, dist.init_process_group = new_group_orig, init_process_group_orig

    _hf.on_unload(undo)
