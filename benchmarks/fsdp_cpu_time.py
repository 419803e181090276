"""FSDP2 on 2 CPU processes: GaudiTrainer against a hand-written FSDP2 loop, in CPU time per step and peak memory,
along the malloc thresholds a sharded run sets (``devices/host_memory.py``, ``RETURNED_FROM``).

The hand-written loop is what a user writes from torch's FSDP2 tutorial: ``fully_shard`` on each decoder layer and
on the model, torch's fused AdamW, the gradient norm clipped to 1.0 (as the Trainer does by default), glibc's own
malloc thresholds. GaudiTrainer trains the same model on the same rows with ``--fsdp full_shard``; in a sharded
run its CPU device gives freed blocks from ``RETURNED_FROM`` up back to the OS (each its own mapping, the heap's
top trimmed once that much is free), and the curve runs that threshold over 1, 2, 4, 8, 16 and 32 MiB, beside glibc's
own (dynamic) thresholds.

CPU time (all threads of a rank's process, ``time.process_time``), not wall time: the machine is shared, and
CPU time is what another user's load adds least to. Each setup is its own 2 processes (torchrun, gloo, 1 thread
each); each rank reports its CPU seconds per timed step, minor page faults per timed step, peak RSS (getrusage)
and peak less the resident set before the model was built. This file is also the worker
(``python -m benchmarks.fsdp_cpu_time OUT.json STEPS WARMUP SETUP``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH, SEQUENCE = 4, 256
# 56.6M parameters: 7 decoder layers of 6.3M (FSDP's units), an untied 8,192-token vocabulary
WIDTHS = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=7, num_attention_heads=12,
              num_key_value_heads=4, max_position_embeddings=SEQUENCE, tie_word_embeddings=False)  # fmt: skip
MIB = 1 << 20
THRESHOLDS_MIB = (1, 2, 4, 8, 16, 32)
# setup: None for the hand-written loop, else GaudiTrainer's sharded-loop threshold in bytes ("glibc": glibc's own
# dynamic thresholds, nothing set)
SETUPS: dict[str, int | str | None] = {
    "hand_written_fsdp2": None,
    **{f"gaudi_trainer_{t}MiB": t * MIB for t in THRESHOLDS_MIB},
    "gaudi_trainer_glibc": "glibc",
}
GB = 1024**3


def host_memory_threshold_mib() -> int:
    """The threshold GaudiTrainer's sharded CPU runs use (devices/host_memory.py), in MiB."""
    from optimum_gaudi.devices import host_memory

    return host_memory.RETURNED_FROM // MIB


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rows(steps: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, WIDTHS["vocab_size"], (steps * GLOBAL_BATCH, SEQUENCE), generator=g).tolist()


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**WIDTHS))


class _Meter:
    """CPU time and minor page faults of the timed steps (after `warmup`), then this rank's figures."""

    def __init__(self, warmup: int, baseline: int) -> None:
        self.warmup, self.baseline, self.marks = warmup, baseline, {}

    def step_done(self, step: int, steps: int) -> None:
        if step in (self.warmup, steps):
            self.marks[step] = (time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def figures(self, steps: int) -> dict:
        (cpu0, faults0), (cpu1, faults1) = self.marks[self.warmup], self.marks[steps]
        timed = steps - self.warmup
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"cpu_per_step": (cpu1 - cpu0) / timed, "faults_per_step": (faults1 - faults0) / timed, "peak": peak,
                "above_baseline": peak - self.baseline}  # fmt: skip


def _hand_written(steps: int, meter: _Meter, rank: int, world: int) -> list[float]:
    """torch's FSDP2, as its tutorial writes the loop; returns rank 0's losses."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rows, per_rank, losses = _rows(steps), GLOBAL_BATCH // world, []
    for step in range(1, steps + 1):
        start = (step - 1) * GLOBAL_BATCH + rank * per_rank
        ids = torch.tensor(rows[start : start + per_rank])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        meter.step_done(step, steps)
    return losses


def _gaudi_trainer(steps: int, meter: _Meter, world: int, threshold: int | str) -> list[float]:
    from transformers import TrainerCallback

    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
    from optimum_gaudi.devices import CPUDevice, host_memory

    if threshold == "glibc":  # nothing set: glibc's dynamic thresholds
        CPUDevice.loop_memory = lambda self, sharded=False: contextlib.nullcontext()
    else:
        host_memory.RETURNED_FROM = threshold

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            meter.step_done(state.global_step, steps)

    data = [{"input_ids": r, "labels": r} for r in _rows(steps)]
    with tempfile.TemporaryDirectory() as tmp:
        args = GaudiTrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=GLOBAL_BATCH // world, report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-4, seed=0, fsdp="full_shard",
            lr_scheduler_type="constant", dataloader_num_workers=0,
        )  # fmt: skip
        trainer = GaudiTrainer(model=_model(), args=args, train_dataset=data, callbacks=[Steps()])
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def work(out: str, steps: int, warmup: int, setup: str) -> None:
    """One rank of one setup."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    threshold = SETUPS[setup]
    meter = _Meter(warmup, _rss_bytes())
    if threshold is None:
        dist.init_process_group("gloo")
        losses = _hand_written(steps, meter, rank, world)
    else:
        losses = _gaudi_trainer(steps, meter, world, threshold)
    ranks = [None] * world
    dist.all_gather_object(ranks, meter.figures(steps))
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": ranks, "losses": losses}))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # FSDP over gloo sometimes never finishes interpreter exit (see dist_worker.py)


