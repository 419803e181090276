#!/usr/bin/env python
"""Direct preference optimization with TRL's DPOTrainer made a Gaudi trainer (``GaudiDPOTrainer``).

    python examples/trl/dpo.py --output_dir /tmp/dpo --max_steps 20 --use_habana --gaudi_config_name llama --bf16 true

With no model it starts from a small Llama-shaped model and an embedded preference set: a prompt naming a
standard-library docstring's first word, its docstring as the chosen answer and an evasive one as rejected.
The reference model is a frozen copy of the starting model, as in TRL; with LoRA adapters (``--use_peft``,
``--lora_*``, as optimum-habana's dpo.py) it is the model with its adapters turned off. ``--dataset_name``
reads prompt/chosen/rejected columns, or Stack Exchange's question/response_j/response_k;
``--tokenizer_name_or_path`` and ``--max_prompt_length`` (TRL < 1's option) are optimum-habana's.
"""

from __future__ import annotations

import copy
from typing import Any

from common import (
    corpus,
    finish,
    model_and_tokenizer,
    named_dataset,
    parse,
    with_columns,
)
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


def stack_exchange_pair(row: dict[str, Any]) -> dict[str, str]:
    """A Stack Exchange pair as optimum-habana's dpo.py writes lvwerra/stack-exchange-paired."""
    return {
        "prompt": f"Question: {row['question']}\n\nAnswer: ",
        "chosen": row["response_j"],
        "rejected": row["response_k"],
    }


def main(argv: list[str] | None = None) -> None:
    script, config = parse(GaudiDPOConfig, argv)
    model, tokenizer = model_and_tokenizer(script, config)
    rows = named_dataset(script)
    if rows is None:
        rows = Dataset.from_list(preference_rows(corpus(script, 1000)))
    else:
        columns = {
            ("prompt", "chosen", "rejected"): None,
            ("question", "response_j", "response_k"): stack_exchange_pair,
        }
        rows = with_columns(rows, script, "DPO", columns)
    peft_config = script.peft_config()
    # the frozen starting point (TRL would reload it from the model's path); with adapters, the adapters turned off
    reference = None if peft_config is not None else copy.deepcopy(model).eval()
    trainer = GaudiDPOTrainer(
        model, reference, config, train_dataset=rows, processing_class=tokenizer, peft_config=peft_config
    )
    finish(trainer)


if __name__ == "__main__":
    run_main(main)
