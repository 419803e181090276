"""FSDP with the Gaudi features: several short trainings in one launch, each rank's results to OUT.json.RANK.

`fsdp_features.py OUT.json MODES [CASE...]`, MODES a comma-separated list of fsdp / ddp / single: each case in
each mode, at the same global batch (8 rows a step), so a test compares sharded, replicated and one-process runs
case by case. MODES `resume` instead trains a Llama with FSDP and the Gaudi features on whatever device the run
has (the simulated Gaudi in the tests), saving sharded checkpoints, then resumes from the first one; then the same
under DDP, and an fp8 (Transformer Engine) training under DDP saved and resumed; started without torchrun, the same
training on one process.
"""

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments  # noqa: E402

GLOBAL_BATCH = 8
# optimum-habana's examples/language-modeling/fsdp_config.json, as its users pass it (FSDP1 keys, Gaudi class names)
HABANA_FSDP_CONFIG = str(Path(__file__).resolve().parent.parent / "data" / "optimum_habana_fsdp_config.json")


def lora_llama():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny.llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


# case -> (model factory, Gaudi config, training arguments); the Llama cases shard with optimum-habana's file
CASES = {
    # fused AdamW, clipping that bites (max_grad_norm well under the norm), two micro-batches a step
    "fused": (tiny.llama, {"use_fused_adam": True, "use_fused_clip_norm": True},
              {"max_grad_norm": 0.05, "gradient_accumulation_steps": 2}),
    "autocast": (tiny.llama, {"use_torch_autocast": True}, {"bf16": True}),  # Habana's default op lists
    "lora": (lora_llama, {"use_fused_adam": True}, {"learning_rate": 1e-2}),
    "compile": (tiny.llama, {}, {"torch_compile_backend": "aot_eager", "use_regional_compilation": True}),
    "fp8": (tiny.llama, {}, {"fp8": True, "bf16": True}),
    "gpt2": (lambda: tiny.gpt2(**tiny.NO_DROPOUT), {}, {}),
}  # fmt: skip


def fresh_state() -> None:
    """Each training its own accelerator state (FSDP's plugin is kept there). The ACCELERATE_USE_FSDP an earlier
    FSDP run made accelerate export stays, as in a user's session: the trainer itself must not inherit it."""
    AcceleratorState._reset_state()


def run_case(name: str, mode: str, out_dir: str) -> dict:
    factory, config, overrides = CASES[name]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = overrides.get("gradient_accumulation_steps", 1)
    sharding = {}
    if mode == "fsdp":
        sharding = (
            {"fsdp": "full_shard"} if name == "gpt2" else {"fsdp": "auto_wrap", "fsdp_config": HABANA_FSDP_CONFIG}
        )
    args = GaudiTrainingArguments(**{
        "output_dir": os.path.join(out_dir, name), "max_steps": 4, "logging_steps": 1, "report_to": "none",
        "save_strategy": "no", "train_sampling_strategy": "sequential", "learning_rate": 1e-3, "seed": 0,
        "disable_tqdm": True, "per_device_train_batch_size": GLOBAL_BATCH // world // accumulation,
        "log_throughput_and_memory": True, **sharding, **overrides,
    })  # fmt: skip
    fresh_state()
    trainer = GaudiTrainer(model=factory(), args=args, train_dataset=tiny.lm_data(), gaudi_config=GaudiConfig(**config))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    optimizer = trainer.optimizer.optimizer
    plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    policy = getattr(plugin, "mixed_precision_policy", None)
    return {
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h["grad_norm"] for h in logs],
        "optimizer": f"{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})",
        "sharded_modules": sorted({type(m).__name__ for m in trainer.model_wrapped.modules() if isinstance(m, FSDPModule)}),
        "param_dtype": str(policy.param_dtype) if policy is not None else None,
        "memory": {k: v for k, v in logs[-1].items() if "memory" in k},
    }  # fmt: skip


class StepsRun(TrainerCallback):
    """The steps this run trained (a resumed run: only those after its checkpoint)."""

    def __init__(self) -> None:
        self.run: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.run.append(state.global_step)


def final_model(trainer: GaudiTrainer, folder: str) -> dict:
    """``save_model`` after the run, then the folder loaded by plain transformers (on rank 0) against the trained
    weights (each rank's rows through a file: the simulator has no functional collectives, as ``full_tensor``'s):
    its files and whether every tensor is equal."""
    from transformers import AutoModelForCausalLM

    trainer.save_model(folder)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    torch.save({k: v.to_local().detach().cpu() for k, v in state.items()}, f"{folder}.rows.{rank}")
    torch.distributed.barrier()
    files = sorted(os.listdir(folder))
    if rank != 0:
        return {"files": files}
    rows = [torch.load(f"{folder}.rows.{r}") for r in range(world)]
    trained = {k: torch.cat([part[k] for part in rows]) for k in state}  # FSDP2 shards dim 0 as torch.chunk
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    equal = sorted(loaded) == sorted(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained)
    return {"files": files, "equal": equal}


def counting_hook(model) -> bool | None:
    """Whether a DDP module carries the collective count's hook (installed where the backend numbers no collectives,
    as the simulated hccl: supervision/collective_count.py); None for a model DDP did not wrap."""
    from optimum_gaudi.supervision.collective_count import _count_and_reduce

    hooks = getattr(model, "_comm_hooks", None)
    return None if hooks is None else any(hook is _count_and_reduce for hook, _ in hooks)