def run_once(setup: str, steps: int, warmup: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "benchmarks.fsdp_cpu_time"]
        command += [str(out), str(steps), str(warmup), setup]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"{setup} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def run(steps: int = 10, warmup: int = 3, repeats: int = 2, setups=None, log=print) -> tuple[str, dict]:
    """A markdown table, and per setup the medians over repeats of the ranks' mean CPU s/step and largest peak."""
    from benchmarks.common import markdown_table, median

    setups = list(setups or SETUPS)
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    for r in range(repeats):  # interleaved: drift in the machine's speed hits every setup alike
        for setup in setups:
            result = run_once(setup, steps, warmup)
            ranks = result["ranks"]
            figures = {
                "cpu_per_step": sum(x["cpu_per_step"] for x in ranks) / len(ranks),
                "faults_per_step": sum(x["faults_per_step"] for x in ranks) / len(ranks),
                "peak": max(x["peak"] for x in ranks),
                "above_baseline": max(x["above_baseline"] for x in ranks),
                "loss": result["losses"][-1],
            }
            runs[setup].append(figures)
            log(f"  {setup} run {r + 1}: {figures['cpu_per_step']:.2f} CPU s/step, {figures['peak'] / GB:.2f} GB peak")
    results = {s: {k: median([f[k] for f in fs]) for k in fs[0]} for s, fs in runs.items()}
    hand = results["hand_written_fsdp2"]
    rows = [
        [setup, f"{m['cpu_per_step']:.2f}", f"{m['cpu_per_step'] / hand['cpu_per_step']:.2f}x",
         f"{m['faults_per_step'] / 1000:.0f}k", f"{m['peak'] / GB:.2f}", f"{m['peak'] / hand['peak']:.2f}x",
         f"{m['above_baseline'] / GB:.2f}", f"{m['above_baseline'] / hand['above_baseline']:.2f}x", f"{m['loss']:.4f}"]
        for setup, m in results.items()
    ]  # fmt: skip
    header = ["setup", "CPU s/step", "vs hand-written", "page faults/step", "peak RSS (GB)", "vs hand-written",
              "above baseline (GB)", "vs hand-written", f"loss at step {steps}"]  # fmt: skip
    table = markdown_table(header, rows)
    parameters = 16 * WIDTHS["hidden_size"] ** 2  # replaced below by the real count
    with contextlib.suppress(Exception):
        parameters = sum(p.numel() for p in _model().parameters())
    intro = (
        f"LlamaForCausalLM, random weights, {parameters / 1e6:.1f}M parameters (hidden {WIDTHS['hidden_size']}, "
        f"{WIDTHS['num_hidden_layers']} layers, vocabulary {WIDTHS['vocab_size']}, untied), float32, AdamW, FSDP2 "
        f"(full_shard, each decoder layer a unit) on 2 processes (torchrun, gloo, 1 thread each); global batch "
        f"{GLOBAL_BATCH} x {SEQUENCE} tokens; {steps} steps, {warmup} left out. CPU s/step: a rank's process CPU "
        f"time per timed step (all threads), mean of the 2 ranks; page faults: minor faults per step and rank; peak "
        f"RSS: the larger rank's (getrusage), above baseline: less its resident set before the model was built. "
        f"Medians of {repeats} runs, setups interleaved. hand_written_fsdp2: fully_shard per layer and on the model, "
        f"fused AdamW, clipping to 1.0, glibc's own malloc thresholds; gaudi_trainer_N: GaudiTrainer --fsdp "
        f"full_shard with freed blocks from N up given back at once (RETURNED_FROM), _glibc: glibc's own thresholds "
        f"(nothing set)."
    )
    log(table)
    return f"{intro}\n\n{table}", results


if __name__ == "__main__":
    work(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
