"""What the progress watchdog and the project's collective count cost a step, measured side by side (issue 46's
target: at most 1% of the step time).

One launch per backend, 2 processes under ``optimum-gaudi launch`` (benchmarks/stall_worker.py ``watchdog-ab``): in
the same processes, trainings of a 4-layer GPT-2 (no pauses, --logging_steps 1, so the straggler figures gather
at every step in both arms) alternate between the watchdog at its default settings and ``--hang_timeout 0`` (off,
and the count with it), the order swapped from one round to the next, each training a new trainer and model (a
fresh DDP module). On simulated Gaudis (hccl as the bridge: no sequence numbers, so the count runs and DDP's
gradient buckets go through its hook) and on gloo (torch numbers its collectives: from torch 2.8 the count stays
off there, and the arm measures the watchdog alone). A training's figure is rank 0's median interval from one
step's end to the next after 5 warm-up steps (the step, every callback, the log and their collectives), in wall
time and in the process's CPU time (every thread's, the watchdog's included: on cores shared with other work the
wall time also measures the others, the CPU time much less); the cost is the median of the "on" trainings over
the median of the "off" ones, less 1, and the spread the rounds' own ratios. Not in the difference: torch's flight recorder, which the training arguments turn on for
both arms (the process group is made once); it records gloo's collectives, none of hccl's.

    python -m benchmarks.watchdog_cost [ROUNDS [STEPS]]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import markdown_table, median
from benchmarks.fused_loss import cpu_name
from benchmarks.stalls import _launch

BACKENDS = (("simulated hccl", True), ("gloo", False))  # (name, on simulated Gaudis)
PROCESSES = 2


def one_launch(gaudis: bool, rounds: int, steps: int) -> dict:
    """One launch of ``rounds`` on/off pairs; rank 0's ab.json (each training's median interval, by arm)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        job = _launch(PROCESSES, out, "watchdog-ab", "--max_steps", str(steps), "--save_strategy", "no",
                      gaudis=gaudis, env={"STALL_MODEL": "gpt2", "AB_ROUNDS": str(rounds)})  # fmt: skip
        _, err = job.communicate(timeout=1800)
        if job.returncode != 0:
            raise RuntimeError(f"the launch failed:\n{err[-3000:]}")
        return json.loads((out / "ab.json").read_text())


def measure(rounds: int = 6, steps: int = 60) -> dict:
    """Per backend: each training's median step interval (ms) with the watchdog on and off, in wall time and in
    rank 0's CPU time, whether the count ran, and the costs."""
    runs = {}
    for name, gaudis in BACKENDS:
        r = {key: [x * 1000 for x in values] if isinstance(values, list) else values
             for key, values in one_launch(gaudis, rounds, steps).items()}  # fmt: skip
        for clock in ("", "_cpu"):
            on, off = r[f"on{clock}"], r[f"off{clock}"]
            ratios = sorted(a / b - 1 for a, b in zip(on, off, strict=True))
            r[f"cost{clock}"] = median(on) / median(off) - 1
            r[f"paired{clock}"] = (ratios[0], median(ratios), ratios[-1])
        runs[name] = r
    return runs


def table(runs: dict, steps: int) -> str:
    rows = []
    for name, r in runs.items():
        watched = "watchdog + collective count" if r["counted"] else "watchdog (no count: torch numbers gloo's)"
        for clock, what in (("_cpu", "CPU time"), ("", "wall time")):
            for arm, label in (("on", watched), ("off", "--hang_timeout 0")):
                trainings = ", ".join(f"{x:.1f}" for x in r[f"{arm}{clock}"])
                rows.append([f"{name}, {what}: {label}", f"{median(r[f'{arm}{clock}']):.2f} ms", trainings])
            low, mid, high = (f"{100 * x:+.1f}%" for x in r[f"paired{clock}"])
            rows.append([f"{name}, {what}: cost, median on / median off - 1", f"{100 * r[f'cost{clock}']:+.2f}%",
                         f"each round's on / off - 1: median {mid}, {low} to {high}"])  # fmt: skip
    header = [f"{PROCESSES} processes, a 4-layer GPT-2, {steps} steps a training", "median step",
              "trainings (ms), in round order"]  # fmt: skip
    return markdown_table(header, rows)


def machine() -> str:
    """The CPU, as the section names it: its model, its cores, AVX512-BF16 where it has it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            bf16 = "avx512_bf16" in f.read()
    except OSError:
        bf16 = False
    return f"{cpu_name()}, {os.cpu_count()} cores" + (", AVX512-BF16" if bf16 else "")


def run(rounds: int = 6, steps: int = 60) -> tuple[str, dict]:
    runs = measure(rounds, steps)
    return table(runs, steps), runs


if __name__ == "__main__":
    rounds, steps = (int(a) for a in (sys.argv[1:] + ["6", "60"])[:2])
    text, results = run(rounds, steps)
    print(text)
    print(json.dumps(results, indent=1, default=str))
