#!/usr/bin/env python
"""Batched text generation with a causal LM, timed: tokens/s and per-token latency after warm-up.

The flags are optimum-habana's run_generation.py ones. On a Gaudi in lazy mode shapes are kept static, so
each shape compiles once: prompts are left-padded to a multiple of --bucket_size (masked, so the output does
not change) and the key/value cache has a fixed size. --use_hpu_graphs wraps the forward in HPU Graphs, but
a decoding step given the key/value cache runs without them: a replay repeats the device ops of its capture,
not the Python that keeps the cache object's state (T5's first step computes the cross-attention and marks
it done), so stock transformers models are not replayed there. With no model named it generates with the
model `make demo` saved (outputs/demo).

    python examples/text-generation/run_generation.py --batch_size 8 --max_new_tokens 64 \
        --use_habana --use_lazy_mode --use_hpu_graphs --bf16 --num_beams 1

Greedy by default; --do_sample with --top_k / --top_p / --temperature samples, --num_beams N searches beams.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, set_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "language-modeling"))
import demo  # noqa: E402  (where `make demo` saves its model)
import run_clm  # noqa: E402  (loaders and one-line errors shared by the examples)
from run_clm import UsageError  # noqa: E402

from optimum_gaudi import GaudiTrainingArguments  # noqa: E402
from optimum_gaudi.errors import quiet_argparse_errors, run_main  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("Return the", "This module provides", "Create a new", "If the file")


@dataclass
class GenerationArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model directory or Hub name. Default: the model `make demo` saved."}
    )
    prompt: list[str] | None = field(
        default=None, metadata={"help": "Prompts, cycled to fill the batch. Default: a few docstring openings."}
    )
    batch_size: int = field(default=4, metadata={"help": "Prompts generated together."})
    max_new_tokens: int = field(default=32, metadata={"help": "Tokens generated per prompt."})
    max_input_tokens: int | None = field(default=None, metadata={"help": "Truncate prompts to this many tokens."})
    ignore_eos: bool = field(
        default=True, metadata={"help": "Generate all max_new_tokens even past an end-of-text token (timing)."}
    )
    do_sample: bool = field(default=False, metadata={"help": "Sample instead of greedy or beam search."})
    num_beams: int = field(default=1, metadata={"help": "Beams for beam search (1: no beam search)."})
    top_k: int | None = field(default=None, metadata={"help": "Sampling: keep the k most likely tokens."})
    top_p: float | None = field(default=None, metadata={"help": "Sampling: nucleus probability mass."})
    temperature: float | None = field(default=None, metadata={"help": "Sampling: logits temperature."})
    repetition_penalty: float | None = field(default=None, metadata={"help": "Penalty on repeated tokens."})
    use_kv_cache: bool = field(default=True, metadata={"help": "Reuse past keys/values while decoding."})
    bf16: bool = field(default=False, metadata={"help": "Load the weights in bfloat16."})
    use_habana: bool = field(default=False, metadata={"help": "Run on a Gaudi (falls back where there is none)."})
    use_lazy_mode: bool = field(default=False, metadata={"help": "HPU lazy mode (needed for HPU Graphs)."})
    use_hpu_graphs: bool = field(
        default=False,
        metadata={"help": "Wrap the forward in HPU Graphs (decoding steps given the key/value cache run without)."},
    )
    bucket_size: int = field(
        default=16, metadata={"help": "With static shapes, prompts are padded to a multiple of this many tokens."}
    )
    static_shapes: bool = field(
        default=False,
        metadata={
            "help": "Bucketed prompts and a fixed-size cache; always on where each shape compiles a graph "
            "(a Gaudi in lazy mode, which HPU Graphs need)."
        },
    )
    warmup: int = field(default=2, metadata={"help": "Untimed generations first (graph compilation, caches)."})
    n_iterations: int = field(default=3, metadata={"help": "Timed generations."})
    seed: int = field(default=42, metadata={"help": "Random seed (sampling)."})
    output_dir: str | None = field(default=None, metadata={"help": "Write generation_results.json here."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models."})

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_new_tokens", "num_beams", "bucket_size", "n_iterations"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}.")
        if not self.do_sample and any(v is not None for v in (self.top_k, self.top_p, self.temperature)):
            raise UsageError("--top_k, --top_p and --temperature apply to sampling: add --do_sample.")


def bucketed(length: int, bucket: int) -> int:
    """The smallest multiple of `bucket` that holds `length` tokens: one compiled shape per bucket."""
    return max(bucket, math.ceil(length / bucket) * bucket)


def resolve_model(args: GenerationArguments) -> str:
    if args.model_name_or_path:
        return args.model_name_or_path
    saved = demo.saved_model_dir()
    if not (saved / "config.json").is_file():
        raise UsageError(f"no model at {saved}: run `make demo` to train one there, or pass --model_name_or_path.")
    return str(saved)


def load(args: GenerationArguments, device: torch.device) -> tuple[torch.nn.Module, Any]:
    name = resolve_model(args)
    model_args = run_clm.ModelArguments(model_name_or_path=name, token=args.token)
    tokenizer = run_clm.load_tokenizer(model_args)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = run_clm._from_pretrained(
        AutoModelForCausalLM.from_pretrained, name, "model", dtype=dtype, **run_clm._hub_kwargs(model_args)
    )
    tokenizer.padding_side = "left"  # decoder-only: new tokens follow the prompt's last real token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval().to(device), tokenizer


def encode(tokenizer, prompts: list[str], args: GenerationArguments) -> dict[str, torch.Tensor]:
    """Left-padded batch; with static shapes, padded to the bucket that holds the longest prompt."""
    truncate = {"truncation": True, "max_length": args.max_input_tokens} if args.max_input_tokens else {}
    batch = tokenizer(prompts, return_tensors="pt", padding=True, **truncate)
    if args.static_shapes:
        length = bucketed(batch["input_ids"].shape[1], args.bucket_size)
        batch = tokenizer(prompts, return_tensors="pt", padding="max_length", max_length=length, truncation=True)
    return dict(batch)


def generation_kwargs(args: GenerationArguments, tokenizer) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        "num_beams": args.num_beams,
        "use_cache": args.use_kv_cache,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if args.ignore_eos:
        kwargs["min_new_tokens"] = args.max_new_tokens
    if args.static_shapes and args.use_kv_cache:
        kwargs["cache_implementation"] = "static"  # one cache size: every decoding step has the same shapes
    for name in ("top_k", "top_p", "temperature", "repetition_penalty"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def run(args: GenerationArguments) -> dict[str, Any]:
    """Load, warm up, time `n_iterations` batched generations; return the measurements and the texts."""
    # The training arguments settle what is device-specific once: the bridge's environment, the device
    # (or the fallback, with one warning), and that HPU Graphs need lazy mode on a Gaudi.
    device_args = GaudiTrainingArguments(
        output_dir=args.output_dir or "generation_output",
        use_habana=args.use_habana,
        use_lazy_mode=args.use_lazy_mode,
        use_hpu_graphs_for_inference=args.use_hpu_graphs,
        report_to=[],
    )
    gaudi_device = device_args.gaudi_device
    args.static_shapes = args.static_shapes or gaudi_device.static_shapes(args.use_lazy_mode)
    set_seed(args.seed)
    model, tokenizer = load(args, device_args.device)
    if args.use_hpu_graphs:
        model = gaudi_device.wrap_for_inference(model, disable_tensor_cache=False)
        if args.use_kv_cache:
            logger.warning(
                "--use_hpu_graphs: decoding steps are given the key/value cache, a Python object a graph replay "
                "would not update, so they run without the graphs (static shapes still compile each shape once)."
            )
    pool = args.prompt or list(DEFAULT_PROMPTS)
    prompts = [pool[i % len(pool)] for i in range(args.batch_size)]
    batch = {k: v.to(device_args.device) for k, v in encode(tokenizer, prompts, args).items()}
    kwargs = generation_kwargs(args, tokenizer)
    input_length = batch["input_ids"].shape[1]

    def generate() -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(**batch, **kwargs)
        if args.use_lazy_mode:
            gaudi_device.mark_step()
        return out.cpu()  # waits for the device: the timing covers the whole generation

    for _ in range(args.warmup):
        generate()
    times = []
    for _ in range(args.n_iterations):
        start = time.perf_counter()
        output = generate()
        times.append(time.perf_counter() - start)
    new_tokens = output[:, input_length:]
    generated = int((new_tokens != tokenizer.pad_token_id).sum()) if not args.ignore_eos else new_tokens.numel()
    seconds = sum(times) / len(times)
    return {
        "device": gaudi_device.describe(),
        "batch_size": args.batch_size,
        "input_tokens": input_length,
        "new_tokens_per_prompt": new_tokens.shape[1],
        "tokens_per_second": generated / seconds,
        "per_token_latency_ms": 1000 * seconds / new_tokens.shape[1],
        "seconds_per_iteration": seconds,
        "warmup_iterations": args.warmup,
        "timed_iterations": args.n_iterations,
        "texts": tokenizer.batch_decode(output, skip_special_tokens=True),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(format="%(levelname)s - %(name)s - %(message)s", level=logging.WARNING)
    parser = quiet_argparse_errors(HfArgumentParser(GenerationArguments))
    (args,) = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv, look_for_args_file=False)
    results = run(args)
    mode = "beam search" if args.num_beams > 1 else "sampling" if args.do_sample else "greedy"
    print(f"device: {results['device']}, {mode}, batch {args.batch_size}, static shapes: {args.static_shapes}")
    print(
        f"input tokens (padded): {results['input_tokens']}, new tokens per prompt: {results['new_tokens_per_prompt']}"
    )
    print(f"after {args.warmup} warm-up and {args.n_iterations} timed iterations:")
    print(f"  throughput        : {results['tokens_per_second']:.1f} tokens/s")
    print(f"  per-token latency : {results['per_token_latency_ms']:.2f} ms")
    for i, text in enumerate(results["texts"][: min(4, len(results["texts"]))]):
        print(f"  [{i}] {text!r}")
    if args.output_dir:
        path = Path(args.output_dir) / "generation_results.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**results, "args": asdict(args)}, indent=2))
    return results


if __name__ == "__main__":
    run_main(main)
