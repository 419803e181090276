"""A Llama-shaped model: GaudiTrainer with the bundled llama Gaudi config against a hand-tuned Trainer.

A LlamaForCausalLM with random weights (nothing downloaded) at SmolLM-135M's widths but 12 layers: hidden
576, intermediate 1536, 9 query heads over 3 key/value heads, vocabulary 49152, tied embeddings; sequence
256, batch 4, bf16. Every variant trains the same weights on the same blocks of the embedded corpus,
interleaved and repeated, each run in a new process:
  trainer_bf16          transformers.Trainer --bf16 --optim adamw_torch_fused (a hand-tuned eager run)
  trainer_bf16_compile  the same + --torch_compile
  gaudi_llama           GaudiTrainer --use_habana --gaudi_config_name llama --attn_implementation
                        gaudi_fused_sdpa, as a user's Gaudi script passes them (it falls back to this CPU)
  gaudi_llama_compile   the same + --torch_compile (COMPILE_EXTRA says how)
Reported: median steps/s and tokens/s after warm-up, the ratios to the hand-tuned runs, the share of this
CPU's bf16 matmul peak (measured in the same run, before and after), and the training loss of the last step.
run(tiny=True) trains a 2-layer Llama of 0.4M parameters on 64-token blocks: a smoke run of this code
(BENCH_QUICK=1), not a measurement.
"""

from __future__ import annotations

import json
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from benchmarks.common import StepClock, in_new_process, markdown_table, median, request_from_argv
from benchmarks.compile_speed import bf16_matmul_peak
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

BATCH = 4
SHAPE = dict(
    num_hidden_layers=12, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
    num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5,
)  # fmt: skip
SEQUENCE, TOKENIZER_VOCAB = 256, 8192  # the corpus's tokenizer uses the first 8192 of the 49152 ids
TINY_SHAPE = {**SHAPE, "num_hidden_layers": 2, "vocab_size": 4096, "hidden_size": 72, "intermediate_size": 192}
TINY_SEQUENCE, TINY_TOKENIZER_VOCAB = 64, 4096
TUNED = {"bf16": True, "optim": "adamw_torch_fused", "use_cpu": True}
GAUDI = {"use_habana": True, "gaudi_config_name": "llama", "attn_implementation": "gaudi_fused_sdpa", "bf16": True}
# Whole-model compile, as the hand-tuned run has: only the steady speed counts here, and regional compilation
# (--use_regional_compilation) compiles faster but ran 0.95-0.97x as fast on GPT-2 (docs/benchmarks.md).
COMPILE_EXTRA = {"torch_compile": True}
VARIANTS = {
    "trainer_bf16": (Trainer, TrainingArguments, TUNED),
    "trainer_bf16_compile": (Trainer, TrainingArguments, {**TUNED, "torch_compile": True}),
    "gaudi_llama": (GaudiTrainer, GaudiTrainingArguments, GAUDI),
    "gaudi_llama_compile": (GaudiTrainer, GaudiTrainingArguments, {**GAUDI, **COMPILE_EXTRA}),
}


def llama(shape: dict, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**shape))


