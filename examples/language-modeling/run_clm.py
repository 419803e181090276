#!/usr/bin/env python
"""Causal language modeling (GPT-2, Llama, ...) with GaudiTrainer, from a Hub model or from scratch.

The command line is the one people know from transformers' run_clm.py plus every GaudiTrainingArguments flag,
so the same command runs on a Gaudi, a GPU or a laptop CPU. With no dataset and no tokenizer it trains on the
embedded default corpus and tokenizer (optimum_gaudi.data.corpus), and with no model it trains a small
Llama-shaped model from scratch (grouped-query attention, RMSNorm, rotary embedding), so it works offline out
of the box. Today's Gaudi default path, eager mode + torch.compile:

    python examples/language-modeling/run_clm.py --do_train --do_eval --use_habana --gaudi_config_name llama \
        --attn_implementation gaudi_fused_sdpa --torch_compile --bf16 --max_steps 20 --output_dir /tmp/clm

Lazy mode (Gaudi software up to 1.20), with GPT-2:

    python examples/language-modeling/run_clm.py --model_type gpt2 \
        --config_overrides n_layer=2,n_embd=128,n_head=4 --do_train --do_eval \
        --use_habana --use_lazy_mode --gaudi_config_name Habana/gpt2 --bf16 --max_steps 20 --output_dir /tmp/clm

A single argument ending in .json is read as a file holding all the arguments. A mistake in the command line or
the data ends the run with one `error: ...` line and exit status 2 (optimum_gaudi.errors), leaving --output_dir as
it was; an --output_dir holding another run's checkpoints is refused unless --resume_from_checkpoint true or
--overwrite_output_dir says what to do with them.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from datasets import DatasetDict, load_dataset
from safetensors import SafetensorError
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import (
    OutputDirGuard,
    check_output_dir,
    check_resume_before_data,
    disk_full_is_user_error,
)
from optimum_gaudi.configuration.hub import require_hub
from optimum_gaudi.data.corpus import (
    check_text_file,
    check_text_fills_a_block,
    default_datasets,
    default_tokenizer,
    find_text_column,
    tokenize_and_group,
)
from optimum_gaudi.errors import UserError, exception_chain, one_line, quiet_argparse_errors, run_main
from optimum_gaudi.trainers.plan_check import check_plan_before_loading, weight_bytes_as_loaded
from optimum_gaudi.trainers.training_args import check_report_to

logger = logging.getLogger(__name__)

MODEL_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
# The model trained when none is named: Llama-shaped (grouped-query attention over 4 x 2 heads), small enough
# for a laptop CPU; --config_overrides changes any of it (e.g. num_hidden_layers=12,hidden_size=576).
DEFAULT_MODEL_TYPE = "llama"
DEFAULT_MODEL_SHAPE = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)
DEFAULT_CORPUS_BLOCK_SIZE = 128  # the embedded corpus is small: short blocks give more of them
_FILE_BUILDERS = {"txt": "text", "json": "json", "jsonl": "json", "csv": "csv"}


class UsageError(UserError, ValueError):
    """Something in the command line that cannot work; reported as one line, without a traceback."""


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to start from."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained model (local directory or Hub name). Unset: train from scratch."}
    )
    model_type: str | None = field(
        default=None, metadata={"help": "Model type to train from scratch.", "choices": MODEL_TYPES}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Config values when training from scratch, e.g. n_layer=2,n_embd=128,resid_pdrop=0.2"},
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path. Unset with no model: the embedded tokenizer."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloads from the Hub are stored."})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (tokenizers-backed) tokenizer."})
    model_revision: str = field(default="main", metadata={"help": "Hub revision: branch, tag or commit."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models and datasets."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the Hub repository."})
    torch_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype to load a pretrained model in ('auto': the checkpoint's).",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    use_cache: bool | None = field(
        default=None,
        metadata={
            "help": "The model's key/value cache (off with --gradient_checkpointing). Unset: the model config's "
            "own on transformers 4, the Trainer's (off) on transformers 5."
        },
    )

    def __post_init__(self) -> None:
        if self.config_overrides and self.model_name_or_path:
            raise UsageError(
                "--config_overrides applies when training from scratch; drop it or drop --model_name_or_path."
            )


@dataclass
class DataTrainingArguments:
    """Which text to train and evaluate on, and how to cut it into blocks."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset for datasets.load_dataset (Hub name or local directory)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of the dataset."})
    train_file: str | None = field(default=None, metadata={"help": "Local training text: .txt, .json, .jsonl, .csv"})
    validation_file: str | None = field(
        default=None, metadata={"help": "Local evaluation text: .txt, .json, .jsonl, .csv"}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many evaluation blocks."})
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per training block. Default: 128 on the embedded corpus, else "
            "min(tokenizer max length, 1024), capped at the model's positions."
        },
    )
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of the training texts held out when there is no validation split."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached tokenized datasets."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks in .txt files."})
    text_column_name: str | None = field(
        default=None,
        metadata={"help": "Column holding the text in .csv/.json/.jsonl files or a dataset (default: text)."},
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "optimum-habana's streaming mode: accepted, but the data is read in full (one line says so)."
        },
    )

    def __post_init__(self) -> None:
        if self.validation_file and not self.train_file:
            raise UsageError("--validation_file needs --train_file.")
        if self.dataset_name and self.train_file:
            raise UsageError("give either --dataset_name or --train_file, not both.")
        for flag, path in (("--train_file", self.train_file), ("--validation_file", self.validation_file)):
            if path is None:
                continue
            if _extension(path) not in _FILE_BUILDERS:
                raise UsageError(f"{flag} {path}: unsupported extension; use one of .{', .'.join(_FILE_BUILDERS)}.")
            if not Path(path).is_file():
                what = "is a directory, not a file" if Path(path).is_dir() else "does not exist"
                raise UsageError(f"{flag} {path} {what}.")
            check_text_file(path, flag)
        if not 0 <= self.validation_split_percentage < 100:
            raise UsageError(
                f"--validation_split_percentage must be in [0, 100), got {self.validation_split_percentage}."
            )
        if self.block_size is not None and self.block_size < 1:
            raise UsageError(f"--block_size must be >= 1, got {self.block_size}.")
        for flag, value in (
            ("--max_train_samples", self.max_train_samples),
            ("--max_eval_samples", self.max_eval_samples),
        ):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be >= 1 (or unset for all), got {value}.")
        if self.streaming:
            logger.warning("--streaming: the dataset is read in full here, not streamed (it must fit in memory).")

    @property
    def uses_default_corpus(self) -> bool:
        return not (self.dataset_name or self.train_file)


