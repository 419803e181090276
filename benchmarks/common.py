"""Shared pieces of the benchmarks: the embedded data, a step clock that skips warm-up, table output."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

BLOCK_SIZE = 128


def lm_data(train_blocks: int, eval_blocks: int, vocab_size: int = 4096):
    """Blocks of the embedded corpus: the same tokens for every variant, so losses compare."""
    # imported here: the GPU benchmark (random tokens) runs on lent machines without the datasets package
    from optimum_gaudi.data.corpus import default_datasets, default_tokenizer, tokenize_and_group

    tokenizer = default_tokenizer(vocab_size)
    blocks = tokenize_and_group(default_datasets(), tokenizer, BLOCK_SIZE)
    train = blocks["train"].select(range(train_blocks))
    valid = blocks["validation"].select(range(eval_blocks))
    return tokenizer, train, valid


def gpt2(tokenizer, n_layer: int, n_embd: int, n_head: int, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=BLOCK_SIZE, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class StepClock(TrainerCallback):
    """Wall time of the optimizer steps after the first `warmup` (compilation, allocator growth), and of
    the warm-up itself."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.begin: float | None = None
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now, cpu = time.perf_counter(), time.process_time()
        if state.global_step == self.warmup:
            self.start, self.cpu_start = now, cpu
        elif state.global_step > self.warmup:
            self.end, self.cpu_end, self.steps = now, cpu, state.global_step - self.warmup

    @property
    def cpu_seconds_per_step(self) -> float:
        """CPU time of this process (all its threads) per timed step: what a shared machine's load does not add."""
        if not self.steps:
            raise ValueError(f"no step after the {self.warmup} warm-up steps was timed: train for more steps")
        return (self.cpu_end - self.cpu_start) / self.steps

    @property
    def seconds_per_step(self) -> float:
        if not self.steps:
            raise ValueError(f"no step after the {self.warmup} warm-up steps was timed: train for more steps")
        return (self.end - self.start) / self.steps

    @property
    def warmup_excess_seconds(self) -> float:
        """How much longer the warm-up steps took than the same steps at the steady speed: the compile
        time, when they compiled (never below 0)."""
        return max(0.0, (self.start - self.begin) - self.warmup * self.seconds_per_step)


def in_new_process(module: str, request: list, env: dict[str, str] | None = None, timeout: int = 1800) -> list:
    """``python -m module request`` from the repository root: each run in its own process, so that nothing
    process-wide one setup leaves behind (compiled code, autocast kernels, allocator settings) reaches the
    next. The module's ``__main__`` answers with one JSON line, its last line on stdout."""
    path = os.pathsep.join(entry for entry in sys.path if entry)  # what this process imports (torchao may be added)
    done = subprocess.run(
        [sys.executable, "-m", module, json.dumps([*request, torch.get_num_threads()])],
        cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "PYTHONPATH": path, **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{module} {request} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def request_from_argv() -> list:
    """The request in_new_process sent, with torch set to the caller's thread count."""
    *request, threads = json.loads(sys.argv[1])
    torch.set_num_threads(threads)
    return request


def median(values: list[float]) -> float:
    return statistics.median(values)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
