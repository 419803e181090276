"""The GPU as a measured target: GaudiTrainer against a hand-tuned transformers.Trainer on a 1B-class Llama.

A LlamaForCausalLM with random weights (nothing downloaded) at Llama-3.2-1B's widths: 16 layers, hidden 2048,
intermediate 8192, 32 query heads over 8 key/value heads, vocabulary 128256, tied embeddings (1.24B
parameters), built on the GPU; random tokens, sequence 2048, batch 4. Each setup trains the same weights on the
same tokens in a process of its own:
  hand_tuned_compile  transformers.Trainer --bf16 --optim adamw_torch_fused --torch_compile, sdpa attention,
                      accelerate's regional compilation (ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1)
  gaudi_compile       GaudiTrainer --use_habana --gaudi_config_name llama --attn_implementation gaudi_fused_sdpa
                      --bf16 --torch_compile --use_regional_compilation (on a GPU: sdpa, the config's op-list
                      autocast, fused AdamW and clipping, the blocks and the loss compiled)
  gaudi_compile_fp8_flce  the same + --fp8 (torchao's Float8Linear on the blocks' linear layers)
                      + --use_fused_linear_cross_entropy (a row says so where the flag is missing)
  liger_compile       hand_tuned_compile + --use_liger_kernel (Liger's Triton RMSNorm, RoPE, SwiGLU and fused linear
                      cross-entropy; liger-kernel carried as a wheel); skipped where it is not importable or no GPU
  gaudi_compile_fp8   the same as gaudi_compile_fp8_flce without the fused linear cross-entropy
Both sides compile regionally (each decoder block once for all 16): whole-model compilation of 16 layers takes
minutes per setup, and the benchmark must fit one short call on a lent GPU.

Reported per setup: tokens/s over the timed steps (the GPU synchronised at both ends of them), MFU = tokens/s x
FLOPs per token / the bf16 matmul peak measured in the same run (8192^3 matmuls, the higher of the measurements
before and after the setups), the FLOPs per token being 6 x parameters in matmuls + attention's 12 x layers x
sequence x hidden (llama_speed.step_flops), torch.cuda.max_memory_allocated over the training run, the ratios
to hand_tuned_compile, and the warm-up's excess over steady steps (mostly compilation).

BENCH_GPU_TINY=1 (or BENCH_QUICK=1) runs a 2-layer Llama of width 64 on 64-token sequences, compiled with the
cheap ``eager`` backend: a smoke run of this code on any machine, CPU included, not a measurement.
BENCH_GPU_JSON=path writes the results as JSON, rewritten after each setup so that a run cut short keeps
what it measured; BENCH_GPU_BUDGET=seconds bounds the whole run (a setup that cannot start in time is a row
saying so).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from benchmarks.common import StepClock, in_new_process, markdown_table, request_from_argv
from benchmarks.compile_speed import bf16_matmul_peak
from benchmarks.llama_speed import parameters, step_flops
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

SHAPE = dict(
    num_hidden_layers=16, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
    num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5,
)  # fmt: skip
SEQUENCE, BATCH, STEPS, WARMUP = 2048, 4, 15, 3
TINY_SHAPE = {**SHAPE, "num_hidden_layers": 2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
TINY_SEQUENCE, TINY_BATCH, TINY_STEPS, TINY_WARMUP = 64, 2, 3, 1
SETUP_TIMEOUT = int(os.environ.get("BENCH_GPU_SETUP_TIMEOUT", "150"))  # seconds, each setup's process
# seconds for the whole run (BENCH_GPU_BUDGET): a setup gets what is left, and none starts with under a minute
# left, so that the table and JSON are written before a lent machine's time runs out
BUDGET = float(os.environ.get("BENCH_GPU_BUDGET", "inf"))

REGIONAL_ENV = {"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1"}  # accelerate's TorchDynamoPlugin reads it
TUNED = {"bf16": True, "optim": "adamw_torch_fused", "torch_compile": True}
GAUDI = {
    "use_habana": True, "gaudi_config_name": "llama", "attn_implementation": "gaudi_fused_sdpa", "bf16": True,
    "torch_compile": True, "use_regional_compilation": True,
}  # fmt: skip
# setup: (trainer, arguments, flags, environment)
SETUPS = {  # in the order of the targets: a run cut short keeps the ones that matter most
    "hand_tuned_compile": (Trainer, TrainingArguments, TUNED, REGIONAL_ENV),
    "gaudi_compile": (GaudiTrainer, GaudiTrainingArguments, GAUDI, {}),
    "gaudi_compile_fp8_flce": (
        GaudiTrainer, GaudiTrainingArguments, {**GAUDI, "fp8": True, "use_fused_linear_cross_entropy": True}, {},
    ),
    # the peer a GPU user picks for LLM fine-tuning: Liger's Triton RMSNorm, RoPE, SwiGLU and fused linear
    # cross-entropy (liger-kernel, carried as a wheel by tests/scripts/device_wheels.sh), compiled regionally
    "liger_compile": (Trainer, TrainingArguments, {**TUNED, "use_liger_kernel": True}, REGIONAL_ENV),
    "gaudi_compile_fp8": (GaudiTrainer, GaudiTrainingArguments, {**GAUDI, "fp8": True}, {}),
}  # fmt: skip
BASELINE = "hand_tuned_compile"
LIGER = "liger_compile"


def on_gpu() -> bool:
    return torch.cuda.is_available()


def synchronize() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def matmul_peak(n: int = 8192, warmup: int = 5, repeats: int = 30) -> float:
    """bf16 matmul FLOP/s of this GPU: the mean over `repeats` n^3 matmuls after `warmup`; on a CPU (tiny
    runs) compile_speed's measurement."""
    if not on_gpu():
        return bf16_matmul_peak(n=256, seconds=0.2)
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for _ in range(warmup):
        a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    seconds = time.perf_counter() - start
    del a, b
    torch.cuda.empty_cache()
    return repeats * 2 * n**3 / seconds


