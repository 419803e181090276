"""Rough tokens/s of a setting: the model's FLOPs at the card's peak times a stated MFU, plus the collectives
that compute does not hide. A ranking aid with one significant figure of trust, not a benchmark."""

from __future__ import annotations

from .hardware import GB, Card
from .memory import adapter_parameters, trained_parameters
from .model import ModelShape
from .settings import Assumptions, Setting, Workload


def flops_per_token(shape: ModelShape, workload: Workload, setting: Setting) -> tuple[float, float]:
    """(matmul FLOPs through weights, attention FLOPs) per trained token, forward and backward: 6 per matmul
    parameter, and causal attention's 6 x layers x sequence x query width; gradient checkpointing runs the
    forward twice (8 instead of 6)."""
    passes = 8 if setting.checkpointing else 6
    dense = passes * shape.matmul_parameters()
    attention = passes * shape.layers * workload.sequence * shape.q_width
    if workload.adapters is not None:  # frozen weights: no weight gradient, 2 FLOPs fewer; the adapters' own 6 (8)
        dense = (passes - 2) * shape.matmul_parameters() + passes * adapter_parameters(shape, workload.adapters)
    return float(dense), float(attention)


def communication_seconds(shape: ModelShape, workload: Workload, setting: Setting, card: Card,
                          assumptions: Assumptions) -> float:  # fmt: skip
    """Seconds per optimizer step each rank spends in collectives (ring algorithms), before any overlap."""
    world, n = workload.world, trained_parameters(shape, workload)  # gradients of the trained weights
    if world == 1:
        return 0.0
    bandwidth = (card.link_gb_s if workload.nodes == 1 else assumptions.internode_gb_s.value) * GB
    share = (world - 1) / world  # every rank holds (a shard of) every weight: gradients meet across all of them
    low = 4 if workload.precision == "fp32" else 2
    if setting.strategy == "fsdp":  # each micro-batch: gather for forward and backward, reduce-scatter gradients
        data = setting.accumulation * share * (shape.parameters() * 2 * low + n * 4)
    else:  # one all-reduce of the gradients a step (fast_ddp: bf16 on a Gaudi)
        data = 2 * share * n * (2 if setting.strategy == "fast_ddp" and card.kind == "hpu" else 4)
    seconds = data / bandwidth * (1 - assumptions.overlap.value)
    if setting.context_parallel > 1:  # Ulysses: q, k, v and the output all-to-all'd per layer, forward and backward
        c = setting.context_parallel
        tokens = setting.micro_batch * workload.sequence // c
        per_layer = 2 * tokens * (2 * shape.q_width + 2 * shape.kv_width) * low * (c - 1) / c
        seconds += setting.accumulation * shape.layers * per_layer / (card.link_gb_s * GB)
    return seconds


def tokens_per_second(shape: ModelShape, workload: Workload, setting: Setting, card: Card,
                      assumptions: Assumptions) -> float | None:  # fmt: skip
    """All cards' trained tokens per second, or None where the card's peak is unknown (a CPU)."""
    if card.bf16_tflops is None:
        return None
    dense, attention = flops_per_token(shape, workload, setting)
    mfu = assumptions.mfu.value
    dense_peak = (card.fp8_tflops if setting.fp8 and card.fp8_tflops else card.bf16_tflops) * 1e12
    if workload.precision == "fp32":
        dense_peak = card.bf16_tflops * 1e12 / 2  # no bf16 matmuls: taken as half the bf16 peak
    seconds_per_token = dense / (dense_peak * mfu) + attention / (card.bf16_tflops * 1e12 * mfu)
    tokens_per_rank = setting.micro_batch * setting.accumulation * workload.sequence
    compute = tokens_per_rank * seconds_per_token / setting.context_parallel
    step = compute + communication_seconds(shape, workload, setting, card, assumptions)
    dp = workload.world // setting.context_parallel
    return dp * tokens_per_rank / step
