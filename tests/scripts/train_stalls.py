"""Train a tiny GPT-2 with DDP where, in each attempt of the job, rank 1 stalls in another way (issue 38, point 2).

    train_stalls.py OUT_DIR STALL_STEP [GaudiTrainingArguments flags...]

Run under ``optimum-gaudi launch --max_restarts 2`` with a short ``--hang_timeout``. When step STALL_STEP +
4 x restart ends (neither a save step nor the first step after resuming, which never count), rank 1:
- attempt 0: stops itself (SIGSTOP), as a stuck card or a host under swap would;
- attempt 1: spins in an endless Python loop;
- attempt 2: waits in an all-reduce rank 0 never joins (a collective that never completes).
Each attempt writes OUT_DIR/attempt-<restart>.json from rank 0 when training starts (where it resumed from);
a run that finishes writes OUT_DIR/done.json.
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402


def endless_loop() -> None:
    x = 0
    while True:
        x += 1


class Stall(TrainerCallback):
    def __init__(self, out: Path, step: int, restart: int) -> None:
        self.out, self.step, self.restart = out, step, restart
        self.never_joined = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.never_joined = dist.new_group(backend="gloo")  # torch's default timeout: 30 minutes
        if args.process_index == 0:
            resumed = kwargs.get("model") is not None and state.global_step
            (self.out / f"attempt-{self.restart}.json").write_text(json.dumps({"resumed_at": resumed}))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or args.process_index != 1:
            return
        if self.restart == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.restart == 1:
            endless_loop()
        else:
            dist.all_reduce(torch.ones(1), group=self.never_joined)


def main() -> None:
    out, stall_step, argv = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    trainer = GaudiTrainer(model=tiny.gpt2(**tiny.NO_DROPOUT), args=args, train_dataset=tiny.lm_data())
    trainer.add_callback(Stall(out, stall_step + 4 * restart, restart))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.is_world_process_zero():
        (out / "done.json").write_text(json.dumps({"global_step": trainer.state.global_step}))
    tiny.leave_process()


if __name__ == "__main__":
    main()
