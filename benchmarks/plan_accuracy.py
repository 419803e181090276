"""The planner's per-rank memory against a measured training run on this CPU (issue 48's target: within 15%).

Each setting trains in fresh processes (one, or torchrun's), float32 unless its flags ask for bf16 autocast,
bf16 weights ("dtype": the model built in bf16 and trained so, as transformers 5 loads a bf16 checkpoint) or fp8
(torchao's float8 layers, from .venv-torchao). A rank measures the training's own memory: the resident set's
high-water mark (VmHWM, reset through /proc/self/clear_refs once the heap is trimmed) less the resident set just
before the model is built, the same quantity as the plan's peak less its runtime reserve (``Breakdown.training``).
The table compares the largest rank. Beside it, what was live at most (malloc's bytes in use, read after every
op) against the tensors the plan counts (its peak less the CPU workspace): the arithmetic's own error, apart from
the freed blocks the heap keeps.

This file is also the worker: ``python -m benchmarks.plan_accuracy OUT.json SETTING_JSON``; and
``python -m benchmarks.plan_accuracy --trace NAME`` measures one setting and names the ops that grew the heap.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHAO = ROOT / ".venv-torchao"  # torchao (--fp8 on a CPU) beside the venv, as the tests put it on the path
MB = 1e6

# Small Llama and GPT-2 shapes whose weights, activations and logits are each tens of MB: big enough to stand
# above the allocator's noise, small enough that a run takes seconds on one thread.
LLAMA = dict(model_type="llama", vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
# 107M parameters, fsdp_memory.py's Llama: the 100M class, where the training state dominates
LLAMA_107M = dict(model_type="llama", vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
GPT2 = dict(model_type="gpt2", vocab_size=8192, n_embd=256, n_layer=4, n_head=8, n_positions=512,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip

# LoRA as run_lora_clm.py trains it (PEFT, float32 adapters, the rest frozen); "dtype": the frozen weights loaded in
# bf16, as transformers 5 loads a bf16 checkpoint
LORA = {"r": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.05}
LORA_ALL = {"r": 16, "target_modules": "all-linear", "lora_dropout": 0.05}

FSDP2 = {"fsdp": "full_shard auto_wrap",
         "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}  # fmt: skip
# name: (model config, processes, sequence, micro-batch, training flags)
SETTINGS = {
    "llama": (LLAMA, 1, 128, 4, {}),
    "llama_ckpt": (LLAMA, 1, 128, 4, {"gradient_checkpointing": True}),
    "llama_fused": (LLAMA, 1, 128, 4, {"use_fused_linear_cross_entropy": True}),
    "llama_accum2": (LLAMA, 1, 128, 4, {"gradient_accumulation_steps": 2}),
    "gpt2": (GPT2, 1, 128, 4, {}),
    "gpt2_ckpt": (GPT2, 1, 128, 4, {"gradient_checkpointing": True}),
    "llama_ddp2": (LLAMA, 2, 128, 4, {}),
    "llama_fsdp2": (LLAMA, 2, 128, 4, FSDP2),
    "llama_fsdp4": (LLAMA, 4, 128, 2, FSDP2),
    "llama_cp2": (LLAMA, 2, 256, 2, {"context_parallel_size": 2}),
    "llama_107m": (LLAMA_107M, 1, 128, 2, {}),
    "llama_107m_fsdp2": (LLAMA_107M, 2, 128, 2, FSDP2),
    "llama_107m_long": (LLAMA_107M, 1, 1536, 2, {}),  # 3,072 tokens: the heap's kept blocks grow with activations
    "llama_bf16": (LLAMA, 1, 128, 4, {"bf16": True}),
    "gpt2_bf16": (GPT2, 1, 128, 4, {"bf16": True}),
    # full fine-tuning of bf16 weights: bf16 gradients and AdamW moments, with and without autocast
    "llama_bf16_weights": (LLAMA, 1, 128, 4, {"dtype": "bfloat16"}),
    "llama_bf16_weights_autocast": (LLAMA, 1, 128, 4, {"dtype": "bfloat16", "bf16": True}),
    "llama_fp8": (LLAMA, 1, 128, 4, {"bf16": True, "fp8": True}),
    "llama_lora": (LLAMA, 1, 128, 4, {"lora": LORA}),
    "llama_lora_ckpt": (LLAMA, 1, 128, 4, {"lora": LORA, "gradient_checkpointing": True}),
    "llama_lora_bf16": (LLAMA, 1, 128, 4, {"lora": LORA, "bf16": True}),
    "llama_lora_bf16_weights": (LLAMA, 1, 128, 4, {"lora": {**LORA_ALL, "dtype": "bfloat16"}, "bf16": True}),
    "gpt2_lora": (GPT2, 1, 128, 4, {"lora": {**LORA, "target_modules": ["c_attn"]}}),
    "llama_lora_ddp2": (LLAMA, 2, 128, 4, {"lora": LORA}),
    "llama_lora_fsdp2": (LLAMA, 2, 128, 4, {"lora": LORA, **FSDP2}),
    "llama_107m_lora": (LLAMA_107M, 1, 128, 2, {"lora": LORA}),
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _fresh_baseline() -> int:
    """The resident set with freed heap given back and the high-water mark reset to it."""
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set (proc(5))
    return _rss()


class _MallocInfo(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h)."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _malloc_info() -> _MallocInfo | None:
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallocInfo
    return mallinfo2()


def _malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not had back (heap and mapped blocks): the live tensors and whatever else
    the process holds, without the freed blocks a heap keeps. None without glibc's mallinfo2."""
    info = _malloc_info()
    return None if info is None else info.uordblks + info.hblkhd


