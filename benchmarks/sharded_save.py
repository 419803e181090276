"""Saving a Llama trained with FSDP2 on 2 CPU processes: how long, and how much memory rank 0 takes for it.

  checkpoint_sharded  a checkpoint with SHARDED_STATE_DICT: each rank writes its shards (DCP)
  checkpoint_full     a checkpoint with FULL_STATE_DICT: the streamed model.safetensors, plus accelerate's
                      whole-model and whole-optimizer files written by rank 0
  final_streamed      save_model: tensor by tensor, rank 0 appends its rows then each other rank's to
                      model.safetensors
  final_gathered      what transformers does first: accelerate's get_state_dict (the whole model on rank 0),
                      then rank 0 writes it (safetensors' save_file; transformers' save_pretrained dies there)

Each setup is a fresh torchrun that trains one step, then times the save; setups interleave, medians of
repeats. Rank 0's memory is its resident set, sampled every millisecond during the save, less what it was just
before: the part of the peak that the save itself takes.

`python benchmarks/sharded_save.py OUT.json SETUP` under torchrun is one such run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SETUPS = ("checkpoint_sharded", "checkpoint_full", "final_streamed", "final_gathered")
# About 80M parameters (330 MB in float32), a Llama of 16 layers, width 512, grouped-query attention, untied
# 32k-token embeddings (Llama-2 7B's vocabulary): the embedding and the head are the largest tensors (65 MB each).
LLAMA = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=16, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakRss:
    """The largest resident set seen while the block runs, less the one at its start, in bytes."""

    def __enter__(self) -> PeakRss:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def worker(out: str, setup: str) -> None:
    """One run under torchrun: train one step under FSDP2, then time ``setup``'s save on every rank."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import safetensors.torch
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32000, (8, 128), generator=g).tolist()]
    state_dict_type = "FULL_STATE_DICT" if setup == "checkpoint_full" else "SHARDED_STATE_DICT"
    fsdp_config = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    with tempfile.TemporaryDirectory() as tmp:
        args = GaudiTrainingArguments(
            output_dir=tmp, fsdp="full_shard auto_wrap", fsdp_config={**fsdp_config, "state_dict_type": state_dict_type},
            max_steps=1, per_device_train_batch_size=1, save_strategy="no", report_to="none", disable_tqdm=True,
        )  # fmt: skip
        trainer = GaudiTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        trainer.accelerator.wait_for_everyone()
        with PeakRss() as memory:
            start = time.perf_counter()
            if setup.startswith("checkpoint"):
                trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            elif setup == "final_streamed":
                trainer.save_model(os.path.join(tmp, "final"))
            else:
                state = trainer.accelerator.get_state_dict(trainer.model)
                if trainer.is_world_process_zero():
                    os.makedirs(os.path.join(tmp, "final"))
                    safetensors.torch.save_file(state, os.path.join(tmp, "final", "model.safetensors"))
                del state
            trainer.accelerator.wait_for_everyone()
            seconds = time.perf_counter() - start
        written = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    if trainer.is_world_process_zero():
        parameters = sum(p.numel() for p in trainer.model.parameters())
        result = {"seconds": seconds, "rank0_peak_growth": memory.growth, "written": written, "parameters": parameters}
        Path(out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # FSDP over gloo sometimes hangs at interpreter exit (benchmarks/dist_worker.py)


def run_once(setup: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(_free_port()), __file__, str(out), setup]
        root = str(Path(__file__).resolve().parent.parent)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{setup} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, its widest vector extension and core count (memory copies and gathers
    set the pace here)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    vector = "AVX-512" if "avx512f" in flags else "AVX2-only" if "avx2" in flags else "no AVX2"
    return f"{name or 'unknown CPU'}, {vector}, {os.cpu_count()} cores"


def run(repeats: int = 2, log=print) -> tuple[str, dict]:
    """A markdown table, and each setup's medians (seconds, rank 0's memory growth) for the target checks."""
    from benchmarks.common import markdown_table, median

    results: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for r in range(repeats):
        for setup in SETUPS:
            result = run_once(setup)
            results[setup].append(result)
            mb = result["rank0_peak_growth"] / 2**20
            log(f"  {setup} run {r + 1}: {result['seconds']:.2f} s, rank 0 +{mb:.0f} MB")
    m = {
        s: {k: median([x[k] for x in runs]) for k in ("seconds", "rank0_peak_growth", "written")}
        for s, runs in results.items()
    }
    pairs = {
        "checkpoint_sharded": "checkpoint_full", "checkpoint_full": "checkpoint_full",
        "final_streamed": "final_gathered", "final_gathered": "final_gathered",
    }  # fmt: skip
    rows = []
    for s in SETUPS:
        ref = m[pairs[s]]
        rows.append([
            s, f"{m[s]['seconds']:.2f}", f"{m[s]['seconds'] / ref['seconds']:.2f}x",
            f"{m[s]['rank0_peak_growth'] / 2**20:.0f}", f"{m[s]['rank0_peak_growth'] / ref['rank0_peak_growth']:.2f}x",
            f"{m[s]['written'] / 2**20:.0f}",
        ])  # fmt: skip
    header = ["setup", "save s (median)", "vs its reference", "rank 0 memory +MB", "vs its reference", "MB written"]
    table = markdown_table(header, rows)
    log(table)
    params = results[SETUPS[0]][0]["parameters"]
    intro = (
        f"A Llama of {params / 1e6:.0f}M parameters (16 layers, width 512, untied 32k embeddings; float32), FSDP2 on 2"
        f" gloo processes, 1 thread each, on {cpu_name()}; {repeats} runs of each setup. References: checkpoint_full for the"
        " checkpoints, final_gathered for the final save."
    )
    notes = (
        "The streamed save's extra memory on rank 0 is one shard of the largest tensor (half the 65 MB embedding"
        " here), whatever the model's size: rank 0 writes its own rows, then each other rank's, sent to it alone;"
        " the gathered save holds the whole model. A FULL_STATE_DICT checkpoint writes the model twice (the"
        " streamed model.safetensors and accelerate's pytorch_model_fsdp.bin) and the whole optimizer state from"
        " rank 0."
    )
    return f"{intro}\n\n{table}\n\n{notes}", m


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
