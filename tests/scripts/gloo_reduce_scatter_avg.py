"""Two gloo processes reduce-scatter with ReduceOp.AVG; rank 0 writes whether they got the mean (argv[1])."""

import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
out = torch.zeros(2)
dist.reduce_scatter_tensor(out, torch.full((4,), 3.0 + dist.get_rank()), op=dist.ReduceOp.AVG)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"result": out.tolist()}, f)
dist.destroy_process_group()
