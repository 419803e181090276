"""Train a tiny GPT-2 for a few steps and write rank 0's per-step losses to a JSON file.

Used by the distributed tests under torchrun:

    train_tiny.py OUT.json [--tiny_model llama] [--train_twice] [GaudiTrainingArguments flags...]

``--tiny_model llama`` trains tests/tiny.py's Llama instead of its GPT-2; ``--train_twice`` calls train() a second
time on the same trainer and writes that run's losses too.
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
    llama = "--tiny_model" in argv and argv.pop(argv.index("--tiny_model") + 1) == "llama"
    twice = "--train_twice" in argv
    argv = [a for a in argv if a not in ("--tiny_model", "--train_twice")]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    model = tiny.llama() if llama else tiny.gpt2(**tiny.NO_DROPOUT)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny.lm_data())
    result = {"losses": tiny.losses(trainer), "world_size": args.world_size}
    if twice:
        result["second_losses"] = tiny.losses(trainer)
    if trainer.is_world_process_zero():
        with open(out, "w") as f:
            json.dump(result, f)
    tiny.leave_process()


if __name__ == "__main__":
    main()
