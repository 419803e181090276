"""Test helper run by the launcher: rank 0 blocks in an all_reduce while rank 1 fails.

    fault.py raise OUT_DIR    rank 1 raises an exception
    fault.py kill OUT_DIR     rank 1 kills itself with SIGKILL
    fault.py hang OUT_DIR     every rank waits (in an all_reduce on rank 0, in a sleep elsewhere) until stopped
    fault.py lose0 OUT_DIR    rank 0 raises while rank 1 sleeps outside any collective, as a rank waiting in an
                              HCCL collective would, which does not notice that its peer has gone

Each rank first writes its pid and its parent's (the torchrun agent) to OUT_DIR/pids{rank}.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

mode, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
(out / f"pids{rank}").write_text(f"{os.getpid()} {os.getppid()}")
if rank == 0 and mode == "lose0":
    while not (out / "pids1").exists():
        time.sleep(0.05)
    raise RuntimeError("rank 0 fails on purpose")
if rank == 0:
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: this waits until the launcher stops the job
    sys.exit("rank 0 got past an all_reduce that rank 1 never joined")
while not (out / "pids0").exists():
    time.sleep(0.05)
time.sleep(0.5)  # let rank 0 settle into its all_reduce
if mode == "raise":
    raise RuntimeError("rank 1 fails on purpose")
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(600)  # hang, lose0: until the launcher stops this rank
