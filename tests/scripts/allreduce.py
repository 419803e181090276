"""Test helper run by the launcher: every rank all-reduces its rank + 1 over gloo and writes what it saw."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
record = {
    "rank": rank,
    "world_size": world_size,
    "sum": total.item(),
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
    "argv": sys.argv[1:],
}
(out / f"rank{rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
