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

HEADER = """# Benchmarks

Made by `make bench` ({date}) on: {machine}, {cpus} CPUs, torch {torch}, {threads} torch threads.
Every number comes from one run of `benchmarks/run.py`; ratios compare variants measured side by side in
that run (interleaved, medians of repeats). Throughput excludes warm-up steps.
"""


def main() -> None:
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    quick = os.environ.get("BENCH_QUICK") == "1"  # a smoke run of the benchmark code, not for the docs
    start = time.time()
    print("== training speed: GaudiTrainer vs transformers.Trainer")
    repeats, steps, warmup = (1, 8, 2) if quick else (3, 30, 5)
    speed = train_speed.run(repeats=repeats, steps=steps, warmup=warmup)
    print("== distributed: fast_ddp vs ddp on 2 gloo processes")
    dist = distributed.run(repeats=repeats, steps=steps, warmup=warmup)
    print("== all-reduce cost model")
    model = allreduce_model.run()
    header = HEADER.format(
        date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
        cpus=os.cpu_count(), torch=torch.__version__, threads=threads,
    )  # fmt: skip
    body = (
        f"{header}\n## Training speed on this CPU\n\n{speed}\n\n"
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
