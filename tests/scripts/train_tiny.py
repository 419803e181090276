"""Train a tiny GPT-2 for a few steps and write rank 0's per-step losses to a JSON file.

Used by the distributed tests under torchrun: `train_tiny.py OUT.json [GaudiTrainingArguments flags...]`.
"""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_layer=1, n_embd=32, n_head=2, n_positions=16)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 100, (16,), generator=g).tolist() for _ in range(64)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    trainer = GaudiTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(out, "w") as f:
            json.dump({"losses": losses, "world_size": args.world_size}, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Seen here: after everything above returned, a rank sometimes never finished interpreter exit (FSDP over
    # gloo on CPU, both threads idle), which keeps torchrun waiting. The results are written: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
