#!/usr/bin/env python
"""Supervised fine-tuning with TRL's SFTTrainer made a Gaudi trainer (``GaudiSFTTrainer``), offline by default.

    python examples/trl/sft.py --output_dir /tmp/sft --max_steps 20 --use_habana --gaudi_config_name llama \\
        --attn_implementation gaudi_fused_sdpa --bf16 true

With no model it trains a small Llama-shaped model from scratch on the embedded corpus (docstrings of Python's
standard library); ``--model_name_or_path`` fine-tunes yours. Every SFTConfig and Gaudi flag applies.
"""

from __future__ import annotations

from common import corpus, finish, model_and_tokenizer, parse
from datasets import Dataset
from optimum_gaudi.trl import GaudiSFTConfig, GaudiSFTTrainer

from optimum_gaudi.errors import run_main


def main(argv: list[str] | None = None) -> None:
    script, config = parse(GaudiSFTConfig, argv)
    model, tokenizer = model_and_tokenizer(script, config)
    data = Dataset.from_dict({"text": corpus(script, 2000)})
    finish(GaudiSFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer))


if __name__ == "__main__":
    run_main(main)
