#!/usr/bin/env python
"""Group relative policy optimization with TRL's GRPOTrainer made a Gaudi trainer (``GaudiGRPOTrainer``).

    python examples/trl/grpo.py --output_dir /tmp/grpo --max_steps 10 --num_generations 4 \\
        --max_completion_length 16 --use_habana --gaudi_config_name llama --bf16 true

With no model it starts from a small Llama-shaped model; the prompts are the first words of standard-library
docstrings and the reward (``--reward``) is computed from the completion's text, so nothing is downloaded. On a
Gaudi in lazy mode generation keeps static shapes (GaudiGRPOConfig sets a static cache). optimum-habana's
grpo.py arguments apply: ``--dataset_name`` (a ``prompt`` or ``problem`` column), ``--use_peft`` / ``--lora_*``
(its defaults: alpha 32, dropout 0.1), ``--max_prompt_length`` (TRL < 1's option), ``--use_flash_attention``;
with ``--eval_strategy steps`` or ``epoch``, ``--validation_split_percentage`` of the prompts are evaluated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from common import (
    ScriptArguments,
    corpus,
    finish,
    hold_out,
    model_and_tokenizer,
    named_dataset,
    parse,
    with_columns,
)
from datasets import Dataset
from optimum_gaudi.trl import GaudiGRPOConfig, GaudiGRPOTrainer

from optimum_gaudi.errors import run_main

logger = logging.getLogger(__name__)


def vowel_share(completions: list[str], **kwargs) -> list[float]:
    """The share of a completion's characters that are vowels: something a tiny model can learn quickly."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def brevity(completions: list[str], **kwargs) -> list[float]:
    """Shorter completions score higher (1 for an empty one)."""
    return [1.0 / (1.0 + len(text.split())) for text in completions]


REWARDS = {"vowel_share": vowel_share, "brevity": brevity}


@dataclass
class GRPOScriptArguments(ScriptArguments):
    lora_alpha: float = field(default=32, metadata={"help": "LoRA scale numerator: alpha / r."})
    lora_dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA path."})


@dataclass
class RewardArguments:
    reward: str = field(default="vowel_share", metadata={"help": "Reward function.", "choices": sorted(REWARDS)})


def main(argv: list[str] | None = None) -> None:
    script, config, reward_args = parse(GaudiGRPOConfig, argv, RewardArguments, script_class=GRPOScriptArguments)
    model, tokenizer = model_and_tokenizer(script, config)
    rows = named_dataset(script)
    if rows is None:
        rows = Dataset.from_dict({"prompt": [" ".join(t.split()[:6]) for t in corpus(script, 500) if t.split()]})
    else:
        rows = with_columns(rows, script, "GRPO", {("prompt",): None, ("problem",): lambda r: {"prompt": r["problem"]}})
    eval_rows = None
    if config.eval_strategy != "no":
        rows, eval_rows = hold_out(rows, script, config.seed)
    elif config.do_eval:
        logger.warning(
            "--do_eval: GRPO evaluates during training, with --eval_strategy steps or epoch (as optimum-habana's "
            "grpo.py); with --eval_strategy no nothing is evaluated."
        )
    reward = REWARDS[reward_args.reward]
    trainer = GaudiGRPOTrainer(
        model,
        reward,
        args=config,
        train_dataset=rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        peft_config=script.peft_config(),
    )
    finish(trainer)


if __name__ == "__main__":
    run_main(main)
