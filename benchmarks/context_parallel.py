"""The longest sequence a Llama trains under a per-process memory cap: 1 process against 2 splitting each sequence
(--context_parallel_size 2).

A small Llama (2 layers, width 256, 8 query and 4 key/value heads, Llama 2's 32k vocabulary), batch 1, float32,
sdpa, AdamW. A length fits when a fresh run (1 process, or 2 under torchrun) training one step on it keeps the peak
resident memory (VmHWM) of every process within the cap; a binary search over multiples of 256 tokens finds the
longest. (Trying lengths one after the other in one process measured memory glibc kept from the earlier tries.)

`python benchmarks/context_parallel.py OUT.json LENGTH` is the worker (directly, or under torchrun).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

STEP = 256  # lengths are multiples of this (and of 2, so the split needs no padding)
LONGEST = 16 * 1024
VOCAB = 32000  # Llama 2's


def _peak_rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=LONGEST, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _peak_mb(length: int, split: int, tmp: str) -> float:
    """Train a step on `length` tokens in this (fresh) process; the largest peak resident MB over the ranks."""
    import torch

    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

    ids = torch.tensor([1 + i % (VOCAB - 1) for i in range(length)])
    args = GaudiTrainingArguments(
        output_dir=tmp, max_steps=1, per_device_train_batch_size=1, report_to="none", save_strategy="no",
        disable_tqdm=True, context_parallel_size=split, logging_steps=1,
    )  # fmt: skip
    trainer = GaudiTrainer(model=_llama(), args=args, train_dataset=[{"input_ids": ids, "labels": ids}])
    trainer.train()
    peak = torch.tensor(_peak_rss_mb())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return peak.item()


def worker() -> None:
    """One try: train a step on LENGTH tokens, write the largest peak over the ranks."""
    import torch

    out, length = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        peak = _peak_mb(length, int(os.environ.get("WORLD_SIZE", "1")), tmp)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"peak_mb": peak}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo ranks sometimes hang at interpreter exit (tests/scripts/train_tiny.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _try(processes: int, length: int) -> float:
    """The peak resident memory (MB, largest over the processes) of a fresh run training `length` tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, str(out), str(length)]
        if processes > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
            cmd = [*launcher, "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *cmd[1:]]
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{processes} process(es), {length} tokens failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())["peak_mb"]


def longest(processes: int, cap_mb: float) -> dict:
    """Binary search over multiples of STEP: the longest length whose peak stays within the cap."""
    tries = {}
    low, high = 0, LONGEST // STEP + 1  # low fits (0: nothing), high does not
    while high - low > 1:
        middle = (low + high) // 2
        tries[middle * STEP] = round(_try(processes, middle * STEP))
        low, high = (middle, high) if tries[middle * STEP] <= cap_mb else (low, middle)
    return {"longest": low * STEP, "tries": tries}


def run(cap_mb: int = 1200) -> tuple[str, dict]:
    from benchmarks.common import markdown_table

    one, two = longest(1, cap_mb), longest(2, cap_mb)
    rows = []
    for name, result in (("1 process", one), ("2 processes, --context_parallel_size 2", two)):
        tried = ", ".join(f"{n}: {mb}" for n, mb in sorted(result["tries"].items(), key=lambda kv: int(kv[0])))
        rows.append([name, f"{result['longest']:,}", tried])
    table = markdown_table(["setup", f"longest sequence within {cap_mb} MB per process", "tried (tokens: peak MB)"], rows)  # fmt: skip
    text = (
        "A small Llama (2 layers, width 256, 8 query and 4 key/value heads, Llama 2's 32k vocabulary), float32, "
        f"sdpa, AdamW, batch 1; the peak resident memory of each process of a fresh run against a {cap_mb} MB cap, "
        f"binary search over multiples of {STEP} tokens.\n\n{table}"
    )
    return text, {"one": one["longest"], "two": two["longest"]}


if __name__ == "__main__":
    worker()
