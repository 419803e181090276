#!/usr/bin/env python
"""Masked language modeling (BERT, RoBERTa, ...) with GaudiTrainer, from a Hub model or from scratch.

The command line is transformers' run_mlm.py plus every GaudiTrainingArguments flag. With nothing named it
pre-trains a small BERT (2 layers x 128) from scratch on the embedded corpus (stdlib docstrings) with the
embedded byte-level BPE tokenizer plus a <mask> token, so it runs offline out of the box:

    python examples/language-modeling/run_mlm.py --do_train --do_eval --max_steps 50 --mlm_probability 0.15 \
        --use_habana --use_lazy_mode --gaudi_config_name Habana/bert-base-uncased --bf16 --output_dir /tmp/mlm

--line_by_line trains on each non-empty line as one example (padded to --max_seq_length) instead of
concatenating the texts into full blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import run_clm
import torch
from datasets import DatasetDict
from run_clm import UsageError
from transformers import (
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    EvalPrediction,
    PreTrainedTokenizerBase,
    set_seed,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import check_resume_before_data
from optimum_gaudi.data.corpus import tokenize_and_group
from optimum_gaudi.data.tasks import default_mlm_tokenizer
from optimum_gaudi.errors import run_main

logger = logging.getLogger(__name__)

# With nothing named: a BERT small enough to learn something in minutes on a laptop CPU.
DEFAULT_MODEL_TYPE = "bert"
DEFAULT_CONFIG_OVERRIDES = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"


@dataclass
class ModelArguments(run_clm.ModelArguments):
    model_type: str | None = field(
        default=None,
        metadata={
            "help": f"Model type to train from scratch (default with nothing named: a small {DEFAULT_MODEL_TYPE}).",
            "choices": sorted(MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        },
    )


@dataclass
class DataTrainingArguments(run_clm.DataTrainingArguments):
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per example (the block size); default as --block_size."}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens masked for the MLM loss."})
    line_by_line: bool = field(
        default=False, metadata={"help": "Each non-empty line is one example, instead of concatenated blocks."}
    )
    pad_to_max_length: bool = field(
        default=True,
        metadata={"help": "--line_by_line: pad every line to max_seq_length (static shapes, as Gaudi graphs want)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.mlm_probability < 1:
            raise UsageError(f"--mlm_probability must be between 0 and 1, got {self.mlm_probability}.")
        if self.max_seq_length is not None:
            if self.max_seq_length < 2:
                raise UsageError(f"--max_seq_length must be >= 2, got {self.max_seq_length}.")
            self.block_size = self.max_seq_length


def load_mlm_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The named tokenizer, or the embedded one with a <mask> token; it must have a mask token."""
    named = model_args.tokenizer_name or model_args.model_name_or_path
    tokenizer = run_clm.load_tokenizer(model_args) if named else default_mlm_tokenizer()
    if tokenizer.mask_token is None:
        raise UsageError(f"tokenizer '{named}' has no mask token; masked LM needs one (e.g. a BERT/RoBERTa tokenizer).")
    return tokenizer


def lines_dataset(
    raw: DatasetDict, column: str, tokenizer: PreTrainedTokenizerBase, data_args, max_length: int
) -> DatasetDict:
    """--line_by_line: one example per non-empty line of `column`, truncated (and padded) to `max_length`."""
    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize(batch: dict[str, list]) -> dict[str, Any]:
        lines = [line for text in batch[column] for line in (text or "").splitlines() if line.strip()]
        return tokenizer(
            lines, padding=padding, truncation=True, max_length=max_length, return_special_tokens_mask=True
        )

    return raw.map(
        tokenize,
        batched=True,
        remove_columns=raw["train"].column_names,
        num_proc=data_args.preprocessing_num_workers,
        load_from_cache_file=not data_args.overwrite_cache,
        desc="Tokenizing lines",
    )


def masked_accuracy(prediction: EvalPrediction) -> dict[str, float]:
    """Share of masked tokens predicted right (labels are -100 everywhere else)."""
    predicted, labels = prediction.predictions, prediction.label_ids
    masked = labels != -100
    return {"accuracy": float((predicted[masked] == labels[masked]).mean()) if masked.any() else 0.0}


def _argmax_logits(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    return (logits[0] if isinstance(logits, tuple) else logits).argmax(dim=-1)  # keep ids, not the full logits


def build_trainer(
    model_args: ModelArguments, data_args: DataTrainingArguments, training_args: GaudiTrainingArguments
) -> GaudiTrainer:
    """Texts, tokenizer with a mask token, config, model, examples (blocks or lines), masking collator."""
    if not (training_args.do_train or training_args.do_eval):
        raise UsageError("nothing to do: add --do_train and/or --do_eval.")
    if not (model_args.model_name_or_path or model_args.config_name or model_args.model_type):
        model_args.model_type = DEFAULT_MODEL_TYPE
        model_args.config_overrides = model_args.config_overrides or DEFAULT_CONFIG_OVERRIDES
    run_clm.check_hub_names(model_args, data_args)
    logger.info("Device: %s", training_args.gaudi_device.describe())
    set_seed(training_args.seed)
    tokenizer = load_mlm_tokenizer(model_args)
    config, user_keys = run_clm.load_config(model_args, tokenizer)
    block_size = run_clm.resolve_block_size(data_args, tokenizer, config, not model_args.model_name_or_path, user_keys)
    blocks = None if data_args.line_by_line else block_size  # data mistakes before the model is built
    raw, column, splits = run_clm.load_texts(data_args, model_args, training_args, blocks)
    model = run_clm.load_model(model_args, config, tokenizer, AutoModelForMaskedLM)
    check_resume_before_data(training_args, model)  # a checkpoint of another model, before tokenizing

    with training_args.main_process_first(desc="tokenizing"):
        if data_args.line_by_line:
            examples = lines_dataset(raw, column, tokenizer, data_args, block_size)
        else:
            examples = tokenize_and_group(
                raw,
                tokenizer,
                block_size,
                text_column=column,
                num_proc=data_args.preprocessing_num_workers,
                load_from_cache_file=not data_args.overwrite_cache,
                required=splits,
            ).remove_columns("labels")  # the collator makes the MLM labels
    logger.info("Examples of up to %d tokens: %s", block_size, {split: len(e) for split, e in examples.items()})
    collator = DataCollatorForLanguageModeling(
        tokenizer,
        mlm=True,
        mlm_probability=data_args.mlm_probability,
        pad_to_multiple_of=None if data_args.pad_to_max_length else 8,
    )
    return GaudiTrainer(
        model=model,
        args=training_args,
        train_dataset=run_clm._take(examples, "train", data_args.max_train_samples, block_size)
        if training_args.do_train
        else None,
        eval_dataset=run_clm._take(examples, "validation", data_args.max_eval_samples, block_size)
        if training_args.do_eval
        else None,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=masked_accuracy if training_args.do_eval else None,
        preprocess_logits_for_metrics=_argmax_logits if training_args.do_eval else None,
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    groups = (ModelArguments, DataTrainingArguments, GaudiTrainingArguments)
    return run_clm.run_example(argv, groups, build_trainer)  # saves model, tokenizer, gaudi_config.json; perplexity


if __name__ == "__main__":
    run_main(main)
