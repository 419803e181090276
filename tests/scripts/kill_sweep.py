"""SIGKILL run_clm.py at random moments of its saves, again and again, and check each resume.

    python tests/scripts/kill_sweep.py --kills 30 [--workdir DIR] [--seed 0]

Each round starts run_clm.py (tiny GPT-2, a checkpoint every step, ``--save_total_limit 3``,
``--resume_from_checkpoint true`` once one exists), waits until a save is under way (its staging directory
appears), sleeps a random 0 to --max_delay seconds and kills the process with SIGKILL ("during a save": a
staging directory exists at that moment). After each kill the newest complete checkpoint (the one resume
picks) must load; the next round must resume from it and get as far as its own next save. Prints the counts
as one JSON line: kills, kills during a save, unusable newest checkpoints, failed resumes.
Slow (each round starts a Python with torch and transformers): the pytest version forks instead
(tests/integration/checkpoints/test_checkpoints_killed_or_on_a_full_disk.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch
from transformers.trainer_callback import TrainerState

from optimum_gaudi.checkpoints import STAGING_PREFIX, latest_complete_checkpoint, list_checkpoints

RUN_CLM = Path(__file__).resolve().parents[2] / "examples" / "language-modeling" / "run_clm.py"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def loadable(checkpoint: Path) -> bool:
    try:
        TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        safetensors.torch.load_file(checkpoint / "model.safetensors")
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            torch.load(checkpoint / name, weights_only=False)
        return True
    except Exception:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_delay", type=float, default=0.5, help="seconds after a save begins, at most")
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="kill-sweep-"))
    train = work / "train.txt"
    train.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(24)) for _ in range(400)))
    out = work / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    base = [
        sys.executable, str(RUN_CLM), "--model_type", "gpt2", "--config_overrides", "n_layer=1,n_embd=32,n_head=2",
        "--train_file", str(train), "--do_train", "--max_steps", "100000", "--save_steps", "1", "--block_size", "32",
        "--per_device_train_batch_size", "2", "--report_to", "none", "--disable_tqdm", "true", "--save_total_limit", "3",
        "--output_dir", str(out),
    ]  # fmt: skip
    counts = {"kills": 0, "during_save": 0, "unusable_newest": 0, "failed_resumes": 0, "resumes": 0}
    for _ in range(opts.kills):
        newest = latest_complete_checkpoint(out)
        command = base + (["--resume_from_checkpoint", "true"] if newest is not None else [])
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        before = {p.name for p in list_checkpoints(out)}
        to_publish = rng.randint(0 if newest is not None else 1, 2)  # a fresh start publishes one at least
        while process.poll() is None and len({p.name for p in list_checkpoints(out)} - before) < to_publish:
            time.sleep(0.01)
        while process.poll() is None and not (out.is_dir() and any(out.glob(f"{STAGING_PREFIX}*"))):
            time.sleep(0.002)  # until a save is under way
        if process.poll() is not None:
            counts["failed_resumes"] += 1
            print(process.stderr.read()[-2000:], file=sys.stderr)
            continue
        time.sleep(rng.uniform(0, opts.max_delay))  # saves follow each other: later moments hit later saves
        during = any(out.glob(f"{STAGING_PREFIX}*"))
        process.send_signal(signal.SIGKILL)
        process.wait()
        counts["kills"] += 1
        counts["during_save"] += during
        counts["resumes"] += newest is not None
        grew = {p.name for p in list_checkpoints(out)} - before
        if newest is not None and not grew and not during:
            counts["failed_resumes"] += 1  # resumed, yet never got to a save of its own
        newest = latest_complete_checkpoint(out)
        if newest is not None and not loadable(newest):
            counts["unusable_newest"] += 1
    print(json.dumps({**counts, "workdir": str(work)}))


if __name__ == "__main__":
    main()
