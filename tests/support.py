"""What test files in several folders share: the repository's folders, and the real jobs they start with
`optimum-gaudi launch` (tests/ is on sys.path: conftest.py sits in it; tests/scripts put it there themselves).

Test files do not import each other: with pytest's default import mode, a test file's folder is on sys.path
only once pytest has collected it."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"
DATA = TESTS / "data"
EXAMPLES = REPO / "examples"

LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def job_environment() -> dict[str, str]:
    """This process's environment less the launcher's variables, with this checkout's optimum_gaudi first."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "optimum_gaudi", "launch", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# FSDP2's sharded checkpoints on a tiny Llama (tests/scripts/train_sharded.py): the sharded-checkpoint launches and
# the check for room before step 1 share them
SHARDED_SCRIPT = SCRIPTS / "train_sharded.py"
SHARDED_WRAP = '"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]'
SHARDED_FLAGS = (
    "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1", "--seed", "0",
    "--report_to", "none", "--disable_tqdm", "true", "--fsdp", "full_shard auto_wrap",
)  # fmt: skip


def checkpointing_trainer(out: Path, callbacks=(), eval_dataset=None, **flags):
    """A GaudiTrainer on the tiny GPT-2 that saves a checkpoint every step (the crash-safe checkpoint tests)."""
    import tiny

    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

    args = GaudiTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
        disable_tqdm=True, logging_steps=1, seed=0, **{"save_strategy": "steps", "save_steps": 1, **flags},
    )  # fmt: skip
    return GaudiTrainer(
        model=tiny.gpt2(), args=args, train_dataset=tiny.lm_data(), eval_dataset=eval_dataset, callbacks=list(callbacks)
    )


def load_example(path: Path, prefix: str = "example"):
    """An example script imported as a module (once per process), its folder and language-modeling/ (whose
    helpers every example imports) on sys.path, as when it runs."""
    for folder in (path.parent, EXAMPLES / "language-modeling"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    name = f"{prefix}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]