def parameters(shape: dict) -> int:
    """Distinct parameters (the tied output projection counted once)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    return sum(p.numel() for p in model.parameters())


def step_flops(shape: dict, sequence: int, batch: int = BATCH) -> float:
    """6 * N * tokens + 12 * layers * sequence * hidden * tokens: N = the parameters that take part in
    matmuls (the blocks' projections and the tied output projection; not the norms); the second term is
    QK^T and AV (forward 2 matmuls of 2 * sequence * hidden FLOPs per token each, backward twice that), the
    full square counted, as in the PaLM paper's estimate."""
    layers, h, i = shape["num_hidden_layers"], shape["hidden_size"], shape["intermediate_size"]
    kv_width = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    block = h * h * 2 + h * kv_width * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    n = layers * block + shape["vocab_size"] * h
    tokens = batch * sequence
    return 6 * n * tokens + 12 * layers * sequence * h * tokens


class LastLoss(TrainerCallback):
    """The training loss the Trainer logged last (logging every step: the last step's loss)."""

    def __init__(self) -> None:
        self.loss: float | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.loss = logs["loss"]


def blocks(count: int, sequence: int, tokenizer_vocab: int):
    from optimum_gaudi.data.corpus import default_datasets, default_tokenizer, tokenize_and_group  # see lm_data

    tokenizer = default_tokenizer(tokenizer_vocab)
    return tokenize_and_group(default_datasets(), tokenizer, sequence)["train"].select(range(count))


def run_once(
    variant: str, shape: dict, sequence: int, tokenizer_vocab: int, steps: int, warmup: int
) -> tuple[float, float]:
    """(steady steps/s, training loss of the last step) of one training run in this process."""
    trainer_cls, args_cls, extra = VARIANTS[variant]
    train = blocks(steps * BATCH, sequence, tokenizer_vocab)
    clock, last = StepClock(warmup), LastLoss()
    with tempfile.TemporaryDirectory() as out:
        args = args_cls(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-3,
            warmup_steps=3, seed=0, report_to=[], save_strategy="no", logging_strategy="steps", logging_steps=1,
            disable_tqdm=True, dataloader_pin_memory=False, **extra,
        )  # fmt: skip
        trainer = trainer_cls(model=llama(shape), args=args, train_dataset=train, callbacks=[clock, last])
        trainer.train()
    return 1 / clock.seconds_per_step, last.loss


def run(repeats: int = 2, steps: int = 12, warmup: int = 3, tiny: bool = False, log=print) -> tuple[str, dict]:
    """A markdown section and the medians {variant: (steps/s, last loss)}, "peak" (FLOP/s), "flops" (a step)."""
    shape, sequence, vocab = (
        (TINY_SHAPE, TINY_SEQUENCE, TINY_TOKENIZER_VOCAB) if tiny else (SHAPE, SEQUENCE, TOKENIZER_VOCAB)
    )
    peaks = [bf16_matmul_peak()]
    results = {v: [] for v in VARIANTS}
    for r in range(repeats):  # interleaved, so drift in machine speed hits every variant alike
        for variant in VARIANTS:
            sps, loss = in_new_process("benchmarks.llama_speed", [variant, shape, sequence, vocab, steps, warmup])
            results[variant].append((sps, loss))
            log(f"  llama {variant} run {r + 1}: {sps:.3f} steps/s, last loss {loss:.4f}")
    peaks.append(bf16_matmul_peak())
    peak = median(peaks)
    medians = {v: (median([x[0] for x in rs]), median([x[1] for x in rs])) for v, rs in results.items()}

    flops, tokens = step_flops(shape, sequence), BATCH * sequence
    tuned, tuned_compile = medians["trainer_bf16"][0], medians["trainer_bf16_compile"][0]
    rows = [
        [variant, f"{sps:.3f}", f"{sps * tokens:,.0f}", f"{sps / tuned:.2f}x", f"{sps / tuned_compile:.2f}x",
         f"{100 * sps * flops / peak:.0f}%", f"{loss:.4f}"]
        for variant, (sps, loss) in medians.items()
    ]  # fmt: skip
    table = markdown_table(
        ["variant", "steps/s (median)", "tokens/s", "vs trainer_bf16", "vs trainer_bf16_compile",
         "share of bf16 peak", f"train loss at step {steps}"],
        rows,
    )  # fmt: skip
    text = (
        f"LlamaForCausalLM, random weights, SmolLM-135M widths with {shape['num_hidden_layers']} layers: hidden "
        f"{shape['hidden_size']}, intermediate {shape['intermediate_size']}, {shape['num_attention_heads']} "
        f"query heads over {shape['num_key_value_heads']} key/value heads, vocabulary {shape['vocab_size']}, tied "
        f"embeddings: {parameters(shape) / 1e6:.1f}M parameters. Sequence {sequence}, batch {BATCH} "
        f"({tokens} tokens a step), bf16, blocks of the embedded corpus (its tokenizer uses the first "
        f"{vocab} ids). {flops / 1e9:.0f} GFLOP a step = 6 x parameters in matmuls x tokens + "
        f"attention's 12 x layers x sequence x hidden x tokens. This CPU's measured bf16 matmul peak in this "
        f"run: {peak / 1e9:.0f} GFLOP/s (torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}; "
        f"bf16 matmuls run natively only with AVX512-BF16 or AMX). {repeats} runs each, {warmup} warm-up steps (compilation) left out, "
        f"{steps - warmup} steps timed. gaudi_llama runs with --use_habana --gaudi_config_name llama "
        f"--attn_implementation gaudi_fused_sdpa (on this CPU: transformers' sdpa, Habana's default autocast "
        f"op lists, fused AdamW and clipping; the fused RMSNorm and rotary kernels exist only on a Gaudi); "
        f"gaudi_llama_compile adds {' '.join('--' + k for k in COMPILE_EXTRA)}.\n\n{table}"
    )
    log(text)
    return text, {**medians, "peak": peak, "flops": flops}


if __name__ == "__main__":  # one in_new_process request: variant, shape, sequence, tokenizer vocabulary, steps, warm-up
    print(json.dumps(run_once(*request_from_argv())))
