"""--use_fused_linear_cross_entropy on a 128k vocabulary: peak memory, speed and losses against the full logits.

A LlamaForCausalLM with random weights (nothing downloaded) at SmolLM-135M's widths (hidden 576, intermediate
1536, 9 query heads over 3 key/value heads, tied embeddings) but Llama 3's vocabulary of 128,256 tokens and
LAYERS layers; sequence 1024, batch BATCH, fp32, GaudiTrainer with the flag off and on. Each run is its own
process, so its peak RSS (getrusage) is its own; the variants are interleaved and repeated. Reported: median
steps/s after warm-up, median peak RSS, and the largest relative difference between the two variants' losses
at the same step.
run(tiny=True) trains a 2-layer model on a 4,096-token vocabulary: a smoke run of this code (BENCH_QUICK=1).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import tempfile

import torch
from transformers import TrainerCallback

from benchmarks.common import StepClock, in_new_process, markdown_table, median, request_from_argv
from benchmarks.llama_speed import blocks, llama, parameters
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

LAYERS, BATCH, SEQUENCE, TOKENIZER_VOCAB = 4, 2, 1024, 8192
SHAPE = dict(
    num_hidden_layers=LAYERS, vocab_size=128256, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
    num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=SEQUENCE, rms_norm_eps=1e-5,
)  # fmt: skip
TINY_SHAPE = {**SHAPE, "num_hidden_layers": 2, "vocab_size": 4096, "hidden_size": 72, "intermediate_size": 192}
TINY_SEQUENCE, TINY_TOKENIZER_VOCAB = 64, 4096
# the compiled variants: the decoder blocks and the loss (the model's loss_function, or the fused loss's chunk step)
COMPILE = dict(torch_compile=True, use_regional_compilation=True, torch_compile_backend="inductor")
# variant: (--use_fused_linear_cross_entropy, --torch_compile --use_regional_compilation with inductor)
VARIANTS = {
    "full_logits": (False, False),
    "fused_eager": (True, False),
    "full_logits_compiled": (False, True),
    "fused_compiled": (True, True),
}


def _peak_rss_kib() -> int | None:
    """The process's peak resident set since start or since the last reset (Linux's VmHWM), in KiB."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


