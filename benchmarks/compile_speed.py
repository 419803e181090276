"""torch.compile with the Gaudi config's op lists, and regional compilation, against a hand-tuned Trainer.

GPT-2 4x256 (vocab 8192, sequence 128, batch 8), every setup trained from the same weights on the same
blocks, interleaved and repeated, each run in a new process:
  trainer_fp32          transformers.Trainer, default arguments
  trainer_fp32_compile  the same + --torch_compile: a plain Trainer's compiled code draws other dropout
                        masks than eager code, so its loss shows how far that alone moves a run
  hand_tuned            transformers.Trainer --bf16 --optim adamw_torch_fused
  hand_tuned_compile    the same + --torch_compile
  gaudi                 GaudiTrainer --gaudi_config_name gpt2 --bf16
  gaudi_compile         the same + --torch_compile
  gaudi_regional        the same + --torch_compile --use_regional_compilation (the repeated block and the
                        loss compiled, the rest eager)
Then a 12-layer GPT-2 of the same width, whole-model against regional compilation, each run in a fresh
process with a fresh, empty compiler cache, so that every run pays its model's full compile time (the
process's one-time compiler costs are paid first, on an unrelated model). The CPU's bf16 matmul peak is
measured in the same run, before and after, to state the share of it each setup reaches.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
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

VOCAB, BATCH = 8192, 8
SMALL = dict(n_layer=4, n_embd=256, n_head=4)
DEEP = dict(n_layer=12, n_embd=256, n_head=4)
TUNED = {"bf16": True, "optim": "adamw_torch_fused", "use_cpu": True}
GAUDI = {"gaudi_config_name": "gpt2", "bf16": True}
SETUPS = {
    "trainer_fp32": (Trainer, TrainingArguments, {}),
    "trainer_fp32_compile": (Trainer, TrainingArguments, {"torch_compile": True}),
    "hand_tuned": (Trainer, TrainingArguments, TUNED),
    "hand_tuned_compile": (Trainer, TrainingArguments, {**TUNED, "torch_compile": True}),
    "gaudi": (GaudiTrainer, GaudiTrainingArguments, GAUDI),
    "gaudi_compile": (GaudiTrainer, GaudiTrainingArguments, {**GAUDI, "torch_compile": True}),
    "gaudi_regional": (
        GaudiTrainer,
        GaudiTrainingArguments,
        {**GAUDI, "torch_compile": True, "use_regional_compilation": True},
    ),
}
DEEP_SETUPS = ("gaudi_compile", "gaudi_regional")


def step_flops(model_kwargs: dict) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward): weights and attention."""
    layers, width = model_kwargs["n_layer"], model_kwargs["n_embd"]
    tokens = BATCH * BLOCK_SIZE
    weights = layers * 12 * width * width + VOCAB * width  # blocks + tied output projection
    attention = layers * 2 * BLOCK_SIZE * width  # QK^T and AV, per token
    return 3 * 2 * tokens * (weights + attention)


def bf16_matmul_peak(n: int = 1024, seconds: float = 2.0) -> float:
    """Measured bf16 matmul FLOP/s of this CPU with the current torch threads (best of short bursts)."""
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        best = max(best, 5 * 2 * n**3 / (time.perf_counter() - start))
    return best


def run_once(setup: str, model_kwargs: dict, steps: int, warmup: int) -> tuple[float, float, float]:
    """(steady steps/s, compile seconds, eval loss) of one training run in this process."""
    trainer_cls, args_cls, extra = SETUPS[setup]
    tokenizer, train, valid = lm_blocks(steps)
    clock = StepClock(warmup)
    with tempfile.TemporaryDirectory() as out:
        args = args_cls(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, per_device_eval_batch_size=16,
            learning_rate=1e-3, warmup_steps=5, seed=0, report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_pin_memory=False, **extra,
        )  # fmt: skip
        model = gpt2(tokenizer, **model_kwargs)
        trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=valid, callbacks=[clock])
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    return 1 / clock.seconds_per_step, clock.warmup_excess_seconds, eval_loss


def run_fresh(setup: str, model_kwargs: dict, steps: int, warmup: int) -> tuple[float, ...]:
    """run_once in a new process with an empty compiler cache: nothing compiled before is reused, neither
    from disk (inductor's kernels and graphs) nor from memory; the process first warms the compiler on an
    unrelated model (warm_the_compiler). Adds the C++ kernels the run built and the seconds its compiles
    spent waiting for their builds."""
    with tempfile.TemporaryDirectory() as cache:
        env = {
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        }
        return tuple(in_new_process("benchmarks.compile_speed", [setup, model_kwargs, steps, warmup, True], env))


def run_apart(setup: str, model_kwargs: dict, steps: int, warmup: int) -> tuple[float, ...]:
    """run_once in a new process (the compiler cache as it is: only the steady speed and loss count here)."""
    return tuple(in_new_process("benchmarks.compile_speed", [setup, model_kwargs, steps, warmup, False]))


def _interleaved(setups, run, repeats, log, label):
    results = {s: [] for s in setups}
    for r in range(repeats):  # interleaved, so drift in machine speed hits every setup alike
        for setup in setups:
            result = run(setup)
            results[setup].append(result)
            sps, compile_s, loss = result[:3]
            log(f"  {label} {setup} run {r + 1}: {sps:.2f} steps/s, compile {compile_s:.1f} s, eval loss {loss:.4f}")
    return {s: tuple(median([x[i] for x in v]) for i in range(len(v[0]))) for s, v in results.items()}


