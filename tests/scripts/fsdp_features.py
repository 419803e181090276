"""FSDP with the Gaudi features: several short trainings in one launch, rank 0's results to a JSON file.

`fsdp_features.py OUT.json MODE [CASE...]`, MODE one of fsdp / ddp / single: the same cases, the same global batch
(8 rows a step), sharded, replicated or in one process, so a test compares the three launches case by case.
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
        **sharding, **overrides,
    })  # fmt: skip
    AcceleratorState._reset_state()  # each case its own accelerator state (FSDP's plugin is kept in it)
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


def main() -> None:
    out, mode, names = sys.argv[1], sys.argv[2], sys.argv[3:] or list(CASES)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    results = {name: run_case(name, mode, os.path.dirname(out)) for name in names}
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # FSDP over gloo sometimes never finishes interpreter exit (see train_tiny.py)


if __name__ == "__main__":
    main()