def _extension(path: str) -> str:
    return Path(path).suffix.lower().lstrip(".")


def parse_args(argv: list[str] | None = None, groups: tuple[type, ...] | None = None) -> tuple[Any, ...]:
    """Parse the command line (or one .json file holding every argument) into the argument groups (by
    default this script's three; the other examples pass their own)."""
    parser = quiet_argparse_errors(
        HfArgumentParser(groups or (ModelArguments, DataTrainingArguments, GaudiTrainingArguments))
    )
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            return _parse_json_arguments(parser, argv[0])
        return parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    except UserError:
        raise
    except (ValueError, TypeError) as e:  # the argument dataclasses validate in __post_init__
        raise UsageError(one_line(str(e))) from None


def _parse_json_arguments(parser: HfArgumentParser, path: str) -> tuple[Any, ...]:
    try:
        arguments = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read the arguments file {path}: {e.strerror or e}.") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"the arguments file {path} is not JSON: {one_line(str(e))}.") from None
    if not isinstance(arguments, dict):
        raise UsageError(f"the arguments file {path} must hold one JSON object of argument names and values.")
    known = {f.dest for f in parser._actions}
    unknown = sorted(set(arguments) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else "."
        raise UsageError(f"the arguments file {path} has unknown argument '{unknown[0]}'{hint}")
    return parser.parse_dict(arguments)


# ---- loading -------------------------------------------------------------------------------------------


def _require_reachable(what: str, name_or_path: str | None) -> None:
    """A name that is not a local path needs the Hub: fail in seconds with one line when it is out of reach."""
    if name_or_path and not Path(name_or_path).expanduser().exists():
        hint = f"Use a local path for the {what}, or leave it unset for the embedded default."
        require_hub(f"{what} '{name_or_path}'", hint)


def check_hub_names(model_args: ModelArguments, data_args: DataTrainingArguments) -> None:
    """Check every name on the command line before loading anything, so the error comes first, not last."""
    _require_reachable("model", model_args.model_name_or_path)
    _require_reachable("config", model_args.config_name)
    _require_reachable("tokenizer", model_args.tokenizer_name)
    _require_reachable("dataset", data_args.dataset_name)


def _damaged_weights(e: Exception) -> bool:
    """A truncated or corrupted weights file: safetensors' and torch's errors for it derive from neither OSError
    nor ValueError."""
    torch_zip = isinstance(e, RuntimeError) and "PytorchStreamReader" in str(e)
    return torch_zip or isinstance(e, (SafetensorError, pickle.UnpicklingError))


def _from_pretrained(loader: Any, name_or_path: str, what: str, /, **kwargs: Any) -> Any:
    """`loader(name_or_path)`, failing in one line when the Hub is out of reach or the files do not load."""
    _require_reachable(what, name_or_path)
    try:
        return loader(name_or_path, **kwargs)
    except Exception as e:
        damaged = _damaged_weights(e)
        if not (damaged or isinstance(e, (OSError, ValueError))):  # missing or unusable files raise one of these
            raise
        reason = str(e).strip().splitlines()[0].rstrip(" :")
        if damaged:  # the loaders' own words go on to suggest unsafe loading, or blame miniz
            reason = f"a weights file is damaged or truncated ({reason.split('. ')[0]}); save or download it again"
        raise UsageError(f"cannot load {what} '{name_or_path}': {reason}") from None


def _hub_kwargs(model_args: ModelArguments) -> dict[str, Any]:
    return {
        "cache_dir": model_args.cache_dir,
        "revision": model_args.model_revision,
        "token": model_args.token,
        "trust_remote_code": model_args.trust_remote_code,
    }


def with_validation_split(raw: DatasetDict, percentage: int, seed: int) -> DatasetDict:
    if "validation" in raw or percentage == 0:
        return raw
    texts = len(raw["train"])
    if texts * (1 - percentage / 100) < 1:  # train_test_split would leave no training text
        raise UsageError(
            f"the training data has {texts} text(s), too few to hold out {percentage}% for validation; "
            "give more text, a --validation_file, or --validation_split_percentage 0 without --do_eval."
        )
    split = raw["train"].train_test_split(test_size=percentage / 100, seed=seed)
    return DatasetDict(train=split["train"], validation=split["test"])


def load_raw_datasets(
    data_args: DataTrainingArguments, model_args: ModelArguments, seed: int
) -> tuple[DatasetDict, str]:
    """Train/validation texts from a dataset, local files, or the embedded default corpus, and the column
    holding the text (checked before the split, so a wrong column is the error a user sees first)."""
    if data_args.uses_default_corpus:
        if data_args.validation_split_percentage == 0:
            raise UsageError("the embedded corpus needs --validation_split_percentage > 0.")
        raw = default_datasets(validation_fraction=data_args.validation_split_percentage / 100, seed=seed)
        return raw, _text_column(raw, data_args)
    raw = load_named_data(data_args, model_args)
    column = _text_column(raw, data_args)
    return with_validation_split(raw, data_args.validation_split_percentage, seed), column


def load_named_data(data_args: DataTrainingArguments, model_args: ModelArguments) -> DatasetDict:
    """The --dataset_name dataset or the --train_file / --validation_file files as they are (at least a train
    split); a file that cannot be read is one line naming what is wrong in it."""
    if data_args.dataset_name:
        raw = _from_pretrained(
            load_dataset,
            data_args.dataset_name,
            "dataset",
            name=data_args.dataset_config_name,
            cache_dir=model_args.cache_dir,
            token=model_args.token,
        )
    else:
        files = {"train": data_args.train_file}
        if data_args.validation_file:
            files["validation"] = data_args.validation_file
        kinds = {_FILE_BUILDERS[_extension(path)] for path in files.values()}
        if len(kinds) > 1:
            raise UsageError("--train_file and --validation_file must be the same kind of file (text, json or csv).")
        builder = kinds.pop()
        extra = {"keep_linebreaks": data_args.keep_linebreaks} if builder == "text" else {}
        try:
            raw = load_dataset(builder, data_files=files, cache_dir=model_args.cache_dir, **extra)
        except Exception as e:  # datasets wraps the parser's error; the innermost one says what is wrong
            cause = exception_chain(e)[-1]
            reason = one_line(str(cause) or type(cause).__name__)[:300]
            raise UsageError(f"cannot read {', '.join(files.values())} as {builder}: {reason}") from None
    if "train" not in raw:
        raise UsageError(f"the dataset has no 'train' split (it has: {', '.join(raw)}).")
    return raw


def _text_column(raw: DatasetDict, data_args: DataTrainingArguments) -> str:
    """--text_column_name, or ``text``; one line naming the columns there are when the data has neither."""
    source = data_args.train_file or data_args.dataset_name or "the embedded corpus"
    return find_text_column(raw, data_args.text_column_name, source)


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The named tokenizer, the model's, or (training from scratch with none named) the embedded one."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        return default_tokenizer()
    return _from_pretrained(
        AutoTokenizer.from_pretrained,
        name,
        "tokenizer",
        use_fast=model_args.use_fast_tokenizer,
        **_hub_kwargs(model_args),
    )


def parse_config_overrides(config: PretrainedConfig, overrides: str) -> dict[str, Any]:
    """Parse ``key=value,key=value`` against `config`, typing each value like the value it replaces."""
    known = config.to_dict()
    parsed: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            raise UsageError(f"--config_overrides: '{item}' is not key=value (e.g. n_layer=2,n_embd=128).")
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UsageError(f"--config_overrides: {config.model_type} config has no key '{key}'{hint}")
        try:
            parsed[key] = _typed_like(known[key], raw)
        except ValueError:
            kind = type(known[key]).__name__
            raise UsageError(f"--config_overrides: {key} must be of type {kind}, got '{raw}'.") from None
    return parsed


def _typed_like(old: Any, raw: str) -> Any:
    if isinstance(old, bool):
        if raw.lower() not in {"true", "false", "1", "0"}:
            raise ValueError(raw)
        return raw.lower() in {"true", "1"}
    if isinstance(old, (int, float, str)):
        return type(old)(raw)
    try:  # None, lists, dicts: JSON, else a plain string
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def load_config(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> tuple[PretrainedConfig, set[str]]:
    """The model config, matched to the tokenizer when training from scratch; also the keys the user set."""
    if model_args.config_name or model_args.model_name_or_path:
        name = model_args.config_name or model_args.model_name_or_path
        config = _from_pretrained(AutoConfig.from_pretrained, name, "config", **_hub_kwargs(model_args))
    elif model_args.model_type:
        config = CONFIG_MAPPING[model_args.model_type]()
    else:
        logger.info(
            "No --model_name_or_path or --model_type: training a small %s model from scratch.", DEFAULT_MODEL_TYPE
        )
        config = CONFIG_MAPPING[DEFAULT_MODEL_TYPE](**DEFAULT_MODEL_SHAPE)
    if model_args.use_cache is not None:
        config.use_cache = model_args.use_cache
    if model_args.model_name_or_path:
        return config, set()
    # From scratch: the embedding must cover the tokenizer, and generation must know its special tokens.
    config.vocab_size = len(tokenizer)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, attr) is not None:
            setattr(config, attr, getattr(tokenizer, attr))
    overrides = parse_config_overrides(config, model_args.config_overrides or "")
    for key, value in overrides.items():
        setattr(config, key, value)
    if overrides:
        logger.info("Config overrides: %s", overrides)
    return config, set(overrides)


_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def position_limit(config: PretrainedConfig) -> tuple[str | None, int | None]:
    """The config's key for the longest sequence the model takes, and its value (None, None: no limit)."""
    key = next((k for k in _POSITION_KEYS if isinstance(getattr(config, k, None), int)), None)
    return key, getattr(config, key) if key else None


def resolve_block_size(
    data_args: DataTrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    config: PretrainedConfig,
    from_scratch: bool,
    user_keys: set[str],
) -> int:
    """The block size asked for, or a default that fits the model; from scratch, positions grow to fit."""
    requested = data_args.block_size
    if requested is None:
        requested = (
            DEFAULT_CORPUS_BLOCK_SIZE if data_args.uses_default_corpus else min(tokenizer.model_max_length, 1024)
        )
    key, limit = position_limit(config)
    if limit is None or requested <= limit:
        return requested
    if from_scratch and not user_keys.intersection(_POSITION_KEYS):
        logger.info("Raising %s from %d to the block size %d.", key, limit, requested)
        setattr(config, key, requested)
        return requested
    if data_args.block_size is None:
        return limit
    raise UsageError(f"--block_size {requested} is longer than the model's {key}={limit}; lower --block_size.")


def check_table_files(data_args: Any) -> None:
    """The data checks of the examples that read tables (run_glue, run_summarization): --train_file and
    --validation_file existing .csv/.json/.jsonl files, the second only with the first, and
    --validation_split_percentage in (0, 100)."""
    if data_args.validation_file and not data_args.train_file:
        raise UsageError("--validation_file needs --train_file.")
    for flag, path in (("--train_file", data_args.train_file), ("--validation_file", data_args.validation_file)):
        if path is not None and Path(path).suffix.lower() not in {".csv", ".json", ".jsonl"}:
            raise UsageError(f"{flag} {path}: use a .csv, .json or .jsonl file.")
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{flag} {path} does not exist.")
    if not 0 < data_args.validation_split_percentage < 100:
        raise UsageError(
            f"--validation_split_percentage must be in (0, 100), got {data_args.validation_split_percentage}."
        )


def load_model(
    model_args: ModelArguments,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    auto_class: type = AutoModelForCausalLM,
    **loading: Any,
) -> PreTrainedModel:
    """The pretrained model (`loading`: more from_pretrained arguments), or a new one from `config` (an
    `auto_class` model: causal LM here, masked LM in run_mlm); embeddings resized if the tokenizer is larger."""
    if model_args.model_name_or_path:
        dtype = {"dtype": model_args.torch_dtype} if model_args.torch_dtype else {}
        model = _from_pretrained(
            auto_class.from_pretrained,
            model_args.model_name_or_path,
            "model",
            config=config,
            **dtype,
            **_hub_kwargs(model_args),
            **loading,
        )
    else:
        model = auto_class.from_config(config, trust_remote_code=model_args.trust_remote_code)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("Training a new %s model from scratch: %.2fM parameters.", config.model_type, n_params / 1e6)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    return model


# ---- training ------------------------------------------------------------------------------------------


def build_trainer(
    model_args: ModelArguments,
    data_args: DataTrainingArguments,
    training_args: GaudiTrainingArguments,
    wrap_model: Callable[[PreTrainedModel], torch.nn.Module] | None = None,
) -> GaudiTrainer:
    """Everything up to a ready GaudiTrainer: data, tokenizer, config, model (passed through `wrap_model`
    if given, e.g. to add LoRA adapters), tokenized blocks."""
    if training_args.push_to_hub:
        require_hub("--push_to_hub", "Drop --push_to_hub to keep the model in --output_dir only.")
    if not (training_args.do_train or training_args.do_eval):
        raise UsageError("nothing to do: add --do_train and/or --do_eval.")
    check_hub_names(model_args, data_args)
    logger.info("Device: %s", training_args.gaudi_device.describe())
    set_seed(training_args.seed)  # before the model is built: a new model's weights depend on it
    tokenizer = load_tokenizer(model_args)
    config, user_keys = load_config(model_args, tokenizer)
    from_scratch = model_args.model_name_or_path is None
    block_size = resolve_block_size(data_args, tokenizer, config, from_scratch, user_keys)
    if training_args.do_train:  # a plan that cannot fit its card: one line now, not an OOM after the weights load
        weights = weight_bytes_as_loaded(config, model_args.torch_dtype, pretrained=not from_scratch)
        check_plan_before_loading(config, training_args, block_size, weight_bytes=weights)
    raw, column, splits = load_texts(data_args, model_args, training_args, block_size)  # data mistakes first
    model = load_model(model_args, config, tokenizer)
    if wrap_model is not None:
        model = wrap_model(model)
    check_resume_before_data(training_args, model)  # a checkpoint of another model, before tokenizing

    with training_args.main_process_first(desc="tokenizing"):
        blocks = tokenize_and_group(
            raw,
            tokenizer,
            block_size,
            text_column=column,
            num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
            required=splits,
        )
    logger.info("Blocks of %d tokens: %s", block_size, {split: len(b) for split, b in blocks.items()})
    train_dataset = _take(blocks, "train", data_args.max_train_samples, block_size) if training_args.do_train else None
    eval_dataset = (
        _take(blocks, "validation", data_args.max_eval_samples, block_size) if training_args.do_eval else None
    )
    return GaudiTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,  # blocks are equal-length already: no padding
    )


