"""DDP's gradients with optimum-gaudi's counting hook (supervision/collective_count.py) and without, on 3 gloo
processes (issue 46, point 4).

    ddp_hook_bits.py OUT.json

For a group of 2 and one of 3, gradients stored in the buckets or not, ``zero_grad`` to None or to zeros: 3 steps
of a small model with several buckets, each rank on its own data; rank 0 writes, per case, whether each step's
gradients are bitwise equal, whether the hook was installed, and how many all-reduces it counted.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimum_gaudi.supervision import collective_count

WORLD = 3


def gradients(group, as_view: bool, to_none: bool, hooked: str) -> tuple[list[list[torch.Tensor]], bool]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40), torch.nn.Linear(40, 3)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, process_group=group, gradient_as_bucket_view=as_view, bucket_cap_mb=0.004
    )
    installed = False
    if hooked == "asked":
        installed = collective_count.count_ddp_reductions(ddp)
    elif hooked == "forced":
        ddp.register_comm_hook(group, collective_count._count_and_reduce)
        installed = True
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    steps = []
    for _ in range(3):
        x = torch.randn(8, 24, generator=generator)
        ddp(x).pow(2).mean().backward()
        steps.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=to_none)
    return steps, installed


def worker(rank: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    collective_count._active = collective_count.CollectiveCount()  # count as where the backend keeps no count
    results = {}
    for size, group in ((2, pair), (3, dist.GroupMember.WORLD)):
        for as_view in (False, True):
            for to_none in (True, False):
                for hooked in ("asked", "forced") if size == 3 and as_view else ("asked",):
                    if rank >= size:
                        continue
                    plain, _ = gradients(group, as_view, to_none, "no")
                    before = collective_count._active.counts.get(collective_count.group_key(group), 0)
                    counted, installed = gradients(group, as_view, to_none, hooked)
                    after = collective_count._active.counts.get(collective_count.group_key(group), 0)
                    equal = [
                        all(torch.equal(a, b) for a, b in zip(p, c, strict=True))
                        for p, c in zip(plain, counted, strict=True)
                    ]
                    results[f"size={size} view={as_view} to_none={to_none} hook={hooked}"] = {
                        "equal": equal, "installed": installed, "counted": after - before,
                    }  # fmt: skip
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "store"), sys.argv[1]), nprocs=WORLD)
