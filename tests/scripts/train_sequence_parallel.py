"""Train the tiny Llama with its sequences split over the ranks, several runs in one launch; rank 0 writes each
run's losses and trained parameters to a JSON file.

`train_sequence_parallel.py OUT.json RUNS.json`: RUNS.json maps a run's name to {"attn": ..., "padding_side": ...,
"args": {GaudiTrainingArguments keywords}, "eval_rows": rows to evaluate on after training (optional)}; a run with
"compute_loss_func": true only builds the trainer with one and writes {"refused": the UserError's line or None}.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402
from optimum_gaudi.errors import UserError  # noqa: E402


def refusal(args: GaudiTrainingArguments) -> str | None:
    """The line a trainer with a compute_loss_func is refused with, if any."""
    try:
        GaudiTrainer(model=tiny.llama_8_heads(), args=args, compute_loss_func=lambda outputs, *_, **__: outputs.loss)
    except UserError as error:
        return str(error)
    return None


def main() -> None:
    out, runs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    torch.set_num_threads(1)
    results = {}
    for name, run in runs.items():
        args = GaudiTrainingArguments(**run["args"])
        if run.get("compute_loss_func"):
            results[name] = {"refused": refusal(args)}
            continue
        results[name] = tiny.trained_llama(args, run["attn"], run["padding_side"], run.get("eval_rows", 0))
        results[name]["world_size"] = args.world_size
        if "habana_frameworks" in sys.modules:  # the simulated Gaudi: what its kernels and collectives saw
            import habana_frameworks

            results[name]["fused_sdpa_heads"] = [c.kwargs["q_heads"] for c in habana_frameworks.calls_named("hpex.kernels.FusedSDPA")]  # fmt: skip
            results[name]["hccl"] = sorted({n for n in habana_frameworks.names() if n.startswith("distributed.hccl.")})
            habana_frameworks.reset()
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    tiny.leave_process()


if __name__ == "__main__":
    main()