class Tokens(torch.utils.data.Dataset):
    """`rows` sequences of random token ids, labels = inputs, the same for every setup."""

    def __init__(self, rows: int, sequence: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, sequence), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GpuClock(StepClock):
    """StepClock that waits for the GPU at the two ends of the timed steps only: the steps between run ahead of
    the GPU as in any training run. Starts the peak-memory count at train start."""

    def on_train_begin(self, args, state, control, **kwargs):
        if on_gpu():
            torch.cuda.reset_peak_memory_stats()
        return super().on_train_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.warmup, args.max_steps):
            synchronize()
        return super().on_step_end(args, state, control, **kwargs)


def run_once(setup: str, shape: dict, sequence: int, batch: int, steps: int, warmup: int, tiny: bool) -> dict:
    """One training run in this process: tokens/s, peak memory, warm-up excess, mean training loss."""
    trainer_cls, args_cls, flags, _ = SETUPS[setup]
    if tiny:
        flags = {**flags, "torch_compile_backend": "eager"}
    if not on_gpu() and args_cls is TrainingArguments:
        flags = {**flags, "use_cpu": True}  # transformers refuses --bf16 without a GPU unless told
    torch.manual_seed(0)
    with torch.device("cuda" if on_gpu() else "cpu"):  # 1.24B parameters initialise in seconds on the GPU
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    clock = GpuClock(warmup)
    with tempfile.TemporaryDirectory() as out:
        args = args_cls(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-4, seed=0,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, **flags,
        )  # fmt: skip
        trainer = trainer_cls(
            model=model, args=args, train_dataset=Tokens(steps * batch, sequence, shape["vocab_size"]),
            callbacks=[clock],
        )  # fmt: skip
        loss = trainer.train().training_loss
    return {
        "tokens_per_s": batch * sequence / clock.seconds_per_step,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if on_gpu() else None,
        "warmup_excess_s": clock.warmup_excess_seconds,
        "train_loss": loss,
    }


def skip_reason(setup: str) -> str | None:
    """Why a setup cannot run here (a flag this GaudiTrainingArguments lacks, fp8 without torchao), or None."""
    _, args_cls, flags, _ = SETUPS[setup]
    known = {f.name for f in dataclasses.fields(args_cls)}
    missing = [name for name in flags if name not in known]
    if missing:
        return "flag not available: " + ", ".join(f"--{name}" for name in missing)
    if flags.get("fp8") and importlib.util.find_spec("torchao") is None:
        return "torchao not importable (--fp8 needs it)"
    if flags.get("use_liger_kernel"):
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel not importable (tests/scripts/device_wheels.sh carries it)"
        if not on_gpu():
            return "Liger's kernels are Triton kernels: a GPU only"
    return None


def _last_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return (text[-1] if text else type(error).__name__)[:200].replace("|", "/")


