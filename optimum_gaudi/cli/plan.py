"""``optimum-gaudi plan``: will a model fit on these cards, with which settings, and how fast (roughly)."""

from __future__ import annotations

import dataclasses

from ..errors import CommandError, UserError
from ..planning import Adapters, Assumption, Assumptions, format_plan, plan


def _assumptions(args) -> Assumptions:
    """The defaults, with what the command line gives in their place."""
    given = "given on the command line"
    changes = {name: Assumption(getattr(args, name), given)
               for name in ("reserve_gb", "mfu", "overlap", "hpu_graph_fraction", "internode_gb_s")
               if getattr(args, name) is not None}  # fmt: skip
    return dataclasses.replace(Assumptions(), **changes)


def _adapters(args) -> Adapters | None:
    """LoRA adapters from --lora_rank, --lora_target_modules and --torch_dtype; None: full fine-tuning."""
    if args.lora_rank is None:
        if args.lora_target_modules:
            raise CommandError("--lora_target_modules needs --lora_rank (the adapters' rank).")
        return None
    if args.lora_rank < 1:
        raise CommandError(f"--lora_rank must be at least 1, got {args.lora_rank}.")
    frozen = 4 if args.torch_dtype == "float32" else 2  # bf16 unless float32 is asked
    return Adapters(args.lora_rank, tuple(args.lora_target_modules or ()), args.lora_dropout > 0, frozen)


def run(args) -> int:
    try:
        result = plan(
            args.model, card=args.card, cards=args.cards, nodes=args.nodes, sequence=args.sequence,
            global_batch=args.global_batch or args.cards * args.nodes, precision=args.precision,
            hpu_graphs=args.hpu_graphs, assumptions=_assumptions(args), card_memory_gb=args.card_memory_gb,
            peak_tflops=args.peak_tflops, adapters=_adapters(args),
            weight_bytes=2 if args.torch_dtype == "bfloat16" and args.lora_rank is None else 4,
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
    parser.add_argument("--lora_rank", type=int, help="plan LoRA adapters of this rank on the frozen model "
                        "(run_lora_clm.py) instead of training every weight")  # fmt: skip
    parser.add_argument("--lora_target_modules", nargs="+", help="modules LoRA adapts (default: PEFT's choice, "
                        "q_proj v_proj for Llama); all-linear: every linear layer")  # fmt: skip
    parser.add_argument("--lora_dropout", type=float, default=0.05, help="LoRA dropout (default 0.05)")
    parser.add_argument("--torch_dtype", choices=["bfloat16", "float32"],
                        help="the weights as loaded: with --lora_rank the frozen ones (default bfloat16); else the "
                        "trained ones, bfloat16 training them in bf16 as transformers 5 does a bf16 checkpoint "
                        "(default float32)")  # fmt: skip
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
