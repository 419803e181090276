"""Train a tiny Llama with FSDP2 and sharded (DCP) checkpoints; several checks in one launch.

    train_sharded.py OUT_DIR MODE [GaudiTrainingArguments flags...]

MODE ``job``, under ``optimum-gaudi launch --max_restarts 2``: the first attempt trains OUT_DIR/whole without
checkpoints (the uninterrupted run), then OUT_DIR/run (the --output_dir flag), where every rank sends itself
SIGTERM when step 3 ends, as the launcher passes a scheduler's SIGTERM on: the trainer writes checkpoint-3 and
ends the processes with 143, and the agent restarts the job. The second attempt resumes on its own; rank 1 is
killed (SIGKILL) in its next save, once the model's shards are written and before its optimizer shard is. The
third attempt resumes again, from the newest complete checkpoint, and trains to the end.
MODE ``resume``: the run of --output_dir resumes (--resume_from_checkpoint), on whatever number of processes.
After the third attempt of ``job`` and after ``resume``, the same processes train OUT_DIR/poisoned for 4 steps
(saves every 2): when step 4 ends, the last rank writes a NaN into its own shard of one weight, so checkpoint-4
must not be written by any rank (the ranks agree) and checkpoint-2 stays.
MODE ``room=BYTES``: every file system has BYTES free; the script runs as the examples do (one line for a user
error, exit status 2).

Rank 0 writes OUT_DIR/<name>.json (logged losses, where it resumed from, the world size) and
OUT_DIR/<name>.safetensors (the full weights, gathered from the shards) for name = whole, resumed (MODE job)
or resized (MODE resume).
"""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import safetensors.torch  # noqa: E402
import tiny  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402
from optimum_gaudi.checkpoints import restart_count  # noqa: E402
from optimum_gaudi.errors import call_main  # noqa: E402


class SigtermAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class PublishedAtSave(TrainerCallback):
    """Whether each checkpoint was in place when its save returned: with --async_save only the last one is."""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def on_save(self, args, state, control, **kwargs):
        self.seen[state.global_step] = os.path.isdir(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))


def sigkill_rank_1_before_its_optimizer_shard() -> None:
    if os.environ.get("RANK") != "1":
        return
    write_data = dcp.FileSystemWriter.write_data

    def dying(self, plan, planner):
        if "optimizer_0" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(self, plan, planner)

    dcp.FileSystemWriter.write_data = dying


class NanInTheLastRanksShardAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step and args.process_index == args.world_size - 1:
            weight = model.get_parameter("model.layers.1.mlp.up_proj.weight")
            with torch.no_grad():
                (weight.to_local() if isinstance(weight, DTensor) else weight).view(-1)[0] = float("nan")


def poisoned(out: Path, argv: list[str]) -> None:
    flags = ["--output_dir", str(out / "poisoned"), "--max_steps", "4", "--save_total_limit", "1"]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses([*argv, *flags])
    trainer = GaudiTrainer(
        model=tiny.llama(), args=args, train_dataset=tiny.lm_data(), callbacks=[NanInTheLastRanksShardAt(4)]
    )
    trainer.train()


def train(out: Path, name: str, args: GaudiTrainingArguments, callbacks=()) -> None:
    published = PublishedAtSave()
    trainer = GaudiTrainer(
        model=tiny.llama(), args=args, train_dataset=tiny.lm_data(), callbacks=[published, *callbacks]
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    full = {  # every rank takes part in gathering the shards
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
        for n, p in trainer.model.named_parameters()
    }
    if trainer.is_world_process_zero():
        safetensors.torch.save_file(full, out / f"{name}.safetensors")
        result = {
            "losses": tiny.logged_losses(trainer),
            "resumed_from": trainer._checkpointing.resumed_from,
            "world": args.world_size,
            "published_at_save": published.seen,
        }
        (out / f"{name}.json").write_text(json.dumps(result))


def main() -> None:
    out, mode, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    if mode == "resume":
        train(out, "resized", args)
        poisoned(out, argv)  # train() is not asked to resume: --resume_from_checkpoint has no effect there
    elif mode.startswith("room="):
        free = int(mode.removeprefix("room="))
        shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free)
        code = call_main(lambda argv: train(out, "room", args))
        sys.stderr.flush()
        os._exit(code)
    elif restart_count() == 0:
        whole = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(
            [*argv, "--output_dir", str(out / "whole"), "--save_strategy", "no"]
        )[0]
        train(out, "whole", whole)
        train(out, "preempted", args, [SigtermAt(3)])  # ends the process with 143 once checkpoint-3 is published
    else:
        if restart_count() == 1:
            sigkill_rank_1_before_its_optimizer_shard()
        train(out, "resumed", args)
        if restart_count() == 2:
            poisoned(out, argv)
    tiny.leave_process()


if __name__ == "__main__":
    main()