def resume(out_dir: str) -> dict:
    """4 steps saving SHARDED_STATE_DICT checkpoints every 2, then the last 2 again from checkpoint-2; then the same
    4 steps under DDP, whose gradients FSDP's must equal (each rank's batch, averaged over the ranks). The loss is
    the fused linear cross-entropy's (the head gathered for it under FSDP). On one process (WORLD_SIZE unset) only
    the same training on the one device, its whole batch of 8 rows a step at once ("one")."""
    with open(HABANA_FSDP_CONFIG, encoding="utf-8") as f:
        fsdp_config = {**json.load(f), "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    config = GaudiConfig(use_fused_adam=True, use_fused_clip_norm=True, use_torch_autocast=True,
                         use_fused_linear_cross_entropy=True)  # fmt: skip
    runs = {}
    checkpoint_2 = os.path.join(out_dir, "whole", "checkpoint-2")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = (("whole", None), ("resumed", checkpoint_2), ("ddp", None)) if world > 1 else (("one", None),)
    for name, checkpoint in plan:
        sharding = {} if name in ("ddp", "one") else {"fsdp": "auto_wrap", "fsdp_config": fsdp_config}
        args = GaudiTrainingArguments(
            output_dir=os.path.join(out_dir, name), max_steps=4, logging_steps=1, save_steps=2, report_to="none",
            train_sampling_strategy="sequential", learning_rate=1e-3, seed=0, disable_tqdm=True, use_habana=True,
            per_device_train_batch_size=GLOBAL_BATCH // world, bf16=True,
            save_strategy="steps" if sharding else "no", **sharding,
        )  # fmt: skip
        fresh_state()
        trainer = GaudiTrainer(model=tiny.llama(), args=args, train_dataset=tiny.lm_data(), gaudi_config=config)
        steps = StepsRun()
        trainer.add_callback(steps)
        trainer.train(resume_from_checkpoint=checkpoint)
        if name == "whole":
            runs["final"] = final_model(trainer, os.path.join(out_dir, "final"))
        simulator = sys.modules.get("habana_frameworks")  # what the simulated bridge saw under FSDP
        if name == "resumed" and simulator is not None:
            runs["bridge_calls"] = sorted({n for n in simulator.names() if n.startswith(("distributed.", "hpex."))})
        logs = [h for h in trainer.state.log_history if "loss" in h]
        runs[name] = {
            "steps_run": steps.run,
            "losses": [h["loss"] for h in logs],
            "grad_norms": [h["grad_norm"] for h in logs],
            "optimizer": type(trainer.optimizer.optimizer).__name__,
            "device": str(next(trainer.model.parameters()).device),
            "sharded": trainer.is_fsdp_enabled,
            "counting_hook": counting_hook(trainer.model_wrapped),
            "memory": {k: v for k, v in logs[-1].items() if "memory" in k},
        }
    saved = Path(out_dir, "whole", "checkpoint-2")
    if saved.is_dir():
        runs["checkpoint"] = sorted(str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file())
    return runs


def amax_histories(model) -> dict[str, list]:
    """This rank's Transformer Engine amax histories (and step counts), by module."""
    return {
        name: {key: [meta.steps, meta.amax_history[: meta.steps].tolist()] for key, meta in module.fp8_meta.items()
               if key != "recipe"}
        for name, module in model.named_modules() if hasattr(module, "fp8_meta")
    }  # fmt: skip


def fp8_per_rank(out_dir: str) -> dict:
    """--fp8 (the Transformer Engine, optimum-habana's recipe: each card its own amax history) under DDP: 4 steps
    with a checkpoint at 2, then steps 3 and 4 again from it; each rank's losses, amax histories and saved files."""
    runs = {}
    checkpoint_2 = os.path.join(out_dir, "fp8_whole", "checkpoint-2")
    for name, checkpoint in (("fp8_whole", None), ("fp8_resumed", checkpoint_2)):
        args = GaudiTrainingArguments(
            output_dir=os.path.join(out_dir, name), max_steps=4, logging_steps=1, save_steps=2, report_to="none",
            train_sampling_strategy="sequential", learning_rate=3e-3, seed=0, disable_tqdm=True, use_habana=True,
            per_device_train_batch_size=4, bf16=True, fp8=True,
        )  # fmt: skip
        fresh_state()
        trainer = GaudiTrainer(model=tiny.llama(), args=args, train_dataset=tiny.lm_data())
        trainer.train(resume_from_checkpoint=checkpoint)
        runs[name] = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "amax": amax_histories(trainer.accelerator.unwrap_model(trainer.model)),
        }
    runs["checkpoint"] = sorted(os.listdir(checkpoint_2))
    return runs


def main() -> None:
    out, modes, names = sys.argv[1], sys.argv[2].split(","), sys.argv[3:] or list(CASES)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if modes == ["resume"]:
        results = resume(os.path.dirname(out))
        if "WORLD_SIZE" in os.environ:  # not on the one-process reference
            results["fp8"] = fp8_per_rank(os.path.dirname(out))
    else:
        results = {mode: {name: run_case(name, mode, os.path.join(os.path.dirname(out), mode)) for name in names}
                   for mode in modes}  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    tiny.leave_process()


if __name__ == "__main__":
    main()