def _live_peak_tracker(trace: bool = False):
    """A dispatch mode that reads malloc's bytes in use after every op: the peak of what is live, to tell the
    plan's tensor arithmetic apart from the heap's kept blocks (the resident set's high-water mark holds both).
    ``trace``: also the heap's growth (arena and mapped bytes) by the op that grew it, to see which freed blocks
    the heap could not reuse."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class LivePeak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.peak, self.extent, self.growth = 0, 0, Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            info = _malloc_info()
            if info is not None:
                self.peak = max(self.peak, info.uordblks + info.hblkhd)
                extent = info.arena + info.hblkhd
                if trace and self.extent and extent > self.extent:
                    self.growth[str(func)] += extent - self.extent
                self.extent = max(self.extent, extent)
            return result

    return LivePeak()


def work(out: str, spec: str) -> None:
    """One rank: train 3 steps, report the training's own peak."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

    config, _, sequence, micro, flags = json.loads(spec)
    lora = flags.pop("lora", None)
    dtype = flags.pop("dtype", None)  # the weights built in it, as from_pretrained loads a checkpoint of it
    if lora is not None:
        import peft  # imported before the baseline, as the trainer's own imports are
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = flags.get("gradient_accumulation_steps", 1)
    steps = 3
    g = torch.Generator().manual_seed(0)
    data_parallel = world // flags.get("context_parallel_size", 1)
    rows = torch.randint(0, config["vocab_size"], (steps * micro * accumulation * data_parallel, sequence), generator=g)
    data = [{"input_ids": r, "labels": r} for r in rows.tolist()]
    kind = config["model_type"]
    with tempfile.TemporaryDirectory() as tmp:
        args = GaudiTrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=micro, report_to="none", save_strategy="no",
            logging_steps=steps, disable_tqdm=True, learning_rate=1e-4, seed=0, **flags,
        )  # fmt: skip
        baseline = _fresh_baseline()
        in_use = _malloc_in_use()
        torch.manual_seed(0)
        model_config = transformers.AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
        model = transformers.AutoModelForCausalLM.from_config(
            model_config, **({"dtype": getattr(torch, dtype)} if dtype else {})
        )
        if lora is not None:  # as run_lora_clm.py: frozen weights as loaded, float32 adapters
            if lora.get("dtype"):
                model.to(getattr(torch, lora["dtype"]))
            if flags.get("gradient_checkpointing"):
                model.enable_input_require_grads()
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=lora["r"], target_modules=lora["target_modules"], lora_dropout=lora["lora_dropout"], bias="none",
                task_type="CAUSAL_LM"))  # fmt: skip
        trainer = GaudiTrainer(model=model, args=args, train_dataset=data)
        tracker = _live_peak_tracker(trace=bool(os.environ.get("PLAN_TRACE")))
        with tracker:
            trainer.train()
        peak = _high_water() - baseline
    live = None if in_use is None else tracker.peak - in_use
    mine = {"training_peak": peak, "live_peak": live, "parameters": sum(p.numel() for p in model.parameters()),
            "trained": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "heap_growth": tracker.growth.most_common(8)}  # fmt: skip
    if world > 1:
        ranks = [None] * world
        torch.distributed.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(ranks))
    if world > 1:
        torch.distributed.destroy_process_group()


