"""Train a tiny GPT-2 with DDP on simulated Gaudis where rank 1's forward takes long in two steps (issue 46, point 3).

    train_compiles.py OUT_DIR SLOW_STEP SECONDS STALL_STEP [GaudiTrainingArguments flags...]

In step SLOW_STEP rank 1's forward sleeps SECONDS (standing in for a graph compile, which a Gaudi runs for minutes
at a later step's sync); in step STALL_STEP it spins for ever (a real stall). Rank 0 writes OUT_DIR/steps.json
with the time each step ended, so a test can tell which step the watchdog fired in and after how long.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402


class SlowForward(TrainerCallback):
    def __init__(self, out: Path, slow_step: int, seconds: float, stall_step: int) -> None:
        self.out, self.slow_step, self.seconds, self.stall_step = out, slow_step, seconds, stall_step
        self.step, self.ended = 0, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == 0:
            self.ended[state.global_step] = time.time()
            (self.out / "steps.json").write_text(json.dumps(self.ended))

    def forward_hook(self, rank: int):
        def hook(module, inputs):
            if rank != 1:
                return
            if self.step == self.slow_step:
                time.sleep(self.seconds)
            elif self.step == self.stall_step:
                while True:
                    time.sleep(0.01)

        return hook


def main() -> None:
    out, slow_step, seconds, stall_step = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(sys.argv[5:])
    torch.set_num_threads(1)
    model = tiny.gpt2(**tiny.NO_DROPOUT)
    slow = SlowForward(out, slow_step, seconds, stall_step)
    model.register_forward_pre_hook(slow.forward_hook(args.process_index))
    trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny.lm_data())
    trainer.add_callback(slow)
    trainer.train()
    tiny.leave_process()


if __name__ == "__main__":
    main()
