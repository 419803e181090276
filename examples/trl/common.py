"""What the TRL examples share: the script arguments (optimum-habana's TRL scripts' own, with their meanings),
the model (a named one, or a small Llama-shaped model trained from scratch with the embedded tokenizer, so every
script runs offline), LoRA adapters, a named dataset, and the run's end."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
)
from transformers.hf_argparser import string_to_bool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "language-modeling"))
import run_clm  # noqa: E402  (the language-modeling example: loading with one-line errors, the default shape)

from optimum_gaudi.data.corpus import default_corpus_texts, default_tokenizer  # noqa: E402
from optimum_gaudi.errors import UserError, quiet_argparse_errors  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model to train (local directory or Hub name). Unset: a small Llama."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer (local directory or Hub name), if not the model's."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many examples."})
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Dataset for datasets.load_dataset (Hub name or local directory). Unset: embedded data."},
    )
    subset: str | None = field(
        default=None, metadata={"help": "Folder of the dataset to read (load_dataset's data_dir; '' or None: all)."}
    )
    split: str = field(default="train", metadata={"help": "Split of --dataset_name to train on."})
    streaming: bool = field(
        default=False,
        metadata={
            "help": "optimum-habana's streaming mode: accepted, but the data is read in full (one line says so)."
        },
    )
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of the examples held out for evaluation (--do_eval)."}
    )
    use_peft: bool | None = field(
        default=None,
        metadata={
            "help": "Train LoRA adapters (PEFT) instead of the whole model. Unset: on when --lora_target_modules "
            "is given."
        },
    )
    lora_r: int = field(default=8, metadata={"help": "Rank of the LoRA update matrices."})
    lora_alpha: float = field(default=16, metadata={"help": "LoRA scale numerator: alpha / r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules given LoRA adapters, e.g. q_proj v_proj (default: PEFT's choice)."}
    )
    use_flash_attention: bool = field(
        default=False,
        metadata={
            "help": "optimum-habana's switch for Gaudi's fused attention: --attn_implementation gaudi_fused_sdpa."
        },
    )

    def __post_init__(self) -> None:
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise UserError(f"--max_train_samples must be >= 1 (or unset for all), got {self.max_train_samples}.")
        if not 0 < self.validation_split_percentage < 100:
            raise UserError(
                f"--validation_split_percentage must be in (0, 100), got {self.validation_split_percentage}."
            )
        if self.use_peft is None:
            self.use_peft = self.lora_target_modules is not None
        if self.streaming:
            logger.warning("--streaming: the dataset is read in full here, not streamed (it must fit in memory).")

    def peft_config(self) -> Any:
        """The LoRA configuration the TRL trainer wraps the model with (optimum-habana's), or None."""
        if not self.use_peft:
            return None
        if importlib.util.find_spec("peft") is None:
            raise UserError("--use_peft needs PEFT: pip install 'optimum-gaudi[peft]' (or: pip install peft).")
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.lora_target_modules,
            bias="none",
            task_type="CAUSAL_LM",
        )


