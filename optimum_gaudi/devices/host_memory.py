"""Keep freed tensor memory in the process while a training or evaluation loop runs on the host.

glibc's malloc gives large blocks back to the OS as soon as they are freed (every block above its mmap
threshold, which grows by itself to at most 32 MiB) and trims the top of its heap. A training step frees
and allocates the same large activations and gradients every step, so the kernel hands those pages back
zeroed and faults them in again each step: some 50,000 minor page faults a step on the benchmarks' GPT-2
4x256 on CPU. Raising both thresholds for the loop keeps freed blocks for the next step, which is what the
CUDA and HPU caching allocators do for device memory. When the loop ends, the free memory goes back to the
OS (``malloc_trim``) and the thresholds are set to what a process that frees large blocks reaches by itself.
Elsewhere than glibc (musl, macOS, Windows) nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Iterator
from typing import Any

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

KEPT_BELOW = 1 << 30  # blocks below 1 GiB stay in the heap during a loop
# In a sharded run's loop, blocks from 8 MiB up go back to the OS when freed (and the heap's top is trimmed once 8 MiB
# are free there). `BENCH_SECTIONS=fsdp_cpu_time make bench` measured 1-32 MiB against a hand-written FSDP2 loop (56.6M
# Llama, 2 processes, docs/benchmarks.md): 1 MiB took 1.53x its CPU time a step at 0.58x its peak memory (677k page
# faults a step: memory given back and faulted in again), 8 MiB 1.11x at 0.68x, 32 MiB and glibc's own thresholds
# 0.90x at 0.92-0.98x. 8 MiB is the largest that keeps the memory FSDP is for (target <= 0.75x) at about the loop's
# CPU time (target <= 1.1x).
RETURNED_FROM = 8 << 20
# glibc's dynamic thresholds once the process has freed a block of its largest mmap size (32 MiB on
# 64-bit): where a training process ends up anyway, so code after the loop runs as it would have
AFTER_LOOP = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}

_depth = 0


@functools.cache
def glibc() -> Any | None:
    """The process's C library when it is glibc (it has mallopt and malloc_trim), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version, libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's symbols)
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def freed_memory_kept(returned: bool = False) -> Iterator[bool]:
    """Within: freed blocks below ``KEPT_BELOW`` stay in the process. Yields whether that holds here.

    ``returned``: the opposite, for a run whose point is memory (sharded over ranks): every block from
    ``RETURNED_FROM`` (8 MiB) up is its own mapping, given back when freed, and the heap's top is trimmed as soon as
    that much is free, so blocks of many sizes (FSDP's gathered layers) never fragment a heap that keeps them.
    Process-wide, as the allocator is; nested loops (an evaluation inside training) keep the outer
    loop's settings until the outer loop ends.
    """
    global _depth
    libc = glibc()
    if libc is None:
        yield False
        return
    if _depth == 0 and returned:
        libc.mallopt(M_TRIM_THRESHOLD, RETURNED_FROM)
        libc.mallopt(M_MMAP_THRESHOLD, RETURNED_FROM)
    elif _depth == 0:
        libc.mallopt(M_TRIM_THRESHOLD, KEPT_BELOW)
        if libc.mallopt(M_MMAP_THRESHOLD, KEPT_BELOW) != 1:  # older glibc refuses more than 32 MiB
            libc.mallopt(M_MMAP_THRESHOLD, AFTER_LOOP[M_MMAP_THRESHOLD])
    _depth += 1
    try:
        yield True
    finally:
        _depth -= 1
        if _depth == 0:
            for parameter, value in AFTER_LOOP.items():
                libc.mallopt(parameter, value)
            libc.malloc_trim(0)
