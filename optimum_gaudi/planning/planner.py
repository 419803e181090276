"""The plan: every candidate setting's memory and speed on the cards, which fit, and the fastest that fits as a
command line for examples/language-modeling/run_clm.py (run_lora_clm.py for LoRA adapters)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import UserError
from .hardware import GB, Card
from .hardware import card as find_card
from .memory import Breakdown, breakdown
from .model import ModelShape, load_model_shape
from .settings import PRECISIONS, STRATEGIES, Adapters, Assumptions, Setting, Workload
from .speed import tokens_per_second

CONTEXT_PARALLEL_DEGREES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Candidate:
    setting: Setting
    memory: Breakdown
    fits: bool
    tokens_per_second: float | None


@dataclass
class Plan:
    model: ModelShape
    card: Card
    workload: Workload
    assumptions: Assumptions
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    @property
    def recommended(self) -> Candidate | None:
        """The fastest that fits, and of equally fast ones the one leaving the most memory free; where speed is
        unknown (a CPU), the one needing the fewest tricks, then the largest micro-batch."""
        if not self.fitting:
            return None
        return min(self.fitting, key=_preference)

    def command(self, model_arg: str = "MODEL", output_dir: str = "/tmp/plan_run") -> str | None:
        best = self.recommended
        return None if best is None else command_line(best.setting, self, model_arg, output_dir)


def _tricks(s: Setting) -> int:
    return (s.strategy == "fsdp") + (s.context_parallel > 1) + s.fp8 + s.checkpointing + s.fused_loss


def _preference(c: Candidate) -> tuple:
    if c.tokens_per_second is None:
        return (_tricks(c.setting), -c.setting.micro_batch, c.memory.peak)
    return (-float(f"{c.tokens_per_second:.3g}"), c.memory.peak)  # speeds equal to 3 figures are equal


def _divisors_up_to(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d & (d - 1) == 0]


def candidate_settings(model: ModelShape, workload: Workload, card: Card) -> list[Setting]:
    """Every setting the planner weighs: strategies x context-parallel degrees x fp8 x checkpointing x fused loss x
    the micro-batches (powers of two) that divide each rank's share of the global batch."""
    found = []
    for cp in CONTEXT_PARALLEL_DEGREES:
        # a sequence split over cp ranks: the world and both kinds of heads divide by it, and the sequence too
        if workload.world % cp or model.heads % cp or model.kv_heads % cp or workload.sequence % cp:
            continue
        dp = workload.world // cp
        if workload.global_batch % dp:
            continue
        per_rank = workload.global_batch // dp
        for strategy in STRATEGIES:
            if strategy != "ddp" and workload.world == 1:
                continue
            for fp8 in (False, True) if card.fp8_tflops and workload.adapters is None else (False,):
                for checkpointing in (False, True):
                    for fused in (False, True):
                        for micro in _divisors_up_to(per_rank):
                            found.append(Setting(strategy, cp, fp8, checkpointing, fused, micro, per_rank // micro))
    return found


def plan(
    model: Any,
    card: str | Card = "gaudi2",
    cards: int = 8,
    nodes: int = 1,
    sequence: int = 2048,
    global_batch: int = 8,
    precision: str = "bf16",
    hpu_graphs: bool = False,
    assumptions: Assumptions | None = None,
    card_memory_gb: float | None = None,
    peak_tflops: float | None = None,
    adapters: Adapters | None = None,
    weight_bytes: int = 4,
) -> Plan:
    """Weigh every candidate setting for training ``model`` (a path, a config, a Hub id online) on ``cards`` cards
    per node times ``nodes``: each one's per-card memory, whether it fits, its rough tokens/s. ``adapters``: train
    LoRA adapters on the frozen model instead of every weight. ``weight_bytes``: training every weight, 2 where
    they load in bf16 and train so (``Workload.weight_bytes``), 4 for float32."""
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}.")
    for name, value in (("cards", cards), ("nodes", nodes), ("sequence", sequence), ("global batch", global_batch)):
        if value < 1:
            raise UserError(f"the {name} must be at least 1, got {value}.")
    shape = load_model_shape(model)
    if adapters is not None:  # the modules as PEFT will find them (one line for a name the planner does not know)
        adapters = replace(adapters, targets=shape.lora_targets(adapters.targets))
    target = card if isinstance(card, Card) else find_card(card, card_memory_gb, peak_tflops)
    workload = Workload(cards, nodes, sequence, global_batch, precision, hpu_graphs, adapters, weight_bytes)
    assumptions = assumptions or Assumptions()
    settings = candidate_settings(shape, workload, target)
    if not settings:
        raise UserError(
            f"no split of a global batch of {global_batch} over {workload.world} cards: make the global batch a "
            f"multiple of the number of cards (or of cards / context-parallel degree)."
        )
    result = Plan(shape, target, workload, assumptions)
    budget = target.memory_gb * GB
    for s in settings:
        memory = breakdown(shape, workload, s, target, assumptions)
        speed = tokens_per_second(shape, workload, s, target, assumptions)
        result.candidates.append(Candidate(s, memory, memory.peak <= budget, speed))
    return result


def command_line(setting: Setting, plan: Plan, model_arg: str = "MODEL", output_dir: str = "/tmp/plan_run") -> str:
    """``setting`` as an `optimum-gaudi launch` command of examples/language-modeling/run_clm.py (run_lora_clm.py
    with adapters, its rows packed to the sequence), the weights loaded as planned where they are bf16, flags as
    the training arguments spell them."""
    w = plan.workload
    args = ["optimum-gaudi", "launch", "--world_size", str(w.cards)]
    if w.nodes > 1:
        args += ["--nnodes", str(w.nodes)]
    lora = w.adapters
    if lora is None:
        args += ["examples/language-modeling/run_clm.py", "--model_name_or_path", model_arg, "--do_train"]
        args += ["--block_size", str(w.sequence)]
        if w.weight_bytes == 2:
            args += ["--torch_dtype", "bfloat16"]
    else:
        args += ["examples/language-modeling/run_lora_clm.py", "--model_name_or_path", model_arg, "--do_train"]
        args += ["--torch_dtype", "bfloat16" if lora.frozen_bytes == 2 else "float32", "--peft_type", "lora"]
        args += ["--lora_rank", str(lora.rank), "--lora_target_modules", *lora.targets]
        if not lora.dropout:
            args += ["--lora_dropout", "0"]
        args += ["--max_seq_length", str(w.sequence), "--dataset_concatenation"]
    args += ["--per_device_train_batch_size", str(setting.micro_batch)]
    args += ["--gradient_accumulation_steps", str(setting.accumulation)]
    if w.precision == "bf16":
        args.append("--bf16")
    if plan.card.kind == "hpu":
        args += ["--use_habana", "--gaudi_config_name", "llama" if plan.model.family == "gated" else "gpt2"]
        if setting.strategy != "fsdp":  # FSDP runs in eager mode on a Gaudi
            args.append("--use_lazy_mode")
        if w.hpu_graphs:
            args.append("--use_hpu_graphs_for_training")
    if setting.strategy == "fast_ddp":
        args += ["--distribution_strategy", "fast_ddp"]
    if setting.strategy == "fsdp":
        args += ["--fsdp", "full_shard"]
    if setting.context_parallel > 1:
        args += ["--context_parallel_size", str(setting.context_parallel)]
    for flag, on in (("--fp8", setting.fp8), ("--gradient_checkpointing", setting.checkpointing),
                     ("--use_fused_linear_cross_entropy", setting.fused_loss)):  # fmt: skip
        if on:
            args.append(flag)
    args += ["--output_dir", output_dir]
    return shlex.join(args)