def lm_blocks(steps: int):
    return lm_data(train_blocks=steps * BATCH, eval_blocks=64, vocab_size=VOCAB)


def run(
    repeats: int = 3, steps: int = 23, warmup: int = 3, deep_repeats: int = 2, deep_steps: int = 33, log=print
) -> tuple[str, dict]:
    """Markdown sections and the medians {"small": {setup: (steps/s, compile s, loss)}, "deep": ..., "peak"}."""
    peaks = [bf16_matmul_peak()]
    small = _interleaved(SETUPS, lambda s: run_apart(s, SMALL, steps, warmup), repeats, log, "4x256")
    deep = _interleaved(
        DEEP_SETUPS, lambda s: run_fresh(s, DEEP, deep_steps, warmup), deep_repeats, log, "12x256"
    )  # fmt: skip
    peaks.append(bf16_matmul_peak())
    peak = median(peaks)

    flops = step_flops(SMALL)
    tuned, tuned_compile = small["hand_tuned"][0], small["hand_tuned_compile"][0]
    rows = [
        [
            setup,
            f"{sps:.2f}",
            f"{sps / tuned:.2f}x",
            f"{sps / tuned_compile:.2f}x",
            f"{100 * sps * flops / peak:.0f}%",
            f"{loss:.4f}",
        ]  # fmt: skip
        for setup, (sps, _, loss) in small.items()
    ]
    small_table = markdown_table(
        ["setup", "steps/s (median)", "vs hand_tuned", "vs hand_tuned_compile", "share of bf16 peak",
         f"eval loss after {steps} steps"],
        rows,
    )  # fmt: skip
    deep_flops = step_flops(DEEP)
    deep_rows = [
        [setup, f"{compile_s:.0f}", f"{cxx_wait:.0f}", f"{kernels:.0f}", f"{sps:.3f}",
         f"{100 * sps * deep_flops / peak:.0f}%", f"{loss:.4f}"]
        for setup, (sps, compile_s, loss, kernels, cxx_wait) in deep.items()
    ]  # fmt: skip
    deep_table = markdown_table(
        ["setup", "compile time (s, median)", "of which waiting for g++ (s)", "C++ kernels built",
         "steps/s (median)", "share of bf16 peak", "eval loss"],
        deep_rows,
    )  # fmt: skip
    text = (
        f"GPT-2 4x256, vocab {VOCAB}, sequence {BLOCK_SIZE}, batch {BATCH}: {flops / 1e9:.1f} GFLOP a step. "
        f"This CPU's measured bf16 matmul peak in this run: {peak / 1e9:.0f} GFLOP/s. {repeats} runs each, "
        f"{warmup} warm-up steps (compilation) left out, {steps - warmup} steps timed. GaudiTrainer's compiled "
        f"code on CPU draws the dropout masks eager code draws, so its bf16 eval losses are compared with the "
        f"eager fp32 run; a plain Trainer's compiled code draws others (trainer_fp32_compile)."
        f"\n\n{small_table}\n\n"
        f"GPT-2 12x256 (same width and data, {deep_flops / 1e9:.1f} GFLOP a step), each run in a new process "
        f"with an empty compiler cache, so each compiles its model from scratch, after one compile of an "
        f"unrelated 1-layer model that pays the process's one-time costs (inductor's imports, C++ toolchain and "
        f"headers); compile time = warm-up time minus the same steps at steady speed; {deep_steps - warmup} "
        f"steps timed, {deep_repeats} runs each. A whole-model compile also builds each distinct C++ kernel "
        f"only once (the layers' kernels are the same code). Regional compilation builds its small graphs (the "
        f"block's forward and backward, the loss's) one after the other, each waiting for its own kernels, so "
        f"nearly all of its compile time is spent waiting for g++.\n\n"
        f"{deep_table}"
    )
    log(text)
    return text, {"small": small, "deep": deep, "peak": peak}


def kernels_built() -> int:
    """Shared libraries in this process's inductor cache: one g++ build each (run_fresh's cache is empty)."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return sum(1 for _ in Path(cache).rglob("*.so")) if cache else 0


def seconds_waiting_for_cxx() -> float:
    """How long compiles have waited for their C++ kernel builds (dynamo's ``async_compile.wait`` timer)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("async_compile.wait", []))


def warm_the_compiler() -> None:
    """Compile an unrelated 1-layer GPT-2 (other width, vocabulary and length: none of its kernels is the
    measured model's): pays what any first compile in a process on this machine pays (inductor's imports,
    its C++ toolchain and header set-up), so that a run's compile time is its model's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_layer=1, n_embd=48, n_head=2, n_positions=32))
    ids = torch.randint(0, 64, (2, 32))
    torch.compile(model)(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()


if __name__ == "__main__":  # one in_new_process request: setup, model sizes, steps, warm-up, fresh
    setup, model_kwargs, steps, warmup, fresh = request_from_argv()
    if not fresh:
        print(json.dumps(run_once(setup, model_kwargs, steps, warmup)))
        sys.exit()
    warm_the_compiler()
    kernels, waited = kernels_built(), seconds_waiting_for_cxx()
    result = run_once(setup, model_kwargs, steps, warmup)
    print(json.dumps([*result, kernels_built() - kernels, seconds_waiting_for_cxx() - waited]))
