"""Train a tiny GPT-2 several times in the same processes, with and without DeepSpeed, and write what happened.

Used by tests/integration/distributed/test_deepspeed.py under ``optimum-gaudi launch`` (torchrun or DeepSpeed's launcher):

    train_deepspeed.py OUT_DIR PLAN.json [GaudiTrainingArguments flags shared by every run...]

PLAN.json is a list of runs, each ``{"name": ..., "args": [...], "resume": "CHECKPOINT" (optional), "model": "llama"
(optional: a tiny Llama, else a tiny GPT-2)}``; run NAME
trains in OUT_DIR/NAME. One launch runs the whole plan: starting the processes and DeepSpeed's communication
costs more than training. Each rank writes OUT_DIR/NAME.rank{R}.json: the logged losses, and how DeepSpeed
holds the model on this rank (the ZeRO stage, the optimizer, how many fp32 master weights it keeps), so the
test can see that ZeRO really partitioned the model rather than ran as DDP.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments  # noqa: E402

SAVED_BY_RANK: list[str] = []  # the gaudi_config.json files this rank wrote


def spy_on_gaudi_config_saves() -> None:
    save = GaudiConfig.save_pretrained

    def recording_save(self, save_directory, *args, **kwargs):
        SAVED_BY_RANK.append(str(save_directory))
        return save(self, save_directory, *args, **kwargs)

    GaudiConfig.save_pretrained = recording_save


class CountSteps(TrainerCallback):
    """Optimizer steps taken in this process: a resumed run takes only the steps after its checkpoint."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def tiny_data() -> list[dict]:
    """64 arithmetic progressions mod 100: learnable, so the loss falls fast and differences show."""
    g = torch.Generator().manual_seed(0)
    start, stride = torch.randint(0, 100, (64, 1), generator=g), torch.randint(1, 4, (64, 1), generator=g)
    rows = ((start + stride * torch.arange(16)) % 100).tolist()
    return [{"input_ids": r, "labels": r} for r in rows]


def zero_facts(trainer: GaudiTrainer) -> dict:
    """How DeepSpeed holds the model on this rank; empty without DeepSpeed."""
    if not trainer.is_deepspeed_enabled:
        return {}
    engine = trainer.model_wrapped
    zero = engine.optimizer
    masters = getattr(zero, "single_partition_of_fp32_groups", None)  # ZeRO-1 and 2
    if masters is None:
        masters = getattr(zero, "fp32_partitioned_groups_flat", [])  # ZeRO-3
    params = list(engine.module.parameters())
    return {
        "stage": engine.zero_optimization_stage(),
        "zero_optimizer": type(zero).__name__,
        "optimizer": f"{type(zero.optimizer).__module__}.{type(zero.optimizer).__name__}",
        "optimizer_fused": bool(zero.optimizer.defaults.get("fused")),
        "offload": engine.zero_offload_optimizer() is not None,
        "master_numel": sum(t.numel() for t in masters),
        "model_numel": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "local_param_numel": sum(p.numel() for p in params),  # 0 under ZeRO-3 outside a forward pass
        "param_dtype": str(getattr(params[0], "ds_tensor", params[0]).dtype),
        "gradient_clipping": engine.gradient_clipping(),
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
    }


def main() -> None:
    out, plan, common = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), sys.argv[3:]
    torch.set_num_threads(1)
    spy_on_gaudi_config_saves()
    for run in plan:
        name = run["name"]
        argv = ["--output_dir", str(out / name), *common, *run.get("args", [])]
        (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
        model = tiny.llama() if run.get("model") == "llama" else tiny.gpt2(**tiny.NO_DROPOUT)
        trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny_data())
        counter = CountSteps()
        trainer.add_callback(counter)
        SAVED_BY_RANK.clear()
        began = time.perf_counter()
        trainer.train(resume_from_checkpoint=run.get("resume"))
        record = {
            "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "grad_norms": {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h},
            "steps_run": counter.steps,
            "world_size": args.world_size,
            "deepspeed": zero_facts(trainer),
            "gaudi_config_saved_to": list(SAVED_BY_RANK),
            "seconds": time.perf_counter() - began,
            "device": str(next(trainer.model.parameters()).device.type),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        }
        (out / f"{name}.rank{args.process_index}.json").write_text(json.dumps(record))
        del trainer
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # as in train_tiny.py: the results are written, leave before a rank can hang in interpreter exit (the simulated
    # bridge's call log, written at exit otherwise, first)
    simulator = sys.modules.get("habana_frameworks")
    if simulator is not None and hasattr(simulator, "write_call_log"):
        simulator.write_call_log()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
