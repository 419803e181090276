"""What the TRL examples share: the script arguments, the model (a named one, or a small Llama-shaped model
trained from scratch with the embedded tokenizer, so every script runs offline), and the run's end."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "language-modeling"))
import run_clm  # noqa: E402  (the language-modeling example: loading with one-line errors, the default shape)

from optimum_gaudi.data.corpus import default_corpus_texts, default_tokenizer  # noqa: E402
from optimum_gaudi.errors import UserError, quiet_argparse_errors  # noqa: E402


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model to train (local directory or Hub name). Unset: a small Llama."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many examples."})

    def __post_init__(self) -> None:
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise UserError(f"--max_train_samples must be >= 1 (or unset for all), got {self.max_train_samples}.")


def parse(config_class: type, argv: list[str] | None, *more: type) -> tuple[Any, ...]:
    """(ScriptArguments, the Gaudi TRL config, then one instance per class in ``more``) from the command line."""
    parser = quiet_argparse_errors(HfArgumentParser((ScriptArguments, config_class, *more)))
    try:
        return tuple(parser.parse_args_into_dataclasses(argv))
    except (ValueError, TypeError) as e:  # a dataclass check that is not ours yet
        raise UserError(str(e).splitlines()[0]) from None


def model_and_tokenizer(script: ScriptArguments, args: Any) -> tuple[torch.nn.Module, Any]:
    """The model and tokenizer, after the output directory and the checkpoint to resume from are checked (before
    the TRL trainer reads and tokenizes any data)."""
    args.do_train = True  # these scripts always train (the Trainer itself never reads --do_train)
    run_clm.check_output_dir(args)
    run_clm.check_resume_before_data(args)
    model, tokenizer = _load(script, args.seed)
    run_clm.check_resume_before_data(args, model)
    return model, tokenizer


def _load(script: ScriptArguments, seed: int) -> tuple[torch.nn.Module, Any]:
    if script.model_name_or_path:
        tokenizer = run_clm._from_pretrained(AutoTokenizer.from_pretrained, script.model_name_or_path, "tokenizer")
        model = run_clm._from_pretrained(AutoModelForCausalLM.from_pretrained, script.model_name_or_path, "model")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model, tokenizer
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
    return LlamaForCausalLM(config), tokenizer


def corpus(script: ScriptArguments, n: int) -> list[str]:
    texts = default_corpus_texts()[:n]
    return texts[: script.max_train_samples] if script.max_train_samples else texts


def finish(trainer: Any) -> None:
    result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
