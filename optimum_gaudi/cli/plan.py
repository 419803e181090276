"""``optimum-gaudi plan``: will a model fit on these cards, with which settings, and how fast (roughly)."""

from __future__ import annotations

import dataclasses

from ..errors import CommandError, UserError
from ..planning import Assumption, Assumptions, format_plan, plan


def _assumptions(args) -> Assumptions:
    """The defaults, with what the command line gives in their place."""
    given = "given on the command line"
    changes = {name: Assumption(getattr(args, name), given)
               for name in ("reserve_gb", "mfu", "overlap", "hpu_graph_fraction", "internode_gb_s")
               if getattr(args, name) is not None}  # fmt: skip
    return dataclasses.replace(Assumptions(), **changes)


def run(args) -> int:
    try:
        result = plan(
            args.model, card=args.card, cards=args.cards, nodes=args.nodes, sequence=args.sequence,
            global_batch=args.global_batch or args.cards * args.nodes, precision=args.precision,
            hpu_graphs=args.hpu_graphs, assumptions=_assumptions(args), card_memory_gb=args.card_memory_gb,
            peak_tflops=args.peak_tflops,
        )  # fmt: skip
    except UserError as e:
        raise CommandError(str(e)) from None
    print(format_plan(result, rows=10_000 if args.all else args.rows, model_arg=args.model))
    return 0 if result.recommended is not None else 1


def add_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="will a model fit on these cards, with which settings, how fast",
        description="Per-card memory (weights, gradients, optimizer state, activations, logits, communication "
        "buffers, runtime reserve) of training MODEL with each candidate setting; which fit; the fastest that "
        "fits as a command line. Exit status 1 when nothing fits.",
    )
    parser.add_argument("model", metavar="MODEL", help="a model folder, its config.json, or a Hub id (online)")
    parser.add_argument("--card", default="gaudi2", help="gaudi2, gaudi3, A100-40GB, A100-80GB, H100, H200 or cpu")
    parser.add_argument("--cards", type=int, default=8, help="cards per node (default 8)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--sequence", type=int, default=2048, help="tokens per sequence (run_clm.py's --block_size)")
    parser.add_argument("--global_batch", type=int, default=None, help="sequences per optimizer step, all cards "
                        "together (default: one per card)")  # fmt: skip
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--hpu_graphs", action="store_true", help="plan for --use_hpu_graphs_for_training")
    parser.add_argument("--card_memory_gb", type=float, help="the card's memory, if not the listed figure")
    parser.add_argument("--peak_tflops", type=float, help="the card's dense bf16 peak, if not the listed figure")
    parser.add_argument("--reserve_gb", type=float, help="the runtime's own memory per card, GB")
    parser.add_argument("--mfu", type=float, help="model FLOPs utilisation to assume (default 0.35)")
    parser.add_argument("--overlap", type=float, help="share of data-parallel collectives hidden (default 0.5)")
    parser.add_argument("--hpu_graph_fraction", type=float, help="HPU Graphs' extra memory, share of activations")
    parser.add_argument("--internode_gb_s", type=float, help="per-card bandwidth between nodes, GB/s")
    parser.add_argument("--rows", type=int, default=12, help="settings shown (default 12)")
    parser.add_argument("--all", action="store_true", help="show every setting")
    parser.set_defaults(run=run)
