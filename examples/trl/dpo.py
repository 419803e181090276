#!/usr/bin/env python
"""Direct preference optimization with TRL's DPOTrainer made a Gaudi trainer (``GaudiDPOTrainer``).

    python examples/trl/dpo.py --output_dir /tmp/dpo --max_steps 20 --use_habana --gaudi_config_name llama --bf16 true

With no model it starts from a small Llama-shaped model and an embedded preference set: a prompt naming a
standard-library docstring's first word, its docstring as the chosen answer and an evasive one as rejected.
The reference model is a frozen copy of the starting model, as in TRL.
"""

from __future__ import annotations

import copy

from common import corpus, finish, model_and_tokenizer, parse
from datasets import Dataset
from optimum_gaudi.trl import GaudiDPOConfig, GaudiDPOTrainer

from optimum_gaudi.errors import run_main


def preference_rows(texts: list[str]) -> list[dict[str, str]]:
    rows = []
    for i, text in enumerate(texts):
        words = text.split()
        if len(words) > 2:
            rows.append(
                {
                    "prompt": f"Describe {words[0]}",
                    "chosen": " " + " ".join(words[1:24]),
                    "rejected": " no idea" * (1 + i % 3),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    script, config = parse(GaudiDPOConfig, argv)
    model, tokenizer = model_and_tokenizer(script, config)
    data = Dataset.from_list(preference_rows(corpus(script, 1000)))
    reference = copy.deepcopy(model).eval()  # the frozen starting point (TRL would reload it from the model's path)
    trainer = GaudiDPOTrainer(model, reference, config, train_dataset=data, processing_class=tokenizer)
    finish(trainer)


if __name__ == "__main__":
    run_main(main)
