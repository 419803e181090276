#!/usr/bin/env python
"""Summarization (BART, T5, ...) with GaudiSeq2SeqTrainer, evaluated with generate and ROUGE.

The command line is transformers' run_summarization.py plus every Gaudi flag. With nothing named it trains
a small BART from scratch on an embedded task made of real text: each docstring of the Python standard
library that follows PEP 257 is a document (its body) with a one-line summary (its first line). Offline:

    python examples/summarization/run_summarization.py --do_train --do_eval --predict_with_generate \
        --max_steps 200 --use_habana --use_lazy_mode --use_hpu_graphs_for_inference \
        --gaudi_config_name Habana/bart --bf16 --output_dir /tmp/summarization

ROUGE-1/2/L are computed by optimum_gaudi.data.rouge (no metric download needed).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from datasets import DatasetDict, load_dataset
from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, PreTrainedTokenizerBase, set_seed
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "language-modeling"))
import run_clm  # noqa: E402  (argument groups, loaders and one-line errors shared by the examples)
from run_clm import UsageError  # noqa: E402

from optimum_gaudi import GaudiSeq2SeqTrainer, GaudiSeq2SeqTrainingArguments  # noqa: E402
from optimum_gaudi.data.rouge import rouge  # noqa: E402
from optimum_gaudi.data.tasks import docstring_summary_datasets  # noqa: E402
from optimum_gaudi.errors import run_main  # noqa: E402

logger = logging.getLogger(__name__)

# With nothing named: a BART small enough to train in minutes on a laptop CPU, with the embedded tokenizer.
DEFAULT_MODEL_TYPE = "bart"
DEFAULT_CONFIG_OVERRIDES = (
    "d_model=128,encoder_layers=2,decoder_layers=2,encoder_attention_heads=4,decoder_attention_heads=4,"
    "encoder_ffn_dim=512,decoder_ffn_dim=512,max_position_embeddings=512"
)


@dataclass
class ModelArguments(run_clm.ModelArguments):
    model_type: str | None = field(
        default=None,
        metadata={
            "help": f"Model type to train from scratch (default with nothing named: a small {DEFAULT_MODEL_TYPE}).",
            "choices": sorted(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        },
    )


@dataclass
class DataTrainingArguments:
    """Which documents and summaries to train and evaluate on, and how long each may be."""

    dataset_name: str | None = field(default=None, metadata={"help": "Dataset for datasets.load_dataset."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the dataset."})
    text_column: str | None = field(default=None, metadata={"help": "Column of the documents (default: the first)."})
    summary_column: str | None = field(
        default=None, metadata={"help": "Column of the summaries (default: the second)."}
    )
    train_file: str | None = field(default=None, metadata={"help": "Local training data: .csv or .json(l)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local evaluation data: .csv or .json(l)."})
    max_source_length: int = field(default=256, metadata={"help": "Document tokens kept after truncation."})
    max_target_length: int = field(default=32, metadata={"help": "Summary tokens kept for training."})
    val_max_target_length: int | None = field(
        default=None, metadata={"help": "Most tokens generated in evaluation (default: max_target_length)."}
    )
    num_beams: int | None = field(default=None, metadata={"help": "Beams for generation in evaluation."})
    source_prefix: str = field(default="", metadata={"help": "Prepended to every document, e.g. 'summarize: ' (T5)."})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every example to the max lengths (static shapes)."}
    )
    ignore_pad_token_for_loss: bool = field(
        default=True,
        metadata={
            "help": "Leave the padding of the summaries out of the loss (false: padding tokens are targets too)."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training pairs."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many evaluation pairs."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent held out for evaluation when there is no validation split."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached tokenized datasets."})

    def __post_init__(self) -> None:
        if self.dataset_name and self.train_file:
            raise UsageError("give either --dataset_name or --train_file, not both.")
        run_clm.check_table_files(self)
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise UsageError(f"--{name} must be >= 2, got {getattr(self, name)}.")
        self.val_max_target_length = self.val_max_target_length or self.max_target_length


def load_pairs(data_args: DataTrainingArguments, model_args: ModelArguments, seed: int) -> tuple[DatasetDict, str, str]:
    """Train/validation splits and the names of their document and summary columns."""
    if data_args.dataset_name:
        raw = run_clm._from_pretrained(
            load_dataset,
            data_args.dataset_name,
            "dataset",
            name=data_args.dataset_config_name,
            cache_dir=model_args.cache_dir,
            token=model_args.token,
        )
    elif data_args.train_file:
        files = {"train": data_args.train_file}
        if data_args.validation_file:
            files["validation"] = data_args.validation_file
        builder = "csv" if Path(data_args.train_file).suffix.lower() == ".csv" else "json"
        raw = load_dataset(builder, data_files=files, cache_dir=model_args.cache_dir)
    else:
        raw = docstring_summary_datasets(data_args.validation_split_percentage / 100, seed)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, seed=seed)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    columns = raw["train"].column_names
    text = data_args.text_column or columns[0]
    summary = data_args.summary_column or (columns[1] if len(columns) > 1 else None)
    for flag, name in (("--text_column", text), ("--summary_column", summary)):
        if name not in columns:
            raise UsageError(f"{flag} '{name}' is not a column of the data (it has: {', '.join(columns)}).")
    return raw, text, summary


def _ending_in_eos(ids: list[list[int]], eos: int | None) -> list[list[int]]:
    """Targets must end with eos so generation learns where to stop; tokenizers without a post-processor
    (the embedded BPE) do not add it themselves."""
    if eos is None:
        return ids
    return [seq if seq and seq[-1] == eos else [*seq, eos] for seq in ids]


def label_padding(tokenizer: PreTrainedTokenizerBase, data_args: DataTrainingArguments) -> int:
    """The id that pads the summaries: -100 (left out of the loss) unless --ignore_pad_token_for_loss false."""
    if data_args.ignore_pad_token_for_loss or tokenizer.pad_token_id is None:
        return -100
    return tokenizer.pad_token_id


def tokenize_pairs(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, columns: tuple[str, str], data_args: DataTrainingArguments
) -> DatasetDict:
    text, summary = columns
    padding = "max_length" if data_args.pad_to_max_length else False
    eos = tokenizer.eos_token_id
    label_pad = label_padding(tokenizer, data_args)

    def tokenize(batch: dict[str, list]) -> dict[str, Any]:
        documents = [data_args.source_prefix + (d or "") for d in batch[text]]
        inputs = tokenizer(documents, max_length=data_args.max_source_length, padding=padding, truncation=True)
        targets = tokenizer(text_target=[s or "" for s in batch[summary]], truncation=True,
                            max_length=data_args.max_target_length - 1)["input_ids"]  # fmt: skip
        labels = _ending_in_eos(targets, eos)
        if data_args.pad_to_max_length:
            labels = [seq + [label_pad] * (data_args.max_target_length - len(seq)) for seq in labels]
        return {**inputs, "labels": labels}

    return raw.map(
        tokenize,
        batched=True,
        remove_columns=raw["train"].column_names,
        num_proc=data_args.preprocessing_num_workers,
        load_from_cache_file=not data_args.overwrite_cache,
        desc="Tokenizing",
    )


def rouge_metrics(tokenizer: PreTrainedTokenizerBase):
    """compute_metrics for predict_with_generate: decode generated and reference ids, score with ROUGE."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def compute(prediction) -> dict[str, float]:
        predictions = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predictions = np.where(predictions != -100, predictions, pad)
        labels = np.where(prediction.label_ids != -100, prediction.label_ids, pad)
        decoded = tokenizer.batch_decode(predictions, skip_special_tokens=True)
        references = tokenizer.batch_decode(labels, skip_special_tokens=True)
        lengths = [int(np.count_nonzero(row != pad)) for row in predictions]
        return {**rouge(decoded, references), "gen_len": float(np.mean(lengths))}

    return compute


