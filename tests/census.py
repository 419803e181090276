"""The census of collectives a multi-card run issues on a Gaudi's 'hccl' group, read from the simulator's call logs.

The simulated process group (tests/fakes, ``distributed/hccl``) keeps every distinct collective it runs with the
Python frames that issued it, and writes them with ``FAKE_HPU_CALL_LOG`` at exit. Here each is named by what issued
it (the first engine in ``ISSUERS`` found on its stack), checked against the bridge's maps (``_maps.py``: reduce
ops, dtypes) and against the table in docs/collectives.md, which therefore lists every collective these runs issue.
The multi-process tests on the simulated device call :func:`check` on their own logs (no launch of its own).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "collectives.md"
_MAPS_FILE = ROOT / "tests" / "fakes" / "habana_frameworks" / "torch" / "distributed" / "hccl" / "_maps.py"

# (issuer, module or module:function prefixes): the first issuer any frame of a collective's stack belongs to names it, so the more
# specific come first (a DCP save inside transformers' checkpointing is DCP's; FSDP's all-gather in an evaluation is
# FSDP2's). A collective with no Python frame of any is DDP's gradient buckets, all-reduced by its C++ reducer.
ISSUERS = (
    ("fast_ddp", ("optimum_gaudi.distributed.fast_ddp",)),
    ("sequence parallelism", ("optimum_gaudi.distributed.sequence_parallel",)),
    ("streamed final save", ("optimum_gaudi.distributed.full_weights",)),
    ("fused linear cross-entropy", ("optimum_gaudi.features.linear_cross_entropy",)),
    ("non-finite guard", ("optimum_gaudi.supervision.nonfinite",)),
    ("preemption agreement", ("optimum_gaudi.supervision.preemption",)),
    ("sharded checkpoints", ("optimum_gaudi.checkpoints",)),
    ("torch.distributed.checkpoint", ("torch.distributed.checkpoint",)),
    # the trainer's whole-model norm of FSDP2's partial one (torch < 2.8) is clipping's too
    ("gradient clipping", ("torch.nn.utils.clip_grad", "optimum_gaudi.trainers.trainer:_clip_grad_norm")),
    ("FSDP2", ("torch.distributed.fsdp",)),
    ("DDP", ("torch.nn.parallel.distributed",)),
    ("DeepSpeed", ("deepspeed",)),
    ("accelerate", ("accelerate",)),
    ("transformers", ("transformers",)),
    ("optimum_gaudi", ("optimum_gaudi",)),
)
DDP_REDUCER = "DDP (C++ reducer)"
# Frames of a compiled graph running (dynamo's and AOTAutograd's wrappers, the FX code, which has no module: "?"):
# a collective issued inside one has lost the frames of the code that was compiled into it. Not torch._compile's
# `inner`: that is `_disable_dynamo`'s wrapper, eager code (torch 2.7 puts it around DTensor's __torch_dispatch__,
# inside gradient clipping's all-reduce).
COMPILED = "a torch.compile graph"
_COMPILED_FRAMES = ("torch._functorch._aot_autograd", "torch._dynamo", "torch.fx", "?")


def _maps():
    spec = importlib.util.spec_from_file_location("hccl_maps", _MAPS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def issuer(frames: list[str]) -> tuple[str, str]:
    """(issuer, ``module:function`` of its innermost frame) of a collective's stack (innermost first); one issued
    inside a compiled graph is the graph's unless an issuer's frame comes first."""
    graph = next((i for i, frame in enumerate(frames) if frame.split(":")[0].startswith(_COMPILED_FRAMES)), None)
    for name, prefixes in ISSUERS:
        for frame in frames[:graph]:
            if frame.startswith(prefixes):  # a module (its every function) or one module:function
                return name, frame
    return (DDP_REDUCER, "") if graph is None else (COMPILED, frames[graph])


def read(log_prefix: str | Path, ranks: range) -> list[dict]:
    """Every rank's distinct collectives, as dicts (issuer, where, collective, op, dtypes, group_size)."""
    found = []
    for rank in ranks:
        log = json.loads(Path(f"{log_prefix}.{rank}").read_text())
        for name, op, dtypes, device, size, frames in log.get("collectives", []):
            who, where = issuer(frames)
            found.append(dict(issuer=who, where=where, collective=name, op=op, dtypes=dtypes, device=device,
                              group_size=size, frames=frames))  # fmt: skip
    return found


def documented() -> set[tuple[str, str, str, str]]:
    """(issuer, collective, reduce op or "-", dtypes) of each row of the census table in docs/collectives.md."""
    rows = set()
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] and not set(cells[0]) <= set("-: ") and cells[0] != "issuer":
            rows.add((cells[0], cells[1], cells[2], cells[3]))
    return rows


def key(entry: dict) -> tuple[str, str, str, str]:
    return entry["issuer"], entry["collective"], entry["op"] or "-", ", ".join(entry["dtypes"])


def check(log_prefix: str | Path, ranks: range) -> list[dict]:
    """The run's census: each collective on the device, one the bridge maps, in docs/collectives.md's table."""
    maps, rows = _maps(), documented()
    entries = read(log_prefix, ranks)
    assert entries, "the run issued no collective on 'hccl'"
    for entry in entries:
        assert entry["device"] == "hpu", entry
        problem = maps.problem(entry["collective"], entry["dtypes"], entry["op"])
        assert problem is None, f"the bridge refuses {key(entry)}: {problem} ({entry['frames'][:4]})"
    missing = [entry for entry in entries if key(entry) not in rows]
    assert not missing, f"not in {DOC.name}'s census (add these rows):\n" + "\n".join(table_rows(missing))
    return entries


def table_rows(entries: list[dict]) -> list[str]:
    """Markdown rows for docs/collectives.md (to add a new collective there)."""
    seen = {}
    for entry in entries:
        seen.setdefault(key(entry), entry["where"])
    return [f"| {a} | `{b}` | {c} | {d} | `{seen[(a, b, c, d)]}` |" for a, b, c, d in sorted(seen)]
