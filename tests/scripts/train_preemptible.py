"""Train a tiny GPT-2 that a test stops with SIGTERM; writes what it did for the test to check.

    train_preemptible.py OUT_DIR [GaudiTrainingArguments flags...]

At interpreter exit its teardown takes a minute (a stand-in for freeing a big model's objects), and an exit
handler writes OUT_DIR/exit_handlers_ran.rankN (as integrations flush their logs in theirs).

When training begins, rank 0 writes OUT_DIR/started and each rank OUT_DIR/pid.rankN. Under several processes
each rank writes OUT_DIR/host_collectives.rankN when training ends: the collectives on the host group from the end
of the run's first step on (SIGTERM's agreement must cost none). The SIGTERM handler GaudiTrainer installs is wrapped to
note the steps finished when the signal came (written to OUT_DIR/signal_step when training ends on it: GaudiTrainer
then ends the process itself). A run that ends without a signal writes OUT_DIR/result.json from rank 0: its logged
losses, and OUT_DIR/weights.safetensors.
"""

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import safetensors.torch  # noqa: E402
import tiny  # noqa: E402
import torch  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402


class Watch(TrainerCallback):
    """Says when training began, and wraps the trainer's SIGTERM handler to note the step the signal hit."""

    def __init__(self, out: Path) -> None:
        self.out, self.state, self.signal_step, self.host_collectives = out, None, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = state
        handler = signal.getsignal(signal.SIGTERM)

        def noting(signum, frame):
            if self.signal_step is None:
                self.signal_step = self.state.global_step  # steps finished when the signal came
            handler(signum, frame)

        signal.signal(signal.SIGTERM, noting)
        (self.out / f"pid.rank{args.process_index}").write_text(str(os.getpid()))
        if args.process_index == 0:
            (self.out / "started").write_text(str(os.getpid()))

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.01)  # a step of the tiny model takes ~5 ms: slow enough that a signal can land anywhere
        if self.host_collectives is None and args.world_size > 1:  # the run's first step (resumed or not)
            self.host_collectives = args.parallel_layout.host_group()._get_sequence_number_for_group()

    def on_train_end(self, args, state, control, **kwargs):
        if args.world_size > 1:
            done = args.parallel_layout.host_group()._get_sequence_number_for_group() - self.host_collectives
            (self.out / f"host_collectives.rank{args.process_index}").write_text(str(done))
        if self.signal_step is not None:
            (self.out / f"signal_step.rank{args.process_index}").write_text(str(self.signal_step))
            if args.process_index == 0:
                (self.out / "signal_step").write_text(str(self.signal_step))


class SlowTeardown:
    """Freed when the interpreter tears down its modules, as a big model's objects are: a minute of it."""

    def __del__(self, sleep=time.sleep) -> None:  # bound now: at teardown the module's globals are gone
        sleep(60)


TEARDOWN = SlowTeardown()


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: (out / f"exit_handlers_ran.rank{rank}").write_text("yes"))
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    watch = Watch(out)
    trainer = GaudiTrainer(model=tiny.gpt2(**tiny.NO_DROPOUT), args=args, train_dataset=tiny.lm_data(256))
    trainer.add_callback(watch)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # preempted: the process ends in there
    if trainer.is_world_process_zero():
        model = trainer.accelerator.unwrap_model(trainer.model)
        weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        safetensors.torch.save_file(weights, out / "weights.safetensors")
        (out / "result.json").write_text(json.dumps({"losses": tiny.logged_losses(trainer)}))
    tiny.leave_process()


if __name__ == "__main__":
    main()
