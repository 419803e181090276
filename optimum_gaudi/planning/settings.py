"""What a plan is asked (the workload), what it varies (a setting) and what it assumes, as small dataclasses.

Every assumption is a field with a default and the reason for it, so a user who knows better (a measured
runtime reserve, a measured MFU) sets it instead of trusting ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("ddp", "fast_ddp", "fsdp")
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters trained beside a frozen model (run_lora_clm.py, TRL's ``--use_peft``): the frozen weights
    get no gradient and no optimizer state, the adapters both; the backward still runs through the frozen layers
    to reach the adapters, so what it needs of them is kept (less than full fine-tuning keeps: a frozen linear layer
    keeps no input, a norm with frozen weights only its input).

    ``targets``: the adapted modules (ModelShape.lora_targets: () is PEFT's default for the family). ``dropout``:
    ``lora_dropout`` > 0, which keeps a mask and an output per adapted input. ``frozen_bytes``: bytes of a frozen
    weight as loaded, 4 (float32) or 2 (bf16/fp16: ``--torch_dtype``, or the checkpoint's own dtype, which
    transformers 5 loads by default); the adapters are float32 either way (PEFT's ``autocast_adapter_dtype``)."""

    rank: int = 8
    targets: tuple[str, ...] = ()
    dropout: bool = True
    frozen_bytes: int = 4

    def label(self) -> str:
        return f"LoRA r{self.rank} {'+'.join(self.targets) or 'default modules'}"


@dataclass(frozen=True)
class Workload:
    """The job: how many cards on how many nodes, the sequence length and the global batch (sequences per
    optimizer step, all cards together). ``precision``: ``bf16`` is autocast over the weights (--bf16), ``fp32``
    no autocast. ``weight_bytes``: in full fine-tuning, bytes of a weight as the run loads it, 4 (float32) or 2
    (bf16/fp16: ``--torch_dtype``, or a bf16 checkpoint as transformers 5 loads it by default); the weights train in
    that dtype, their gradients and AdamW's moments too (torch keeps a moment in its parameter's dtype), and
    autocast does not change it. With ``adapters``, ``Adapters.frozen_bytes`` says it instead."""

    cards: int = 1
    nodes: int = 1
    sequence: int = 2048
    global_batch: int = 8
    precision: str = "bf16"
    hpu_graphs: bool = False  # --use_hpu_graphs_for_training on a Gaudi (adds the assumed graph memory)
    adapters: Adapters | None = None  # LoRA on a frozen model; None: full fine-tuning, every weight trained
    weight_bytes: int = 4  # full fine-tuning: a weight as loaded and trained (4 float32, 2 bf16)

    @property
    def world(self) -> int:
        return self.cards * self.nodes


@dataclass(frozen=True)
class Setting:
    """One candidate: how the model is spread over the cards and what saves memory."""

    strategy: str = "ddp"  # ddp, fast_ddp or fsdp (FSDP2 full_shard)
    context_parallel: int = 1  # ranks each sequence is split over (--context_parallel_size)
    fp8: bool = False
    checkpointing: bool = False  # --gradient_checkpointing
    fused_loss: bool = False  # --use_fused_linear_cross_entropy
    micro_batch: int = 1  # --per_device_train_batch_size
    accumulation: int = 1  # --gradient_accumulation_steps

    def label(self) -> str:
        parts = [self.strategy]
        if self.context_parallel > 1:
            parts.append(f"cp{self.context_parallel}")
        parts += [
            name for name, on in (("fp8", self.fp8), ("ckpt", self.checkpointing), ("fused", self.fused_loss)) if on
        ]
        return "+".join(parts) + f" {self.micro_batch}x{self.accumulation}"


@dataclass(frozen=True)
class Assumption:
    value: float
    source: str


def _assumption(value: float, source: str) -> Assumption:
    return field(default_factory=lambda: Assumption(value, source))


@dataclass(frozen=True)
class Assumptions:
    """What the plan cannot know and assumes, each with where the figure comes from. Override any with
    ``dataclasses.replace(Assumptions(), mfu=Assumption(0.3, "measured: ..."))`` or the CLI's flags."""

    reserve_fraction_hpu: Assumption = _assumption(
        0.05, "assumption, not measured (no Gaudi at hand): the Gaudi runtime's workspace and recipe cache, taken "
        "as 5% of the card; set --reserve_gb from a run's max_memory_allocated against the card's total"
    )  # fmt: skip
    reserve_gb_cuda: Assumption = _assumption(
        2.0, "assumption: CUDA context and kernels (~0.5-1 GB per process) plus the caching allocator's "
        "fragmentation; set --reserve_gb from torch.cuda.max_memory_reserved of a run"
    )  # fmt: skip
    reserve_gb_cpu: Assumption = _assumption(
        0.5, "measured on this machine (2026-11-28, torch 2.13, transformers 5.24): resident set of a Python process "
        "after importing torch, transformers and GaudiTrainer, before a model is built: 0.49 GB (docs/planning.md)"
    )  # fmt: skip
    workspace_gb_cpu: Assumption = _assumption(
        0.05, "fitted on this machine (AMD EPYC, glibc 2.36, torch 2.13): the fixed part of what a CPU training "
        "process holds beyond its tensors (the math libraries' buffers, the loop's own state), from 23 settings of "
        "the plan bench, 7M to 107M parameters (2026-11-28, docs/planning.md: the fit and its data)"
    )  # fmt: skip
    workspace_share_cpu: Assumption = _assumption(
        0.25, "fitted with workspace_gb_cpu (the same 23 settings): the heap's kept blocks, as a share of what the "
        "backward frees (activations and the loss's tensors), which the heap reuses only in part; it is what grows "
        "with the model and the batch"
    )  # fmt: skip
    reserve_gb: Assumption | None = None  # given: the runtime reserve in GB on any card, instead of the above
    hpu_graph_fraction: Assumption = _assumption(
        0.25, "assumption, not measured: HPU Graphs for training keep the graph's static inputs and outputs; "
        "taken as a quarter of a step's activations more, with --use_hpu_graphs_for_training only"
    )  # fmt: skip
    mfu: Assumption = _assumption(
        0.35, "assumption: model FLOPs utilisation of a tuned LLM training run; published runs range 0.3-0.5 "
        "(Megatron-LM, Narayanan et al. 2021: 0.44-0.52 on A100; Llama 3 paper, 2024: 0.38-0.43 on H100)"
    )  # fmt: skip
    overlap: Assumption = _assumption(
        0.5, "assumption: share of the data-parallel collectives (all-reduce, FSDP's gathers) hidden behind "
        "compute; context parallelism's all-to-alls are in the critical path and never hidden"
    )  # fmt: skip
    internode_gb_s: Assumption = _assumption(
        37.5, "assumption: per-card bandwidth between nodes, one direction; 3x100 GbE scale-out ports of a Gaudi 2 "
        "node's 8 cards each (Intel Gaudi 2 HLS-Gaudi2 server); set --internode_gb_s for your fabric"
    )  # fmt: skip