def build_trainer(
    model_args: ModelArguments, data_args: DataTrainingArguments, training_args: GaudiSeq2SeqTrainingArguments
) -> GaudiSeq2SeqTrainer:
    """Pairs, tokenizer, config, the pretrained (or new) seq2seq model, a GaudiSeq2SeqTrainer."""
    if not (training_args.do_train or training_args.do_eval):
        raise UsageError("nothing to do: add --do_train and/or --do_eval.")
    if not (model_args.model_name_or_path or model_args.config_name or model_args.model_type):
        model_args.model_type = DEFAULT_MODEL_TYPE
        model_args.config_overrides = model_args.config_overrides or DEFAULT_CONFIG_OVERRIDES
    for what, name in (("model", model_args.model_name_or_path), ("dataset", data_args.dataset_name)):
        run_clm._require_reachable(what, name)  # fail in seconds, before loading anything
    logger.info("Device: %s", training_args.gaudi_device.describe())
    set_seed(training_args.seed)
    raw, text, summary = load_pairs(data_args, model_args, training_args.seed)
    logger.info("Pairs: %s", {split: len(d) for split, d in raw.items()})
    tokenizer = run_clm.load_tokenizer(model_args)
    config, _ = run_clm.load_config(model_args, tokenizer)
    if model_args.model_name_or_path:
        model = run_clm._from_pretrained(
            AutoModelForSeq2SeqLM.from_pretrained,
            model_args.model_name_or_path,
            "model",
            config=config,
            **run_clm._hub_kwargs(model_args),
        )
    else:
        # A new model starts and ends every generated summary with the tokenizer's own eos.
        config.decoder_start_token_id = config.forced_eos_token_id = tokenizer.eos_token_id
        model = AutoModelForSeq2SeqLM.from_config(config)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("Training a new %s from scratch: %.2fM parameters.", config.model_type, n_params / 1e6)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    training_args.generation_max_length = training_args.generation_max_length or data_args.val_max_target_length
    training_args.generation_num_beams = data_args.num_beams or training_args.generation_num_beams

    run_clm.check_resume_before_data(training_args, model)  # a checkpoint of another model, before tokenizing
    with training_args.main_process_first(desc="tokenizing"):
        tokenized = tokenize_pairs(raw, tokenizer, (text, summary), data_args)
    take = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    subsets = {s: d.select(range(min(take[s], len(d)))) if take[s] else d for s, d in tokenized.items()}
    collator = DataCollatorForSeq2Seq(
        tokenizer,
        model=model,
        label_pad_token_id=label_padding(tokenizer, data_args),
        pad_to_multiple_of=None if data_args.pad_to_max_length else 8,
    )
    return GaudiSeq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=subsets["train"] if training_args.do_train else None,
        eval_dataset=subsets["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=rouge_metrics(tokenizer) if training_args.predict_with_generate else None,
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    groups = (ModelArguments, DataTrainingArguments, GaudiSeq2SeqTrainingArguments)
    # ROUGE (with --predict_with_generate) comes from compute_metrics
    return run_clm.run_example(
        argv, groups, build_trainer, partial(run_clm.train_and_evaluate, evaluate=run_clm.evaluate_samples)
    )


if __name__ == "__main__":
    run_main(main)