def load_texts(
    data_args: DataTrainingArguments,
    model_args: ModelArguments,
    training_args: TrainingArguments,
    block_size: int | None,
) -> tuple[DatasetDict, str, list[str]]:
    """:func:`load_raw_datasets` and the splits the run uses (train, validation), each checked to be long enough
    for one block of `block_size` tokens (None: no blocks cut), before a model is built or a text tokenized."""
    raw, column = load_raw_datasets(data_args, model_args, training_args.seed)
    logger.info("Texts: %s", {split: len(texts) for split, texts in raw.items()})
    if training_args.do_eval and "validation" not in raw:
        raise UsageError("--do_eval needs validation data: --validation_file or --validation_split_percentage > 0.")
    splits = [name for name, used in (("train", training_args.do_train), ("validation", training_args.do_eval)) if used]
    for split in splits if block_size is not None else ():
        check_text_fills_a_block(raw[split], column, block_size, split)
    return raw, column, splits


def _take(blocks: DatasetDict, split: str, limit: int | None, block_size: int) -> datasets.Dataset:
    dataset = blocks[split]
    if len(dataset) == 0:
        raise UsageError(f"the {split} text has fewer than --block_size={block_size} tokens; lower --block_size.")
    return dataset.select(range(min(limit, len(dataset)))) if limit is not None else dataset


