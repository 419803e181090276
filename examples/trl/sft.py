#!/usr/bin/env python
"""Supervised fine-tuning with TRL's SFTTrainer made a Gaudi trainer (``GaudiSFTTrainer``), offline by default.

    python examples/trl/sft.py --output_dir /tmp/sft --max_steps 20 --use_habana --gaudi_config_name llama \\
        --attn_implementation gaudi_fused_sdpa --bf16 true

With no model it trains a small Llama-shaped model from scratch on the embedded corpus (docstrings of Python's
standard library); ``--model_name_or_path`` fine-tunes yours. Every SFTConfig and Gaudi flag applies, and so do
the arguments of optimum-habana's sft.py: ``--dataset_name`` (a ``text`` or ``messages`` column, or Stack
Exchange's question/response_j), ``--subset``, ``--use_peft`` / ``--lora_*`` (LoRA adapters),
``--use_flash_attention``, ``--max_seq_length`` (TRL < 1's name of ``--max_length``, which GaudiSFTConfig
reads); ``--do_eval`` holds out ``--validation_split_percentage`` of the examples and reports their loss and
perplexity. On a Gaudi or a GPU the run's memory plan (at ``--max_length``; with ``--use_peft`` of its adapters) is
checked before the weights load: one line where it cannot fit the card, ``--ignore_plan`` to train anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from common import ScriptArguments, corpus, finish, hold_out, model_and_tokenizer, named_dataset, parse, with_columns
from datasets import Dataset
from optimum_gaudi.trl import GaudiSFTConfig, GaudiSFTTrainer

from optimum_gaudi.errors import run_main
from optimum_gaudi.planning import Adapters
from optimum_gaudi.trainers.plan_check import check_plan_before_loading, weight_bytes_as_loaded

logger = logging.getLogger(__name__)


def stack_exchange_text(row: dict[str, Any]) -> dict[str, str]:
    """A Stack Exchange pair as optimum-habana's sft.py writes it for lvwerra/stack-exchange-paired."""
    return {"text": f"Question: {row['question']}\n\nAnswer: {row['response_j']}"}


def check_the_plan_before_loading(script: ScriptArguments, args: GaudiSFTConfig) -> Callable[[Any], None]:
    """The memory plan of this run checked from the model's config (one line where it cannot fit its card, before
    any weight is read): its rows are at most --max_length tokens; with --use_peft it trains LoRA adapters."""

    def check(model_config: Any) -> None:
        adapters = None
        weights = weight_bytes_as_loaded(model_config, None, pretrained=bool(script.model_name_or_path))
        if script.use_peft:
            adapters = Adapters(
                script.lora_r, tuple(script.lora_target_modules or ()), script.lora_dropout > 0, weights
            )
        check_plan_before_loading(model_config, args, args.max_length, adapters, weight_bytes=weights)

    return check


def main(argv: list[str] | None = None) -> None:
    script, config = parse(GaudiSFTConfig, argv)
    model, tokenizer = model_and_tokenizer(script, config, check_the_plan_before_loading(script, config))
    rows = named_dataset(script)
    if rows is None:
        rows = Dataset.from_dict({"text": corpus(script, 2000)})
    else:
        kinds = {("text",): None, ("messages",): None, ("prompt", "completion"): None}
        rows = with_columns(rows, script, "SFT", {**kinds, ("question", "response_j"): stack_exchange_text})
    eval_rows = None
    if config.do_eval:
        rows, eval_rows = hold_out(rows, script, config.seed)
    trainer = GaudiSFTTrainer(
        model=model,
        args=config,
        train_dataset=rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        peft_config=script.peft_config(),
    )
    finish(trainer, evaluate=config.do_eval)


if __name__ == "__main__":
    run_main(main)
