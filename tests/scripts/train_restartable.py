"""Train a tiny GPT-2 with DDP; in the job's first attempt one rank dies (SIGKILL) when a step ends.

    train_restartable.py OUT_DIR DIE_AT_STEP [GaudiTrainingArguments flags...]

Run under ``optimum-gaudi launch --max_restarts N``: the first attempt (TORCHELASTIC_RESTART_COUNT 0) loses
rank 1 at the end of step DIE_AT_STEP (0: never); the restarted job resumes on its own, because GaudiTrainer
picks the newest complete checkpoint in a restarted job. Rank 0 writes OUT_DIR/result-<restart>.json: the
step it reached, where it resumed from and its logged losses, and OUT_DIR/weights-<restart>.safetensors.
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import safetensors.torch  # noqa: E402
import tiny  # noqa: E402
import torch  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402


class DieAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, die_at, argv = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    trainer = GaudiTrainer(model=tiny.gpt2(**tiny.NO_DROPOUT), args=args, train_dataset=tiny.lm_data())
    if restart == 0 and die_at:
        trainer.add_callback(DieAt(die_at))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.is_world_process_zero():
        model = trainer.accelerator.unwrap_model(trainer.model)
        weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        safetensors.torch.save_file(weights, out / f"weights-{restart}.safetensors")
        result = {
            "resumed_from": trainer._checkpointing.resumed_from,
            "global_step": trainer.state.global_step,
            "losses": tiny.logged_losses(trainer),
        }
        (out / f"result-{restart}.json").write_text(json.dumps(result))
    tiny.leave_process()


if __name__ == "__main__":
    main()