def evaluate_samples(trainer: GaudiTrainer, prefix: str = "eval") -> dict[str, float]:
    """trainer.evaluate() plus the number of evaluation examples: the `evaluate` of the examples that
    report their own metrics (accuracy, ROUGE) through compute_metrics."""
    return {**trainer.evaluate(metric_key_prefix=prefix), f"{prefix}_samples": len(trainer.eval_dataset)}


def evaluate_perplexity(trainer: GaudiTrainer, prefix: str = "eval") -> dict[str, float]:
    """:func:`evaluate_samples` plus ``perplexity`` = exp(eval loss)."""
    metrics = evaluate_samples(trainer, prefix)
    try:
        metrics["perplexity"] = math.exp(metrics[f"{prefix}_loss"])
    except OverflowError:
        metrics["perplexity"] = float("inf")
    return metrics


def train_and_evaluate(
    trainer: GaudiTrainer, evaluate: Callable[[GaudiTrainer], dict[str, float]] = evaluate_perplexity
) -> dict[str, float]:
    """Train and/or evaluate (with `evaluate`) as the arguments ask; save model, tokenizer, Gaudi config,
    metrics and state. Every example shares it, so they all save, log and resume alike."""
    args = trainer.args
    metrics: dict[str, float] = {}
    if args.do_train:
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # train() resolves 'true'
        with disk_full_is_user_error(args.output_dir, "the trained model"):
            trainer.save_model()  # also the tokenizer and gaudi_config.json
        train_metrics = {**result.metrics, "train_samples": len(trainer.train_dataset)}
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
        metrics.update(train_metrics)
    if args.do_eval:
        eval_metrics = evaluate(trainer)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    return metrics


