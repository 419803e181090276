#!/usr/bin/env python
"""LoRA fine-tuning of a causal LM with PEFT and GaudiTrainer: run_clm.py with low-rank adapters.

Only the adapters train; the base model stays frozen. Every run_clm.py argument works, plus --lora_rank,
--lora_alpha, --lora_dropout, --lora_target_modules and --merge_lora. With no model named it adapts the model
`make demo` saved (outputs/demo), on the embedded corpus, offline. Needs PEFT: pip install "optimum-gaudi[peft]".

    python examples/language-modeling/run_lora_clm.py --do_train --do_eval --max_steps 50 \
        --lora_rank 8 --lora_alpha 16 --lora_target_modules c_attn c_proj --learning_rate 1e-3 \
        --use_habana --use_lazy_mode --gaudi_config_name Habana/gpt2 --bf16 --output_dir /tmp/lora

The output directory holds the adapter (adapter_model.safetensors, adapter_config.json), the tokenizer and
gaudi_config.json; with --merge_lora also the merged full model in its merged/ folder.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path

import demo
import run_clm
from run_clm import UsageError
from transformers import PreTrainedModel

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.errors import run_main

logger = logging.getLogger(__name__)


@dataclass
class LoraArguments:
    """The low-rank adapters (Hu et al., 2021): W + (alpha / rank) * B A on each target module."""

    lora_rank: int = field(default=8, metadata={"help": "Rank of the LoRA update matrices."})
    lora_alpha: float = field(
        default=16, metadata={"help": "LoRA scaling numerator: updates are scaled by alpha/rank."}
    )
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names to adapt, e.g. c_attn c_proj (GPT-2) or q_proj v_proj (Llama). "
        "Default: PEFT's choice for the model type."},
    )  # fmt: skip
    merge_lora: bool = field(
        default=False, metadata={"help": "After training, also save the base model with the adapter merged in."}
    )

    def __post_init__(self) -> None:
        if self.lora_rank < 1:
            raise UsageError(f"--lora_rank must be >= 1, got {self.lora_rank}.")
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}.")


def default_base_model(model_args: run_clm.ModelArguments) -> None:
    """With no model named, adapt the one `make demo` trained; say how to get it when it is missing."""
    if model_args.model_name_or_path or model_args.model_type or model_args.config_name:
        return
    saved = demo.saved_model_dir()
    if not (saved / "config.json").is_file():
        raise UsageError(f"no model at {saved}: run `make demo` to train one there, or pass --model_name_or_path.")
    model_args.model_name_or_path = str(saved)


def add_adapters(lora_args: LoraArguments):
    """A `wrap_model` for run_clm.build_trainer: freeze the model and add LoRA adapters."""
    if importlib.util.find_spec("peft") is None:
        raise UsageError("LoRA needs PEFT: pip install 'optimum-gaudi[peft]'.")
    from peft import LoraConfig, TaskType, get_peft_model

    def wrap(model: PreTrainedModel):
        config = LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=lora_args.lora_rank,
            lora_alpha=lora_args.lora_alpha,
            lora_dropout=lora_args.lora_dropout,
            target_modules=lora_args.lora_target_modules,
        )
        try:
            peft_model = get_peft_model(model, config)
        except ValueError as e:  # unknown target modules, or a model type PEFT has no default for
            raise UsageError(f"LoRA: {str(e).strip().splitlines()[0]}") from None
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in peft_model.parameters())
        logger.info("LoRA adapters: %d trainable parameters of %d (%.2f%%).", trainable, total, 100 * trainable / total)
        return peft_model

    return wrap


def merge_and_save(trainer: GaudiTrainer, output_dir: Path) -> Path:
    """The base model with the trained adapter folded into its weights, saved as a plain model."""
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(output_dir)
    trainer.processing_class.save_pretrained(output_dir)
    trainer.gaudi_config.save_pretrained(output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> dict[str, float]:
    merge_into: list[Path] = []  # where --merge_lora saves the merged model, once the arguments are parsed

    def build(model_args, data_args, training_args, lora_args: LoraArguments) -> GaudiTrainer:
        default_base_model(model_args)
        if lora_args.merge_lora and training_args.should_save:
            merge_into.append(Path(training_args.output_dir) / "merged")
        return run_clm.build_trainer(model_args, data_args, training_args, wrap_model=add_adapters(lora_args))

    def train_evaluate_and_merge(trainer: GaudiTrainer) -> dict[str, float]:
        metrics = run_clm.train_and_evaluate(trainer)  # saves the adapter, tokenizer and gaudi_config.json
        for path in merge_into:
            logger.info("Merged model saved to %s", merge_and_save(trainer, path))
        return metrics

    groups = (run_clm.ModelArguments, run_clm.DataTrainingArguments, GaudiTrainingArguments, LoraArguments)
    return run_clm.run_example(argv, groups, build, train_evaluate_and_merge)


if __name__ == "__main__":
    run_main(main)
