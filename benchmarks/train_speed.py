"""GaudiTrainer with the bundled gpt2 Gaudi config against plain transformers.Trainer, on this machine.

Three variants train the same GPT-2 from the same weights on the same blocks, interleaved and repeated:
  trainer_fp32   transformers.Trainer, default arguments (fp32, its default fused AdamW)
  trainer_bf16   transformers.Trainer with the best flags a user could pass by hand: --bf16 --optim adamw_torch_fused
  gaudi_gpt2     GaudiTrainer --gaudi_config_name gpt2 (op-list bf16 autocast, fused AdamW, fused clipping)
Reported: median tokens/s after warm-up, the ratio to each Trainer variant, and the eval loss reached.
Each run trains in a new process.
"""

from __future__ import annotations

import json
import tempfile

from transformers import Trainer, TrainingArguments

from benchmarks.common import (
    BLOCK_SIZE,
    StepClock,
    gpt2,
    in_new_process,
    lm_data,
    markdown_table,
    median,
    request_from_argv,
)
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

MODELS = {
    "demo (2x128)": dict(n_layer=2, n_embd=128, n_head=4),  # the model `make demo` trains
    "small (4x256)": dict(n_layer=4, n_embd=256, n_head=4),
    "larger (6x384)": dict(n_layer=6, n_embd=384, n_head=6),
}
VARIANTS = {
    "trainer_fp32": (Trainer, TrainingArguments, {}),
    "trainer_bf16": (Trainer, TrainingArguments, {"bf16": True, "optim": "adamw_torch_fused", "use_cpu": True}),
    "gaudi_gpt2": (GaudiTrainer, GaudiTrainingArguments, {"gaudi_config_name": "gpt2"}),
}


def run_once(variant: str, model_kwargs: dict, steps: int, warmup: int, batch: int) -> tuple[float, float]:
    """(tokens per second after warm-up, eval loss after `steps` steps), in this process."""
    trainer_cls, args_cls, extra = VARIANTS[variant]
    tokenizer, train, valid = lm_blocks(steps, batch)
    clock = StepClock(warmup)
    with tempfile.TemporaryDirectory() as out:
        args = args_cls(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch, per_device_eval_batch_size=32,
            learning_rate=1e-3, warmup_steps=5, seed=0, report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_pin_memory=False, **extra,
        )  # fmt: skip
        trainer = trainer_cls(
            model=gpt2(tokenizer, **model_kwargs), args=args, train_dataset=train, eval_dataset=valid, callbacks=[clock]
        )
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    return batch * BLOCK_SIZE / clock.seconds_per_step, eval_loss


def lm_blocks(steps: int, batch: int):
    return lm_data(train_blocks=steps * batch, eval_blocks=64)


def run(repeats: int = 3, steps: int = 30, warmup: int = 5, batch: int = 16, log=print) -> tuple[str, dict]:
    """Markdown tables, and per model the medians {variant: (tokens/s, eval loss)} for the target check."""
    sections, medians = [], {}
    for model_name, model_kwargs in MODELS.items():
        speeds = {v: [] for v in VARIANTS}
        losses = {v: [] for v in VARIANTS}
        for r in range(repeats):  # interleaved, so drift in machine speed hits every variant alike
            for variant in VARIANTS:
                request = [variant, model_kwargs, steps, warmup, batch]
                tps, loss = in_new_process("benchmarks.train_speed", request)
                speeds[variant].append(tps)
                losses[variant].append(loss)
                log(f"  {model_name} {variant} run {r + 1}: {tps:,.0f} tokens/s, eval loss {loss:.4f}")
        medians[model_name] = {v: (median(speeds[v]), median(losses[v])) for v in VARIANTS}
        base, tuned = median(speeds["trainer_fp32"]), median(speeds["trainer_bf16"])
        rows = []
        for variant in VARIANTS:
            tps = median(speeds[variant])
            rows.append(
                [variant, f"{tps:,.0f}", f"{tps / base:.2f}x", f"{tps / tuned:.2f}x", f"{median(losses[variant]):.4f}"]
            )
        table = markdown_table(
            ["variant", "tokens/s (median)", "vs trainer_fp32", "vs trainer_bf16", f"eval loss after {steps} steps"],
            rows,
        )
        sections.append(f"### GPT-2 {model_name}, batch {batch} x {BLOCK_SIZE} tokens, {repeats} runs each\n\n{table}")
        log(sections[-1])
    return "\n\n".join(sections), medians


if __name__ == "__main__":  # one in_new_process request: variant, model sizes, steps, warm-up, batch
    print(json.dumps(run_once(*request_from_argv())))