def setup_logging(training_args: GaudiTrainingArguments) -> None:
    """This script's own messages at INFO on the main process; the libraries at --log_level (default warning)."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    level = training_args.get_process_log_level()
    logger.setLevel(min(level, logging.INFO) if training_args.should_log else level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_explicit_format()


def settle_use_cache(model_args: ModelArguments, training_args: TrainingArguments) -> None:
    """``--use_cache`` is the script's, as in optimum-habana's (GaudiTrainingArguments keeps transformers 5's
    ``use_cache`` off the command line). transformers 5's Trainer copies the training arguments' ``use_cache``
    into the model config, so a value given goes there too; never on with gradient checkpointing."""
    if model_args.use_cache is None:
        return
    model_args.use_cache = model_args.use_cache and not training_args.gradient_checkpointing
    if hasattr(training_args, "use_cache"):
        training_args.use_cache = model_args.use_cache


def run_example(
    argv: list[str] | None,
    groups: tuple[type, ...] | None,
    build_trainer: Callable[..., GaudiTrainer],
    train_and_evaluate: Callable[[GaudiTrainer], dict[str, float]] = train_and_evaluate,
) -> dict[str, float]:
    """Every example's main: parse `argv` into `groups`, set up logging, check --report_to and --output_dir, then
    ``build_trainer(*parsed)`` and `train_and_evaluate` inside an OutputDirGuard, so that in every example
    another run's checkpoints are refused and a bad input leaves --output_dir as it was."""
    parsed = parse_args(argv, groups)
    training_args = next(group for group in parsed if isinstance(group, TrainingArguments))
    model_args = next((group for group in parsed if isinstance(group, ModelArguments)), None)
    if model_args is not None:
        settle_use_cache(model_args, training_args)
    setup_logging(training_args)
    logging.getLogger(build_trainer.__module__).setLevel(logger.level)  # the example's own messages too
    check_report_to(training_args)  # a --report_to integration not installed, before any data or model
    check_output_dir(training_args)
    check_resume_before_data(training_args)  # a missing or incomplete checkpoint, before any data is read
    with OutputDirGuard(training_args.output_dir, enabled=training_args.should_save) as guard:
        trainer = build_trainer(*parsed)
        trainer.add_callback(guard)
        return train_and_evaluate(trainer)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parse, check, build, train and evaluate; raises UserError (one line) for anything the user can fix."""
    return run_example(argv, None, build_trainer)


if __name__ == "__main__":
    run_main(main)
