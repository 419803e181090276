"""Every process group the project makes waits no longer than --ddp_timeout (issue 38, point 1).

    group_timeouts.py OUT_DIR --ddp_timeout SECONDS

Run on 2 processes. The arguments make the default group (as transformers does, with --ddp_timeout) and the run's
parallel layout (--context_parallel_size 2); then every rank makes the layout's host group, --async_save's writer
groups (made alike: one of them) and the sequence-parallel group, and rank 1 never joins
a collective on them: rank 0 times how long each all-reduce waits before it fails, and writes OUT_DIR/waits.json.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import HfArgumentParser

from optimum_gaudi import GaudiTrainingArguments


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    argv = ["--output_dir", str(out), "--context_parallel_size", "2", *argv]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    args.device  # noqa: B018 - makes the default process group, as the Trainer does
    layout = args.parallel_layout
    groups = {
        "host": layout.host_group(),
        "async_save_model": layout.host_group("async_save_model"),
        "sequence_parallel": layout.sequence_group(),
    }
    if dist.get_rank() == 1:  # never joins: alive, but stuck elsewhere until rank 0 is done
        deadline = time.monotonic() + 4 * args.ddp_timeout + 10
        while not (out / "waits.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    waits = {}
    for name, group in groups.items():
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            waits[name] = {"seconds": time.monotonic() - started, "failed": False}
        except RuntimeError:
            waits[name] = {"seconds": time.monotonic() - started, "failed": True}
    (out / "waits.json").write_text(json.dumps(waits))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
