"""Freed tensor memory stays in the process during a loop on the host, and goes back to the OS after it."""

from __future__ import annotations

import resource

import pytest
import torch

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import host_memory

needs_glibc = pytest.mark.skipif(host_memory.glibc() is None, reason="glibc's mallopt only")
BLOCK = 64 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): unmapped when freed by default


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def released_when_freed() -> int:
    """Bytes the process gives back to the OS when a touched BLOCK-sized tensor is freed."""
    block = torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
    touched = rss()
    del block
    return touched - rss()


@needs_glibc
def test_a_block_freed_in_the_loop_stays_in_the_process_and_goes_back_after_it():
    assert released_when_freed() > 0.9 * BLOCK  # by default, glibc unmaps it at once
    with host_memory.freed_memory_kept() as kept:
        kept_in_loop = released_when_freed()
        held = rss()
    assert kept
    assert kept_in_loop < 0.1 * BLOCK  # kept for the next step: its pages are not faulted in again
    assert held - rss() > 0.9 * BLOCK  # malloc_trim at the end of the loop


class RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append(("mallopt", parameter, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_nested_loops_keep_the_outer_settings_and_the_end_gives_memory_back(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(host_memory, "glibc", lambda: libc)
    with host_memory.freed_memory_kept():
        with host_memory.freed_memory_kept():  # evaluation inside training
            pass
        assert ("malloc_trim", 0) not in libc.calls
    keep = [("mallopt", host_memory.M_TRIM_THRESHOLD, host_memory.KEPT_BELOW),
            ("mallopt", host_memory.M_MMAP_THRESHOLD, host_memory.KEPT_BELOW)]  # fmt: skip
    after = [("mallopt", p, v) for p, v in host_memory.AFTER_LOOP.items()]
    assert libc.calls == [*keep, *after, ("malloc_trim", 0)]


def test_without_glibc_nothing_changes(monkeypatch):
    monkeypatch.setattr(host_memory, "glibc", lambda: None)
    with host_memory.freed_memory_kept() as kept:
        assert not kept


def test_gaudi_trainer_keeps_host_memory_for_each_loop_on_cpu(monkeypatch, tiny_gpt2, tiny_lm_data, tmp_path):
    libc = RecordingLibc()
    monkeypatch.setattr(host_memory, "glibc", lambda: libc)
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, eval_strategy="steps", eval_steps=2,
        report_to=[], save_strategy="no", use_cpu=True,
    )  # fmt: skip
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data, eval_dataset=tiny_lm_data[:16])
    trainer.train()  # the evaluations inside training keep training's settings
    trainer.evaluate()
    one_loop = [("mallopt", host_memory.M_TRIM_THRESHOLD, host_memory.KEPT_BELOW),
                ("mallopt", host_memory.M_MMAP_THRESHOLD, host_memory.KEPT_BELOW),
                *[("mallopt", p, v) for p, v in host_memory.AFTER_LOOP.items()], ("malloc_trim", 0)]  # fmt: skip
    assert libc.calls == one_loop * 2


@needs_glibc
def test_a_sharded_run_gives_freed_memory_back(monkeypatch, tiny_gpt2, tmp_path):
    """FSDP (or sequences split over ranks) trains to save memory: kept blocks would fragment the heap past what
    sharding saves, so the loop gives freed blocks back at once."""
    libc = RecordingLibc()
    monkeypatch.setattr(host_memory, "glibc", lambda: libc)
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = GaudiTrainer(model=tiny_gpt2(), args=args)
    trainer.is_fsdp_enabled = True  # as a run under --fsdp on several processes has it
    with trainer._loop_context():
        pass
    returned = [("mallopt", host_memory.M_TRIM_THRESHOLD, host_memory.RETURNED_FROM),
                ("mallopt", host_memory.M_MMAP_THRESHOLD, host_memory.RETURNED_FROM)]  # fmt: skip
    assert libc.calls[:2] == returned and ("malloc_trim", 0) in libc.calls
    libc.calls.clear()
    trainer.is_fsdp_enabled = False
    with trainer._loop_context():
        pass
    assert libc.calls[0] == ("mallopt", host_memory.M_TRIM_THRESHOLD, host_memory.KEPT_BELOW)
