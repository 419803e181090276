"""Train a tiny GPT-2 with DDP where, in step STALL_STEP's forward, the last rank issues a collective the others
never join (issue 46, point 4): every rank is then in the same step, and only the number of collectives each
issued tells the rank stuck from the ranks waiting for it.

    train_missed_collective.py STALL_STEP [GaudiTrainingArguments flags...]

The collective is an all-reduce on a group of every rank made with the run's backend (hccl on simulated Gaudis,
gloo on the CPU), called from ``MissedCollective.hook`` below.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402


class MissedCollective(TrainerCallback):
    def __init__(self, stall_step: int, last: bool, device: torch.device) -> None:
        self.stall_step, self.last, self.device = stall_step, last, device
        self.step, self.never_joined = 0, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.never_joined = dist.new_group()  # the default backend: hccl on simulated Gaudis

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def hook(self, module, inputs):
        if self.last and self.step == self.stall_step:
            dist.all_reduce(torch.ones(1, device=self.device), group=self.never_joined)


def main() -> None:
    stall_step = int(sys.argv[1])
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(sys.argv[2:])
    torch.set_num_threads(1)
    model = tiny.gpt2(**tiny.NO_DROPOUT)
    missed = MissedCollective(stall_step, args.process_index == args.world_size - 1, args.device)
    model.register_forward_pre_hook(missed.hook)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny.lm_data())
    trainer.add_callback(missed)
    trainer.train()
    tiny.leave_process()


if __name__ == "__main__":
    main()