class SteadyPeak(TrainerCallback):
    """Resets the process's peak resident set after the warm-up steps (``/proc/self/clear_refs``: 5), so that
    the peak read at the end is the timed steps' own, without what compilation held during the warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.reset = warmup, False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            try:
                with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
                    f.write("5")
                self.reset = True
            except OSError:
                pass

    def peak(self) -> int | None:
        kib = _peak_rss_kib()
        return kib * 1024 if self.reset and kib is not None else None


def run_once(variant: str, shape: dict, sequence: int, tokenizer_vocab: int, steps: int, warmup: int) -> list:
    """[steady steps/s, peak RSS in bytes, the loss of every step, CPU seconds a steady step, peak RSS of the
    timed steps in bytes (None where Linux cannot reset it)] of one training run in this process."""
    train = blocks(steps * BATCH, sequence, tokenizer_vocab)
    clock, steady = StepClock(warmup), SteadyPeak(warmup)
    with tempfile.TemporaryDirectory() as out:
        args = GaudiTrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-3, seed=0,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_pin_memory=False,
            use_cpu=True, use_fused_linear_cross_entropy=VARIANTS[variant][0], **(COMPILE if VARIANTS[variant][1] else {}),
        )  # fmt: skip
        trainer = GaudiTrainer(model=llama(shape), args=args, train_dataset=train, callbacks=[clock, steady])
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return [1 / clock.seconds_per_step, rss, losses, clock.cpu_seconds_per_step, steady.peak()]


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def run(repeats: int = 2, steps: int = 4, warmup: int = 2, tiny: bool = False, log=print) -> tuple[str, dict]:
    """A markdown section and the medians {variant: (steps/s, peak RSS)}, "loss_diff" (largest relative, between
    the full logits and each fused variant)."""
    shape, sequence, vocab = (
        (TINY_SHAPE, TINY_SEQUENCE, TINY_TOKENIZER_VOCAB) if tiny else (SHAPE, SEQUENCE, TOKENIZER_VOCAB)
    )
    results = {v: [] for v in VARIANTS}
    for r in range(repeats):  # interleaved, so drift in machine speed hits both variants alike
        for variant in VARIANTS:
            sps, rss, losses, cpu, steady = in_new_process(
                "benchmarks.fused_loss", [variant, shape, sequence, vocab, steps, warmup]
            )
            steady = steady or rss  # no reset: the whole run's peak
            results[variant].append((sps, rss, losses, cpu, steady))
            log(
                f"  fused loss {variant} run {r + 1}: {sps:.3f} steps/s, {cpu:.1f} CPU s/step, peak RSS {rss / 2**30:.2f} "
                f"GiB, {steady / 2**30:.2f} GiB in the timed steps"
            )
    medians = {v: tuple(median([x[i] for x in rs]) for i in (0, 1, 3, 4)) for v, rs in results.items()}
    full = results["full_logits"][0][2]
    loss_diff = max(
        abs(a - b) / abs(a)
        for variant in ("fused_eager", "fused_compiled", "full_logits_compiled")
        for a, b in zip(full, results[variant][0][2], strict=True)
    )
    base_sps, base_rss, base_cpu, base_steady = medians["full_logits"]
    rows = [
        [variant, f"{sps:.3f}", f"{sps / base_sps:.2f}x", f"{cpu:.1f}", f"{base_cpu / cpu:.2f}x", f"{rss / 2**30:.2f}",
         f"{rss / base_rss:.2f}x", f"{steady / 2**30:.2f}", f"{steady / base_steady:.2f}x"]
        for variant, (sps, rss, cpu, steady) in medians.items()
    ]  # fmt: skip
    header = ["variant", "steps/s (median)", "vs full_logits", "CPU s/step", "steps per CPU-s vs full_logits"]
    header += ["peak RSS, GiB", "vs full_logits", "timed steps' peak RSS, GiB", "vs full_logits"]
    table = markdown_table(header, rows)
    logits_gib = BATCH * sequence * shape["vocab_size"] * 4 / 2**30
    cpu = f"{cpu_name()} (torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores)"
    text = (
        f"LlamaForCausalLM, random weights, SmolLM-135M widths with {shape['num_hidden_layers']} layers (hidden "
        f"{shape['hidden_size']}, intermediate {shape['intermediate_size']}, {shape['num_attention_heads']} query "
        f"heads over {shape['num_key_value_heads']} key/value heads, tied embeddings) and a vocabulary of "
        f"{shape['vocab_size']:,}: {parameters(shape) / 1e6:.1f}M parameters, on {cpu}. Sequence {sequence}, batch {BATCH}, "
        f"fp32: the full logits of a step take {logits_gib:.2f} GiB. GaudiTrainer (AdamW) without and with "
        f"--use_fused_linear_cross_entropy, eager and with --torch_compile --use_regional_compilation (inductor: "
        f"the decoder blocks, and the loss: the model's cross-entropy over the full logits, or the fused loss's "
        f"chunk step, its matmuls in place beside it), each run its own process (peak RSS of that process, "
        f"compilation included; the timed steps' peak: the same with the peak reset after the warm-up, Linux's "
        f"VmHWM), {repeats} runs each, interleaved; {warmup} warm-up steps left out (compilation), "
        f"{steps - warmup} steps timed. The losses the Trainer logs (4 decimals) for the same step differ by at "
        f"most {loss_diff:.1e} (relative) between the variants.\n\n{table}"
    )
    log(text)
    return text, {**medians, "loss_diff": loss_diff}


if __name__ == "__main__":  # one in_new_process request: variant, shape, sequence, tokenizer vocabulary, steps, warm-up
    print(json.dumps(run_once(*request_from_argv())))