def measure(name: str) -> dict:
    """Run setting ``name`` in fresh processes: the largest rank's training peak (bytes) and the parameters."""
    config, procs, sequence, micro, flags = SETTINGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        spec = json.dumps([config, procs, sequence, micro, flags])
        if procs == 1:
            command = [sys.executable, "-m", "benchmarks.plan_accuracy", str(out), spec]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr",
                       "127.0.0.1", "--master_port", str(port), "-m", "benchmarks.plan_accuracy", str(out), spec]  # fmt: skip
        path = [str(ROOT)] + ([str(TORCHAO)] if flags.get("fp8") and TORCHAO.is_dir() else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        ranks = json.loads(out.read_text())
    largest = max(ranks, key=lambda r: r["training_peak"])
    return {"training_peak": largest["training_peak"], "live_peak": largest["live_peak"],
            "parameters": ranks[0]["parameters"], "trained": ranks[0]["trained"],
            "heap_growth": largest["heap_growth"]}  # fmt: skip


def trace(name: str) -> str:
    """Setting ``name`` measured once more, with the ops that grew the heap after the model was built and by how
    much: ``python -m benchmarks.plan_accuracy --trace gpt2_ckpt``."""
    os.environ["PLAN_TRACE"] = "1"
    _, plan = predict(name)
    m = measure(name)
    grown = ", ".join(f"{op} {size / MB:.1f}" for op, size in m["heap_growth"])
    return (f"{name}: predicted {plan.training / MB:.0f} MB ({(plan.training - plan.workspace) / MB:.0f} MB of "
            f"tensors), measured {m['training_peak'] / MB:.0f} MB, live at most {m['live_peak'] / MB:.0f} MB; the "
            f"heap grew (MB) at: {grown}")  # fmt: skip


def predict(name: str):
    """The plan's breakdown for setting ``name`` on this CPU."""
    from optimum_gaudi.planning import Setting, Workload, breakdown, card, load_model_shape

    config, procs, sequence, micro, flags = SETTINGS[name]
    adapters = _adapters(name)
    cp = flags.get("context_parallel_size", 1)
    setting = Setting(
        strategy="fsdp" if "fsdp" in flags else "ddp", context_parallel=cp, fp8=flags.get("fp8", False),
        checkpointing=flags.get("gradient_checkpointing", False),
        fused_loss=flags.get("use_fused_linear_cross_entropy", False), micro_batch=micro,
        accumulation=flags.get("gradient_accumulation_steps", 1),
    )  # fmt: skip
    workload = Workload(cards=procs, sequence=sequence, global_batch=micro * procs // cp * setting.accumulation,
                        precision="bf16" if flags.get("bf16") else "fp32", adapters=adapters,
                        weight_bytes=2 if flags.get("dtype") == "bfloat16" else 4)  # fmt: skip
    return load_model_shape(config), breakdown(load_model_shape(config), workload, setting, card("cpu"))


def run(names=tuple(SETTINGS), log=print) -> tuple[str, dict]:
    """A markdown table of predicted against measured, and per setting (predicted, measured) bytes."""
    from benchmarks.common import markdown_table

    results, rows = {}, []
    for name in names:
        shape, plan = predict(name)
        measured = measure(name)
        counted = counted_parameters(name, shape)
        if (measured["parameters"], measured["trained"]) != counted:
            raise RuntimeError(f"{name}: the planner counts {counted} parameters (all, trained), the model has "
                               f"{measured['parameters'], measured['trained']}")  # fmt: skip
        results[name] = (plan.training, measured["training_peak"])
        error = plan.training / measured["training_peak"] - 1
        log(f"  {name}: predicted {plan.training / MB:.0f} MB, measured {measured['training_peak'] / MB:.0f} MB")
        config, procs, sequence, micro, flags = SETTINGS[name]
        parts = plan.parts()
        rows.append([
            name, f"{shape.parameters() / 1e6:.1f}M", str(procs), f"{micro}x{sequence}",
            ", ".join(_flag(k, v) for k, v in flags.items() if k != "fsdp_config") or "-",
            *(f"{parts[k] / MB:.0f}" for k in ("weights", "gradients", "optimizer", "activations", "logits/loss",
                                               "comm buffers", "workspace")),
            f"{plan.training / MB:.0f}", f"{measured['training_peak'] / MB:.0f}", f"{error:+.0%}",
            f"{(plan.training - plan.workspace) / MB:.0f}",
            "-" if measured["live_peak"] is None else f"{measured['live_peak'] / MB:.0f}",
        ])  # fmt: skip
    header = ["setting", "parameters", "processes", "micro-batch x sequence", "flags", "weights", "grads", "optim",
              "activ", "logits", "comm", "workspace", "predicted peak (MB)", "measured peak (MB)", "error",
              "tensors counted (MB)", "live at most (MB)"]  # fmt: skip
    return f"{markdown_table(header, rows)}\n\n{_machine()}", results


def _adapters(name: str):
    """Setting ``name``'s LoRA adapters as the planner takes them, or None (full fine-tuning)."""
    from optimum_gaudi.planning import Adapters

    lora = SETTINGS[name][4].get("lora")
    if lora is None:
        return None
    targets = lora["target_modules"]
    frozen = 2 if lora.get("dtype") == "bfloat16" else 4
    return Adapters(lora["r"], (targets,) if isinstance(targets, str) else tuple(targets), lora["lora_dropout"] > 0,
                    frozen)  # fmt: skip


def _flag(key: str, value) -> str:
    if key == "lora":
        targets = value["target_modules"]
        dtype = ", bf16 weights" if value.get("dtype") == "bfloat16" else ""
        return f"LoRA r{value['r']} {targets if isinstance(targets, str) else '+'.join(targets)}{dtype}"
    if key == "dtype":
        return f"{value} weights"
    return f"{key}={value}"


def counted_parameters(name: str, shape) -> tuple[int, int]:
    """(all parameters, the trained ones) as the planner counts them for setting ``name``."""
    from optimum_gaudi.planning import adapter_parameters

    adapters = _adapters(name)
    if adapters is None:
        return shape.parameters(), shape.parameters()
    return shape.parameters() + adapter_parameters(shape, adapters), adapter_parameters(shape, adapters)


def _machine() -> str:
    """The CPU the rows were measured on: its model, whether it has AVX2 / AVX-512, its cores; torch's version."""
    import torch

    model, flags = "unknown CPU", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = ", AVX512-BF16" if "avx512_bf16" in flags else ""
    return (f"Measured on: {model}, {vector}{bf16}, {os.cpu_count()} cores, torch {torch.__version__}; one thread a "
            "process; float32 unless the flags say bf16 (autocast), bfloat16 weights or fp8 (torchao); MB = 10^6 bytes. The cores may be "
            "shared with other work: the load average at the start is in the line below.")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "--trace":
        print(trace(sys.argv[2]))
    else:
        work(sys.argv[1], sys.argv[2])
