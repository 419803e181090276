#!/usr/bin/env python
"""`make demo`: train a small GPT-2 from scratch with GaudiTrainer, offline, in a few minutes on a laptop CPU.

It is run_clm.py with fixed arguments (embedded corpus and tokenizer, bundled gpt2 Gaudi config, the Gaudi
flags a Gaudi user would pass), plus what a first run should show: the evaluation loss before and after
training, throughput, peak memory, where everything was saved, and a text sample from the trained model.
The same command runs on a Gaudi, where the flags take effect instead of falling back.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from optimum_gaudi.checkpoints import check_output_dir
from optimum_gaudi.errors import run_main

# Picked by measurement on 2 CPU cores: within a ~75 s training budget, a 2x128 model taking more steps ends with a
# lower evaluation loss (perplexity ~200) than a 4x256 one taking fewer.
MODEL = {"n_layer": 2, "n_embd": 128, "n_head": 4}
BLOCK_SIZE = 128
OUTPUT_DIR = "outputs/demo"  # relative to the repository root, where `make demo` runs


def saved_model_dir() -> Path:
    """Where `make demo` saves the trained model: the default model of run_generation.py and run_lora_clm.py."""
    return Path(__file__).resolve().parents[2] / OUTPUT_DIR


def _load_run_clm() -> ModuleType:
    """Import run_clm.py from next to this file, so the demo reuses its code instead of repeating it."""
    path = Path(__file__).resolve().with_name("run_clm.py")
    spec = importlib.util.spec_from_file_location("run_clm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_clm"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=OUTPUT_DIR, help="where model, tokenizer and metrics go")
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="replace the model in --output_dir (always: the default)"
    )
    parser.add_argument("--max_steps", type=int, default=600, help="optimizer steps (batch of 16 x 128 tokens)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--prompt", default="Return the", help="start of the generated sample")
    return parser.parse_args(argv)


def _run_clm_args(opts: argparse.Namespace) -> list[str]:
    """run_clm.py's command line. `make demo` run again replaces the model in its own directory; in one the user
    names, a model is kept unless --overwrite_output_dir."""
    overrides = ",".join(f"{k}={v}" for k, v in MODEL.items())
    overwrite = opts.overwrite_output_dir or opts.output_dir == OUTPUT_DIR
    return [
        *(["--overwrite_output_dir"] if overwrite else []),
        *("--model_type", "gpt2", "--config_overrides", overrides, "--block_size", str(BLOCK_SIZE)),
        *("--do_train", "--do_eval", "--output_dir", opts.output_dir, "--seed", str(opts.seed)),
        # eager mode, the default of Gaudi software 1.21+ (lazy mode there needs PT_HPU_LAZY_MODE=1 before Python
        # starts, which `make demo` cannot set for the user)
        *("--use_habana", "--gaudi_config_name", "Habana/gpt2", "--throughput_warmup_steps", "5"),
        *("--max_steps", str(opts.max_steps), "--per_device_train_batch_size", "16"),
        *("--per_device_eval_batch_size", "32", "--learning_rate", "3e-3", "--warmup_steps", "30"),
        *("--lr_scheduler_type", "cosine", "--weight_decay", "0.01"),
        *("--logging_steps", "50", "--disable_tqdm", "true", "--save_strategy", "no", "--report_to", "none"),
    ]


def _pick_precision(training_args) -> str:
    """The Habana/gpt2 config autocasts to bf16 on its op lists, which is fast where the device computes bf16
    natively (a Gaudi, a CPU with AVX512-BF16, AMX or Arm BF16). Elsewhere bf16 is emulated, many times slower
    than float32, and the demo, which picks its own settings, trains in float32 instead."""
    device = training_args.autocast_device
    if device.native_bf16:
        return "bf16 autocast on the Habana/gpt2 config's op lists"
    training_args.gaudi_config.use_torch_autocast = False
    return f"float32, as {device.bf16_note()}"


def _sample(model: torch.nn.Module, tokenizer, prompt: str, seed: int) -> str:
    """Top-k sampling with a repetition penalty: greedy decoding of a model this small repeats blank lines."""
    torch.manual_seed(seed)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=48,
            do_sample=True,
            top_k=40,
            temperature=0.7,
            repetition_penalty=1.3,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    opts = _parse(argv)
    start = time.perf_counter()
    if "OMP_NUM_THREADS" not in os.environ:  # one thread per usable core; more only adds contention
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    run_clm = _load_run_clm()
    model_args, data_args, training_args = run_clm.parse_args(_run_clm_args(opts))
    run_clm.setup_logging(training_args)
    check_output_dir(training_args)
    precision = _pick_precision(training_args)
    trainer = run_clm.build_trainer(model_args, data_args, training_args)

    before = run_clm.evaluate_perplexity(trainer)
    metrics = run_clm.train_and_evaluate(trainer)  # trains, saves, evaluates again
    memory = training_args.gaudi_device.memory_stats()
    sample = _sample(trainer.model, trainer.processing_class, opts.prompt, opts.seed)
    total_time = time.perf_counter() - start

    samples_per_s = metrics["train_samples_per_second"]
    tokens_per_s = metrics.get("train_tokens_per_second", samples_per_s * BLOCK_SIZE)
    warmup = metrics.get("train_throughput_warmup_steps", 0)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    saved = sorted(p.name for p in Path(opts.output_dir).iterdir() if p.is_file())
    rows = [
        ("device", f"{training_args.gaudi_device.describe()} (torch threads: {torch.get_num_threads()})"),
        ("model", f"GPT-2 from scratch, {MODEL['n_layer']} layers x {MODEL['n_embd']}, {n_params / 1e6:.1f}M params"),
        (
            "data",
            f"{len(trainer.train_dataset)} train / {len(trainer.eval_dataset)} eval blocks of {BLOCK_SIZE} tokens "
            "(embedded corpus: CPython stdlib docstrings)",
        ),
        ("precision", precision),
        ("eval loss", f"{before['eval_loss']:.3f} -> {metrics['eval_loss']:.3f}"),
        ("perplexity", f"{before['perplexity']:.1f} -> {metrics['perplexity']:.1f}"),
        (
            "throughput",
            f"{samples_per_s:.1f} samples/s, {tokens_per_s:.0f} tokens/s (first {warmup} of {opts.max_steps} steps excluded)",
        ),
        ("peak memory", f"{memory['max_memory_allocated (GB)']:.2f} GB of {memory['total_memory_available (GB)']} GB"),
        ("time", f"{total_time:.1f} s total, of which training {metrics['train_runtime']:.1f} s"),
        ("saved to", f"{opts.output_dir}/ ({', '.join(saved)})"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n" + "=" * 30 + " demo summary " + "=" * 30)
    print("\n".join(f"{name:<{width}} : {value}" for name, value in rows))
    print(f"{'sample':<{width}} : {opts.prompt!r} -> top-k sample from the trained model:")
    print("\n".join(f"    | {line}" for line in sample.splitlines()))
    if not metrics["eval_loss"] < before["eval_loss"] - 1.0:
        raise SystemExit("error: the evaluation loss did not drop clearly; something is wrong with training.")
    return {"loss_before": before["eval_loss"], "total_time": total_time, **metrics}


if __name__ == "__main__":
    run_main(main)  # a user error: one `error: ...` line, exit status 2
