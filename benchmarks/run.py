"""`make bench`: run every benchmark in one process, print the tables, write docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import allreduce_model, distributed, train_speed  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402

HEADER = """# Benchmarks

Made by `make bench` ({date}) on: {machine}, {cpus} CPUs, torch {torch}, {threads} torch threads.
Every number comes from one run of `benchmarks/run.py`; ratios compare variants measured side by side in
that run (interleaved, medians of repeats). Throughput excludes warm-up steps.
"""


LOSS_TOLERANCE = 0.01  # bf16 may change the eval loss after the same steps by at most this much


def targets(speed: dict, dist: dict) -> str:
    """The issues' targets, each checked against this run's medians."""
    rows = []

    def check(name: str, value: float, goal: float, fmt: str = "{:.2f}x", at_most: bool = False) -> None:
        met = value <= goal if at_most else value >= goal
        bound = "<=" if at_most else ">="
        rows.append([name, f"{bound} {fmt.format(goal)}", fmt.format(value), "met" if met else "**missed**"])

    for model, m in speed.items():
        gaudi, fp32, bf16 = m["gaudi_gpt2"], m["trainer_fp32"], m["trainer_bf16"]
        check(f"{model}: GaudiTrainer / default Trainer, tokens/s", gaudi[0] / fp32[0], 1.6)
        check(f"{model}: GaudiTrainer / hand-tuned Trainer (--bf16, fused AdamW)", gaudi[0] / bf16[0], 1.0)
        check(f"{model}: eval loss, GaudiTrainer bf16 - fp32", abs(gaudi[1] - fp32[1]), LOSS_TOLERANCE, "{:.4f}", True)
    check("fast_ddp / ddp, steps/s on 2 processes", dist["fast_ddp_2procs"] / dist["ddp_2procs"], 1.1)
    check("2-process scaling (ddp / 1 process, 2 threads)", dist["ddp_2procs"] / dist["single_2threads"], 0.95)
    check("2-process scaling (fast_ddp / 1 process)", dist["fast_ddp_2procs"] / dist["single_2threads"], 0.95)
    return markdown_table(["target", "goal", "this run", ""], rows)


def main() -> None:
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    quick = os.environ.get("BENCH_QUICK") == "1"  # a smoke run of the benchmark code, not for the docs
    start = time.time()
    print("== training speed: GaudiTrainer vs transformers.Trainer")
    repeats, steps, warmup = (1, 8, 2) if quick else (3, 30, 5)
    speed, speed_medians = train_speed.run(repeats=repeats, steps=steps, warmup=warmup)
    print("== distributed: fast_ddp vs ddp on 2 gloo processes")
    dist, dist_speed = distributed.run(repeats=repeats, steps=steps, warmup=warmup)
    print("== all-reduce cost model")
    model = allreduce_model.run()
    header = HEADER.format(
        date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
        cpus=os.cpu_count(), torch=torch.__version__, threads=threads,
    )  # fmt: skip
    body = (
        f"{header}\n## Targets\n\n{targets(speed_medians, dist_speed)}\n\n## Training speed on this CPU\n\n{speed}\n\n"
        f"## Distributed: fast_ddp and DDP on 2 CPU processes\n\n{dist}\n\n"
        f"## All-reduce at scale: an alpha-beta estimate\n\n{model}\n\n"
        f"Total benchmark time: {time.time() - start:.0f} s.\n"
    )
    if quick:
        print(body)
        return
    (ROOT / "docs").mkdir(exist_ok=True)
    (ROOT / "docs" / "benchmarks.md").write_text(body)
    print(f"wrote {ROOT / 'docs' / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
