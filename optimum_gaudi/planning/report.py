"""The plan as text: one line per way of spreading the model (its largest micro-batch that fits, else its
smallest), the memory parts in GB, the recommendation as a command, and the assumptions with their sources."""

from __future__ import annotations

from .hardware import GB
from .memory import adapter_parameters
from .planner import Candidate, Plan


def representatives(plan: Plan) -> list[Candidate]:
    """Per setting family (all but the micro-batch), the candidate with the largest micro-batch that fits, or the
    smallest micro-batch when none does; fitting ones first, fastest first, then the nearest to fitting."""
    families: dict[tuple, list[Candidate]] = {}
    for c in plan.candidates:
        s = c.setting
        families.setdefault((s.strategy, s.context_parallel, s.fp8, s.checkpointing, s.fused_loss), []).append(c)
    chosen = []
    for members in families.values():
        fitting = [c for c in members if c.fits]
        pick = max(fitting, key=lambda c: c.setting.micro_batch) if fitting else min(members, key=lambda c: c.setting.micro_batch)  # fmt: skip
        chosen.append(pick)
    fits = sorted((c for c in chosen if c.fits), key=lambda c: (-(c.tokens_per_second or 0), c.memory.peak))
    return fits + sorted((c for c in chosen if not c.fits), key=lambda c: c.memory.peak)  # nearest to fitting first


def _adapter_count(plan: Plan) -> int:
    return adapter_parameters(plan.model, plan.workload.adapters)


def _gb(value: float) -> str:
    return f"{value / GB:.1f}"


def _heading(plan: Plan) -> list[str]:
    """The model, the cards and the workload the plan is for, and what it trains."""
    m, w, card = plan.model, plan.workload, plan.card
    lines = [
        f"model: {m.name} ({m.family}, {m.parameters() / 1e9:.2f}B parameters, {m.layers} layers, hidden {m.hidden}, "
        f"vocabulary {m.vocab})",
        f"cards: {w.cards} x {card.name} ({card.memory_gb:.0f} GB each) x {w.nodes} node(s); sequence {w.sequence}, "
        f"global batch {w.global_batch}, {w.precision}",
    ]
    if w.adapters is not None:
        a = w.adapters
        lines.append(
            f"trained: {a.label()} ({_adapter_count(plan) / 1e6:.1f}M parameters), the rest frozen in "
            f"{'bf16' if a.frozen_bytes == 2 else 'float32'}"
        )
    elif w.weight_bytes == 2:
        lines.append("trained: every weight, in bf16 as loaded (its gradients and AdamW's moments too)")
    return lines


def _table(plan: Plan, rows: int) -> list[str]:
    """One aligned line per representative setting: its memory parts, whether it fits, its speed."""
    header = ["setting (micro x accum)", "weights", "grads", "optim", "activ", "logits", "comm", "work", "reserve", "peak GB",
              "fits", "tokens/s"]  # fmt: skip
    table = [header]
    for c in representatives(plan)[:rows]:
        speed = "-" if c.tokens_per_second is None else f"{c.tokens_per_second:,.0f}"
        table.append([c.setting.label(), *(_gb(v) for v in c.memory.parts().values()), _gb(c.memory.peak),
                      "yes" if c.fits else "no", speed])  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
        for row in table
    ]


def _recommendation(plan: Plan, model_arg: str) -> list[str]:
    """The recommended setting and its command, or what to change when nothing fits."""
    best = plan.recommended
    if best is None:
        smallest = min(plan.candidates, key=lambda c: c.memory.peak)
        return [
            f"nothing fits: the smallest, {smallest.setting.label()}, needs {_gb(smallest.memory.peak)} GB a card of "
            f"{plan.card.memory_gb:.0f} GB; add cards or nodes, or shorten the sequence."
        ]
    speed = "" if best.tokens_per_second is None else f", about {best.tokens_per_second:,.0f} tokens/s"
    return [
        f"recommended: {best.setting.label()} ({_gb(best.memory.peak)} GB a card{speed}):",
        "  " + plan.command(model_arg),
    ]


def _assumptions(plan: Plan) -> list[str]:
    """The assumptions this card's figures rest on, each with its source and the flag that overrides it."""
    a, card = plan.assumptions, plan.card
    lines = ["assumptions (override with the flags named):"]
    reserve = {"hpu": (f"{a.reserve_fraction_hpu.value:.0%} of the card", a.reserve_fraction_hpu),
               "cuda": (f"{a.reserve_gb_cuda.value:g} GB", a.reserve_gb_cuda),
               "cpu": (f"{a.reserve_gb_cpu.value:g} GB", a.reserve_gb_cpu)}[card.kind]  # fmt: skip
    if a.reserve_gb is not None:
        reserve = (f"{a.reserve_gb.value:g} GB", a.reserve_gb)
    lines.append(f"  runtime reserve {reserve[0]} (--reserve_gb): {reserve[1].source}")
    if card.kind == "cpu":
        lines.append(f"  CPU workspace {a.workspace_gb_cpu.value:g} GB + {a.workspace_share_cpu.value:.0%} of the "
                     f"activations and logits (Python: Assumptions.workspace_gb_cpu, workspace_share_cpu): "
                     f"{a.workspace_share_cpu.source}")  # fmt: skip
    if card.kind == "hpu":
        lines.append(f"  HPU Graphs {a.hpu_graph_fraction.value:.0%} of activations (--hpu_graph_fraction): "
                     f"{a.hpu_graph_fraction.source}")  # fmt: skip
    if card.bf16_tflops is not None:
        lines.append(f"  MFU {a.mfu.value:.2f} (--mfu): {a.mfu.source}")
        lines.append(f"  overlap {a.overlap.value:.0%} (--overlap): {a.overlap.source}")
        lines.append(f"  peak {card.bf16_tflops:g} bf16 / {card.fp8_tflops or '-'} fp8 TFLOP/s: {card.source}")
    else:
        lines.append("  tokens/s: no peak known for this card (give --peak_tflops to estimate them)")
    return lines


def format_plan(plan: Plan, rows: int = 12, model_arg: str = "MODEL") -> str:
    """The whole plan as text: heading, table, recommendation and assumptions, a blank line between them."""
    parts = [_heading(plan), _table(plan, rows), _recommendation(plan, model_arg), _assumptions(plan)]
    return "\n\n".join("\n".join(part) for part in parts)
