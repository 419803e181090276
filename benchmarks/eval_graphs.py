"""Evaluation speed with and without --use_hpu_graphs_for_inference, as run_clm evaluates after training.

A GPT-2 at GPT-2 small's widths (12 layers of 768, vocabulary 50257, random weights) trains 20 steps on random
512-token blocks, bf16, then evaluate() runs twice on 252 blocks, batch 8 (31 full batches and a short one: two
input shapes), keeping the argmax of the logits as run_clm's accuracy does. Each variant in its own process;
reported: eval samples/s of the first evaluate() (with the graphs' captures) and of the second (replays only),
and how many graphs were captured. On a CPU the flag is a no-op: BENCH_GPU_TINY=1 runs a 1-layer model as a
smoke run of this code.

    python -m benchmarks.eval_graphs            # prints a markdown table; BENCH_GPU_EVAL_JSON=path also writes JSON
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.common import in_new_process, markdown_table, request_from_argv
from benchmarks.gpu import Tokens
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

SHAPE = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=512)
TINY_SHAPE = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
TRAIN_STEPS, EVAL_ROWS, BATCH = 20, 252, 8
VARIANTS = {"without graphs": False, "--use_hpu_graphs_for_inference": True}


def run_once(graphs: bool, shape: dict, train_steps: int, eval_rows: int) -> dict:
    """Train, then evaluate twice: each evaluate()'s samples/s and the graphs captured."""
    torch.manual_seed(0)
    length = shape["n_positions"]
    with tempfile.TemporaryDirectory() as out:
        args = GaudiTrainingArguments(
            output_dir=out, max_steps=train_steps, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
            use_habana=True, bf16=True, use_hpu_graphs_for_inference=graphs, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = GaudiTrainer(
            model=GPT2LMHeadModel(GPT2Config(**shape)), args=args,
            train_dataset=Tokens(train_steps * BATCH, length, shape["vocab_size"]),
            eval_dataset=Tokens(eval_rows, length, shape["vocab_size"]),
            preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        )  # fmt: skip
        trainer.train()
        speeds = [trainer.evaluate()["eval_samples_per_second"] for _ in range(2)]
    graphed = getattr(trainer.model.__dict__.get("forward"), "graphs", {})
    return {"first_evaluate": speeds[0], "second_evaluate": speeds[1], "graphs": len(graphed)}


def run(tiny: bool = False, json_path: str | None = None, log=print) -> tuple[str, dict]:
    shape, steps, rows = (TINY_SHAPE, 2, 20) if tiny else (SHAPE, TRAIN_STEPS, EVAL_ROWS)
    results = {}
    for name, graphs in VARIANTS.items():
        try:
            results[name] = in_new_process("benchmarks.eval_graphs", [graphs, shape, steps, rows], timeout=300)
        except Exception as error:  # a failed variant is a row; the other still runs
            results[name] = {"failed": (str(error).strip().splitlines() or [type(error).__name__])[-1][:200]}
        log(f"  eval {name}: {results[name]}")
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=1))
    rows_ = [
        [name, f"{r['first_evaluate']:.1f}", f"{r['second_evaluate']:.1f}", r["graphs"]]
        if "failed" not in r
        else [name, f"failed: {r['failed']}", "", ""]
        for name, r in results.items()
    ]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (the flag is a no-op)"
    text = (
        f"{device}: GPT-2 {shape['n_layer']}x{shape['n_embd']}, vocabulary {shape['vocab_size']}, {rows} eval "
        f"blocks of {shape['n_positions']} tokens, batch {BATCH}, bf16, after {steps} training steps.\n\n"
        + markdown_table(["evaluation", "1st evaluate(), samples/s", "2nd evaluate(), samples/s", "graphs"], rows_)
    )
    log(text)
    return text, results


if __name__ == "__main__":
    if len(sys.argv) > 1:  # one in_new_process request: graphs, shape, train steps, eval rows
        print(json.dumps(run_once(*request_from_argv())))
    else:
        run(tiny=os.environ.get("BENCH_GPU_TINY") == "1", json_path=os.environ.get("BENCH_GPU_EVAL_JSON"))
