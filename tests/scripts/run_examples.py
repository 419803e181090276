"""Run example scripts one after the other in the same launched processes, as a user runs several command lines in a
session: `run_examples.py OUT.json RUNS.json`, RUNS.json mapping a run's name to {"script": a file of examples/,
"argv": its arguments}. Each rank writes {name: {"losses": the logged training losses, "eval_loss": ...}} to
OUT.json.RANK (read from the run's trainer_state.json, which rank 0 writes, and the process's own log).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support.py
from support import EXAMPLES, load_example  # noqa: E402


def output_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--output_dir") + 1])


def main() -> None:
    out, runs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    torch.set_num_threads(1)
    results = {}
    for name, run in runs.items():
        load_example(next(EXAMPLES.rglob(run["script"]))).main(run["argv"])
        state = json.loads((output_dir(run["argv"]) / "trainer_state.json").read_text())
        history = state["log_history"]
        results[name] = {
            "losses": [entry["loss"] for entry in history if "loss" in entry],
            "grad_norms": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
            "eval_loss": next((entry["eval_loss"] for entry in history if "eval_loss" in entry), None),
        }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    Path(f"{out}.{rank}").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
