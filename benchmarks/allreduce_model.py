"""Alpha-beta estimate of gradient all-reduce time for a 7B-parameter model on Gaudi2 clusters.

Ring all-reduce of n bytes over p cards: T = 2(p-1)·alpha + 2(p-1)/p · n / B, per collective.
DDP issues one collective per gradient bucket (25 MB by default), so its latency term is paid
n/25MB times; fast_ddp issues one collective per step over one buffer, bf16 by default on HPU.

Assumptions (stated, not measured here): B = 300 Gb/s = 37.5 GB/s per card, the 3 scale-out
100 GbE RoCE ports of a Gaudi2 (the 21 other ports form the in-node mesh, which is faster than the ring
needs within 8 cards, so the 8-card figure is an upper bound); alpha = 10 us per ring step. These are
communication times; DDP hides part of its time behind the backward pass, fast_ddp none of it.
"""

from __future__ import annotations

from benchmarks.common import markdown_table

PARAMS = 7e9
BANDWIDTH = 300e9 / 8  # bytes/s per card
ALPHA = 10e-6  # seconds per ring step
BUCKET = 25 * 2**20  # DDP's default bucket_cap_mb


def ring_seconds(nbytes: float, cards: int, collectives: int = 1) -> float:
    latency = 2 * (cards - 1) * ALPHA * collectives
    return latency + 2 * (cards - 1) / cards * nbytes / BANDWIDTH


def table() -> str:
    rows = []
    for cards in (8, 64, 512):
        fp32, bf16 = PARAMS * 4, PARAMS * 2
        ddp = ring_seconds(fp32, cards, collectives=round(fp32 / BUCKET))
        rows.append([cards, f"{ddp:.2f}", f"{ring_seconds(fp32, cards):.2f}", f"{ring_seconds(bf16, cards):.2f}"])
    header = ["cards", "DDP, fp32, 25 MB buckets (s)", "fast_ddp, fp32 buffer (s)", "fast_ddp, bf16 buffer (s)"]
    return markdown_table(header, rows)


def run(log=print) -> str:
    text = f"{__doc__.strip()}\n\n{table()}"
    log(text)
    return text


if __name__ == "__main__":
    run()
