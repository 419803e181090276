#!/usr/bin/env python
"""Group relative policy optimization with TRL's GRPOTrainer made a Gaudi trainer (``GaudiGRPOTrainer``).

    python examples/trl/grpo.py --output_dir /tmp/grpo --max_steps 10 --num_generations 4 \\
        --max_completion_length 16 --use_habana --gaudi_config_name llama --bf16 true

With no model it starts from a small Llama-shaped model; the prompts are the first words of standard-library
docstrings and the reward (``--reward``) is computed from the completion's text, so nothing is downloaded. On a
Gaudi in lazy mode generation keeps static shapes (GaudiGRPOConfig sets a static cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import corpus, finish, model_and_tokenizer, parse
from datasets import Dataset
from optimum_gaudi.trl import GaudiGRPOConfig, GaudiGRPOTrainer

from optimum_gaudi.errors import run_main


def vowel_share(completions: list[str], **kwargs) -> list[float]:
    """The share of a completion's characters that are vowels: something a tiny model can learn quickly."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def brevity(completions: list[str], **kwargs) -> list[float]:
    """Shorter completions score higher (1 for an empty one)."""
    return [1.0 / (1.0 + len(text.split())) for text in completions]


REWARDS = {"vowel_share": vowel_share, "brevity": brevity}


@dataclass
class RewardArguments:
    reward: str = field(default="vowel_share", metadata={"help": "Reward function.", "choices": sorted(REWARDS)})


def main(argv: list[str] | None = None) -> None:
    script, config, reward_args = parse(GaudiGRPOConfig, argv, RewardArguments)
    model, tokenizer = model_and_tokenizer(script, config)
    prompts = [" ".join(text.split()[:6]) for text in corpus(script, 500) if text.split()]
    reward = REWARDS[reward_args.reward]
    data = Dataset.from_dict({"prompt": prompts})
    finish(GaudiGRPOTrainer(model, reward, args=config, train_dataset=data, processing_class=tokenizer))


if __name__ == "__main__":
    run_main(main)
