"""fast_ddp against DDP on 2 CPU processes, and 2-process scaling, on a small GPT-2 (4x256) (global batch 16).

  single_2threads  1 process, 2 torch threads, batch 16
  ddp_2procs       2 gloo processes, 1 thread each, batch 8 each, DistributedDataParallel
  fast_ddp_2procs  the same with --distribution_strategy fast_ddp (one fused float32 all-reduce per step)
  ddp_gaudi_settings_2procs  DDP with the settings a Gaudi gets (devices/hpu.py ddp_defaults: 230 MB buckets,
                   gradients as bucket views) in place of transformers' (25 MB, copies)
  ddp_oh_settings_2procs     the same plus optimum-habana's --ddp_find_unused_parameters false

Each run is a fresh process (torchrun for the 2-process ones); variants interleave, medians of repeats.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import markdown_table, median

WORKER = str(Path(__file__).resolve().parent / "dist_worker.py")
VARIANTS = {
    "single_2threads": (1, 2, ["--per_device_train_batch_size", "16"]),
    "ddp_2procs": (2, 1, ["--per_device_train_batch_size", "8"]),
    "fast_ddp_2procs": (2, 1, ["--per_device_train_batch_size", "8", "--distribution_strategy", "fast_ddp"]),
    # DDP with the settings optimum-gaudi gives DDP on a Gaudi (bucket 230 MB, gradients as bucket views), and
    # with optimum-habana's no-unused-parameter search on top
    "ddp_gaudi_settings_2procs": (2, 1, ["--per_device_train_batch_size", "8", "--bench_gaudi_ddp_settings"]),
    "ddp_oh_settings_2procs": (
        2,
        1,
        ["--per_device_train_batch_size", "8", "--bench_gaudi_ddp_settings", "--ddp_find_unused_parameters", "false"],
    ),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(variant: str, steps: int, warmup: int) -> dict:
    nproc, threads, flags = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, WORKER, str(out), str(steps), str(warmup), *flags]
        if nproc > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
            cmd = launcher + ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *cmd[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def run(repeats: int = 3, steps: int = 30, warmup: int = 5, log=print) -> tuple[str, dict]:
    """A markdown table, and the median steps/s of each variant for the target check."""
    results = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant in VARIANTS:
            result = run_once(variant, steps, warmup)
            results[variant].append(result)
            log(f"  {variant} run {r + 1}: {result['steps_per_second']:.3f} steps/s, loss {result['loss']:.4f}")
    speed = {v: median([x["steps_per_second"] for x in runs]) for v, runs in results.items()}
    rows = [
        [v, f"{speed[v]:.3f}", f"{speed[v] / speed['ddp_2procs']:.2f}x", f"{speed[v] / speed['single_2threads']:.2f}",
         f"{median([x['loss'] for x in results[v]]):.4f}"]
        for v in VARIANTS
    ]  # fmt: skip
    header = ["variant", "steps/s (median)", "vs ddp_2procs", "vs single process", f"train loss at step {steps}"]
    table = markdown_table(header, rows)
    log(table)
    intro = f"GPT-2 small (4x256), global batch 16 x 128 tokens, {repeats} runs each, {warmup} warm-up steps excluded."
    return f"{intro}\n\n{table}", speed