def run(tiny: bool = False, setups: tuple[str, ...] | None = None, json_path: str | None = None, log=print):
    """A markdown section and the results {"setups": {setup: {...} or {"skipped": why}}, "peak": FLOP/s, ...}."""
    shape, sequence, batch, steps, warmup = (
        (TINY_SHAPE, TINY_SEQUENCE, TINY_BATCH, TINY_STEPS, TINY_WARMUP)
        if tiny
        else (SHAPE, SEQUENCE, BATCH, STEPS, WARMUP)
    )
    flops_per_token = step_flops(shape, sequence, batch) / (batch * sequence)
    device = torch.cuda.get_device_name() if on_gpu() else "CPU (no GPU: a smoke run, not a measurement)"
    results: dict = {
        "device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "tiny": tiny,
        "shape": shape, "sequence": sequence, "batch": batch, "steps": steps, "warmup": warmup,
        "parameters": parameters(shape), "flops_per_token": flops_per_token, "peaks": [matmul_peak()], "setups": {},
    }  # fmt: skip
    results["peak"] = results["peaks"][0]

    def save() -> None:
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=1))

    log(f"  gpu: {device}, bf16 matmul peak {results['peak'] / 1e12:.1f} TFLOP/s")
    deadline = time.monotonic() + BUDGET
    for setup in setups or SETUPS:
        why, left = skip_reason(setup), deadline - time.monotonic() - 10  # 10 s: the second peak measurement
        if why is None and left < 60:
            why = f"not run: {max(left, 0):.0f} s of BENCH_GPU_BUDGET left"
        if why is None:
            request = [setup, shape, sequence, batch, steps, warmup, tiny]
            timeout = int(min(SETUP_TIMEOUT, left))
            try:
                outcome = in_new_process("benchmarks.gpu", request, env=SETUPS[setup][3], timeout=timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                outcome = {"failed": _last_line(error)}
        else:
            outcome = {"skipped": why}
        results["setups"][setup] = outcome
        log(f"  gpu {setup}: {outcome}")
        save()
    results["peaks"].append(matmul_peak())
    results["peak"] = max(results["peaks"])  # the higher: MFU is not flattered by a slow measurement
    save()
    text = section_text(results)
    log(text)
    return text, results


def section_text(results: dict) -> str:
    """The description and table of one run's results."""
    peak, per_token, measured = results["peak"], results["flops_per_token"], results["setups"]
    base = measured.get(BASELINE, {})
    rows = []
    for setup, m in measured.items():
        if "tokens_per_s" not in m:
            rows.append([setup, m.get("skipped") or f"failed: {m.get('failed')}", *[""] * 6])
            continue
        memory = m["peak_memory_gb"]
        speed_ratio = f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}x" if "tokens_per_s" in base else ""
        memory_ratio = f"{memory / base['peak_memory_gb']:.2f}x" if memory and base.get("peak_memory_gb") else ""
        rows.append([
            setup, f"{m['tokens_per_s']:,.0f}", f"{100 * m['tokens_per_s'] * per_token / peak:.1f}%",
            f"{memory:.1f}" if memory else "n/a", speed_ratio, memory_ratio, f"{m['warmup_excess_s']:.0f}",
            f"{m['train_loss']:.3f}",
        ])  # fmt: skip
    table = markdown_table(
        ["setup", "tokens/s", "MFU", "peak memory (GiB)", "tokens/s vs hand_tuned_compile",
         "memory vs hand_tuned_compile", "warm-up excess (s)", "mean train loss"],
        rows,
    )  # fmt: skip
    shape = results["shape"]
    return (
        f"{results['device']}, torch {results['torch']} (CUDA {results['cuda']}). LlamaForCausalLM, random "
        f"weights: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, intermediate "
        f"{shape['intermediate_size']}, {shape['num_attention_heads']} query heads over "
        f"{shape['num_key_value_heads']} key/value heads, vocabulary {shape['vocab_size']}, tied embeddings: "
        f"{results['parameters'] / 1e9:.2f}B parameters. Random tokens, sequence {results['sequence']}, batch "
        f"{results['batch']}; {results['warmup']} warm-up steps left out, {results['steps'] - results['warmup']} "
        f"timed. MFU = tokens/s x {results['flops_per_token'] / 1e9:.3g} GFLOP a token (6 x parameters in "
        f"matmuls + 12 x layers x sequence x hidden for attention) / the bf16 matmul peak measured in this run, "
        f"{peak / 1e12:.3g} TFLOP/s (8192^3 matmuls; before and after the setups: "
        f"{', '.join(f'{p / 1e12:.3g}' for p in results['peaks'])}). Peak memory: torch.cuda.max_memory_allocated "
        f"over the training run. Each setup in its own process; both sides compile each decoder block once "
        f"(regional compilation: accelerate's for the hand-tuned Trainer, --use_regional_compilation for "
        f"GaudiTrainer, which also compiles the loss).\n\n{table}"
    )


if __name__ == "__main__":  # one in_new_process request: setup, shape, sequence, batch, steps, warm-up, tiny
    print(json.dumps(run_once(*request_from_argv())))