def _flash_attention(argv: list[str]) -> list[str]:
    """optimum-habana's --use_flash_attention becomes --attn_implementation gaudi_fused_sdpa before the training
    arguments are built (they register the attention and check the --flash_attention_* modes against it)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--use_flash_attention", type=string_to_bool, nargs="?", const=True, default=False)
    pre.add_argument("--attn_implementation")
    try:
        known, _ = pre.parse_known_args(argv)
    except (SystemExit, argparse.ArgumentError):  # a bad value: the full parser says so in one line
        return argv
    if not known.use_flash_attention or known.attn_implementation is not None:
        return argv
    logger.warning("--use_flash_attention is read as --attn_implementation gaudi_fused_sdpa; pass that instead.")
    return [*argv, "--attn_implementation", "gaudi_fused_sdpa"]


def parse(
    config_class: type, argv: list[str] | None, *more: type, script_class: type = ScriptArguments
) -> tuple[Any, ...]:
    """(script arguments, the Gaudi TRL config, then one instance per class in ``more``) from the command line."""
    argv = _flash_attention(list(sys.argv[1:] if argv is None else argv))
    parser = quiet_argparse_errors(HfArgumentParser((script_class, config_class, *more)))
    for action in parser._actions:
        # TRL declares some switches `bool | None` (--bf16: None means "unless --fp16"), which HfArgumentParser
        # makes take a value; TRL < 1, and so optimum-habana's command lines, give them bare, meaning true
        if action.type is string_to_bool and action.nargs is None:
            action.nargs, action.const = "?", True
    try:
        return tuple(parser.parse_args_into_dataclasses(argv))
    except (ValueError, TypeError) as e:  # a dataclass check that is not ours yet
        raise UserError(str(e).splitlines()[0]) from None


def model_and_tokenizer(
    script: ScriptArguments, args: Any, before_loading: Callable[[PretrainedConfig], None] | None = None
) -> tuple[torch.nn.Module, Any]:
    """The model and tokenizer, after the output directory and the checkpoint to resume from are checked (before
    the TRL trainer reads and tokenizes any data); ``before_loading`` sees the model's config before any weight is
    read (sft.py checks its memory plan there)."""
    args.do_train = True  # these scripts always train (the Trainer itself never reads --do_train)
    run_clm.check_output_dir(args)
    run_clm.check_resume_before_data(args)
    model, tokenizer = _load(script, args.seed, before_loading or (lambda config: None))
    run_clm.check_resume_before_data(args, model)
    return model, tokenizer


def _load(
    script: ScriptArguments, seed: int, before_loading: Callable[[PretrainedConfig], None]
) -> tuple[torch.nn.Module, Any]:
    if script.model_name_or_path:
        tokenizer_name = script.tokenizer_name_or_path or script.model_name_or_path
        tokenizer = run_clm._from_pretrained(AutoTokenizer.from_pretrained, tokenizer_name, "tokenizer")
        config = run_clm._from_pretrained(AutoConfig.from_pretrained, script.model_name_or_path, "model")
        before_loading(config)
        model = run_clm._from_pretrained(
            AutoModelForCausalLM.from_pretrained, script.model_name_or_path, "model", config=config
        )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model, tokenizer
    if script.tokenizer_name_or_path:
        raise UserError("--tokenizer_name_or_path needs --model_name_or_path (the small default model has its own).")
    tokenizer = default_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        **run_clm.DEFAULT_MODEL_SHAPE,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    before_loading(config)
    return LlamaForCausalLM(config), tokenizer


def corpus(script: ScriptArguments, n: int) -> list[str]:
    texts = default_corpus_texts()[:n]
    return texts[: script.max_train_samples] if script.max_train_samples else texts


def named_dataset(script: ScriptArguments) -> Dataset | None:
    """The --dataset_name split (its --subset folder), at most --max_train_samples rows; None without a name."""
    if not script.dataset_name:
        return None
    data_dir = None if script.subset in (None, "", "None") else script.subset
    rows = run_clm._from_pretrained(load_dataset, script.dataset_name, "dataset", data_dir=data_dir, split=script.split)
    return rows.select(range(min(script.max_train_samples, len(rows)))) if script.max_train_samples else rows


def with_columns(rows: Dataset, script: ScriptArguments, task: str, columns: dict[str, Any]) -> Dataset:
    """``rows`` with the columns TRL's `task` trainer reads: `columns` maps the columns a dataset may have to the
    function making the trainer's from them (None: they are the trainer's); the first entry the rows have applies,
    and with none of them, one line names the columns there are."""
    names = set(rows.column_names)
    for needed, make in columns.items():
        if set(needed) <= names:
            return rows if make is None else rows.map(make, remove_columns=rows.column_names)
    wanted = " or ".join("/".join(needed) for needed in columns)
    raise UserError(
        f"--dataset_name {script.dataset_name}: {task} needs the columns {wanted}; it has {', '.join(sorted(names))}."
    )


def hold_out(rows: Dataset, script: ScriptArguments, seed: int) -> tuple[Dataset, Dataset]:
    """(train, evaluation) rows: --validation_split_percentage of them held out, as optimum-habana's sft.py."""
    if len(rows) < 2:
        raise UserError(f"{len(rows)} example(s): too few to hold some out for --do_eval.")
    split = rows.train_test_split(test_size=script.validation_split_percentage / 100, seed=seed)
    return split["train"], split["test"]


def finish(trainer: Any, evaluate: bool = False) -> None:
    """Train, save the model (the adapters with LoRA) and the training metrics; with `evaluate`, evaluate on the
    held-out examples and save their loss, count and perplexity."""
    result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    if evaluate:
        metrics = {**trainer.evaluate(), "eval_samples": len(trainer.eval_dataset)}
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
