"""Train a tiny GPT-2 with DDP where the last rank is slow and, at some steps, its loss is NaN or spikes (issue 38,
points 3, 4).

    train_stragglers.py OUT_DIR NAN_STEPS SPIKE_STEPS [GaudiTrainingArguments flags...]

The last rank's forward takes 200 ms longer (a slow card or host); at the steps in NAN_STEPS its loss is NaN, at those
in SPIKE_STEPS 1000 times what it is (both comma-separated). Each rank writes OUT_DIR/optimizer_steps.rankN at step
12: how many steps its AdamW took.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402
from optimum_gaudi.errors import call_main  # noqa: E402


class BadLossOnTheLastRank:
    def __init__(self, nan: set[int], spikes: set[int]) -> None:
        self.nan, self.spikes, self.trainer = nan, spikes, None

    def __call__(self, outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"][:, :-1].reshape(-1, outputs["logits"].shape[-1])
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        state, args = self.trainer.state, self.trainer.args
        if args.process_index != args.world_size - 1:
            return loss
        step = state.global_step + 1
        return loss * float("nan") if step in self.nan else loss * 1000 if step in self.spikes else loss


class OptimizerSteps(TrainerCallback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == 12:
            steps = {int(s["step"]) for s in optimizer.optimizer.state.values()}
            (self.out / f"optimizer_steps.rank{args.process_index}").write_text(str(steps.pop()))


def main(argv) -> None:
    out, argv = Path(sys.argv[1]), sys.argv[4:]
    nan_steps, spike_steps = ({int(s) for s in steps.split(",") if s} for steps in sys.argv[2:4])
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    model = tiny.gpt2(**tiny.NO_DROPOUT)
    if args.process_index == args.world_size - 1:
        model.register_forward_pre_hook(lambda module, inputs: time.sleep(0.2))
    nan = BadLossOnTheLastRank(nan_steps, spike_steps)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny.lm_data(), compute_loss_func=nan)
    nan.trainer = trainer
    trainer.add_callback(OptimizerSteps(out))
    trainer.train()


if __name__ == "__main__":
    code = call_main(main, [])
    sys.stderr.flush()
    os._exit(code)
