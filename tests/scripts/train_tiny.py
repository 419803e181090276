"""Train a tiny GPT-2 for a few steps and write rank 0's per-step losses to a JSON file.

Used by the distributed tests under torchrun: `train_tiny.py OUT.json [GaudiTrainingArguments flags...]`.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    trainer = GaudiTrainer(model=tiny.gpt2(**tiny.NO_DROPOUT), args=args, train_dataset=tiny.lm_data())
    losses = tiny.losses(trainer)
    if trainer.is_world_process_zero():
        with open(out, "w") as f:
            json.dump({"losses": losses, "world_size": args.world_size}, f)
    tiny.leave_process()


if __name__ == "__main__":
    main()
