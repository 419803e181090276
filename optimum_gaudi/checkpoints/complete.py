"""What a checkpoint is, and when it is complete enough to resume from.

A checkpoint directory is *complete* when (see :func:`checkpoint_problem`): every file its manifest lists is
there with the size written (checkpoints of plain transformers have no manifest: this part is skipped), but for
the files of the saved model, which a user may save again (in shards, in another dtype) and which are judged by
what is there, with one warning on resume; ``trainer_state.json`` loads; model weights are there (safetensors
checked against their header, the shards an index names present and checked, torch files against their zip
directory, sharded DCP folders against their ``.metadata``); no file is empty. Resuming from the newest
(``--resume_from_checkpoint true``) skips incomplete ones with one warning, and rotation (``--save_total_limit``)
never deletes the newest complete checkpoint.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import UserError
from .sharded import METADATA_NAME, dcp_problem

logger = logging.getLogger(__name__)

MANIFEST_NAME = "checkpoint_manifest.json"
TRAINER_STATE_NAME = "trainer_state.json"
STAGING_PREFIX = ".staging-"
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
STAGING_NAME = re.compile(rf"^{re.escape(STAGING_PREFIX)}(replaced-)?{PREFIX_CHECKPOINT_DIR}-\d+$")  # as we name them
# Model weights as transformers, PEFT, FSDP and DeepSpeed write them (any one is enough); the files in the order
# Trainer._load_from_checkpoint looks for them.
WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
_WEIGHT_PATTERNS = ("global_step*", "pytorch_model_fsdp*", "*/adapter_model.safetensors", "*/adapter_model.bin")
# What save_pretrained writes. A model saved again into a checkpoint (in shards, in another dtype) replaces these
# files, so they are judged by what is there (complete weights, a config that reads) and not by the manifest.
_WEIGHT_NAME = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
_MODEL_CONFIGS = ("config.json", "generation_config.json", "adapter_config.json")


class CheckpointError(UserError, ValueError):
    """A checkpoint to resume from that is missing, incomplete or does not fit the model. A ValueError whose
    message starts with transformers' own words for the same mistake (Trainer.train's, _load_from_checkpoint's),
    which code and tests written for transformers.Trainer match on; ours follow."""


# ---- what is complete ---------------------------------------------------------------------------------------


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N for a directory named ``checkpoint-N``, else None (staging directories included)."""
    found = _CHECKPOINT_NAME.match(Path(path).name)
    return int(found.group(1)) if found else None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` directories of ``output_dir``, oldest step first; complete or not."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def _span(checkpoints: list[Path]) -> str:
    names = [p.name for p in checkpoints]
    return ", ".join(names) if len(names) <= 3 else f"{names[0]}, ..., {names[-1]}"


class _HeaderProblem(ValueError):
    pass


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(length of the JSON header, the header) of a safetensors file; _HeaderProblem if it has none."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _HeaderProblem(f"{path.name} is truncated ({size} bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > size - 8:
            raise _HeaderProblem(f"{path.name} is truncated ({size} bytes, its header alone needs {length + 8})")
        try:
            return length, json.loads(f.read(length))
        except ValueError:
            raise _HeaderProblem(f"{path.name} has an unreadable header") from None


def _safetensors_problem(path: Path) -> str | None:
    """Truncation shows as a file shorter than its header says."""
    try:
        length, header = _safetensors_header(path)
    except _HeaderProblem as problem:
        return str(problem)
    size = path.stat().st_size
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        return f"{path.name} is truncated ({size} bytes, its header describes {8 + length + end})"
    return None


def safetensors_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """Tensor name -> shape, read from a safetensors header alone (no tensor is loaded)."""
    _, header = _safetensors_header(Path(path))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def _saved_model_file(relative: str) -> bool:
    name = Path(relative).name
    return bool(_WEIGHT_NAME.match(name)) or name in _MODEL_CONFIGS


def _manifest(directory: Path) -> dict[str, int]:
    """File -> size as written; ValueError when the manifest is unreadable."""
    try:
        listed = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{MANIFEST_NAME} is unreadable") from None
    if not isinstance(listed, dict):
        raise ValueError(f"{MANIFEST_NAME} is unreadable")
    return listed


def model_saved_again(checkpoint: str | os.PathLike) -> list[str]:
    """The files of the saved model (weights, configs) that differ from the checkpoint's manifest: missing, of
    another size, or new. Empty for a checkpoint without a (readable) manifest."""
    directory = Path(checkpoint)
    try:
        listed = _manifest(directory)
    except ValueError:
        return []
    changed = {
        relative
        for relative, size in listed.items()
        if _saved_model_file(relative)
        and not ((directory / relative).is_file() and (directory / relative).stat().st_size == size)
    }
    changed |= {p.name for p in directory.iterdir() if p.is_file() and _saved_model_file(p.name)} - listed.keys()
    return sorted(changed)


def _manifest_problem(directory: Path) -> str | None:
    try:
        listed = _manifest(directory)
    except ValueError as problem:
        return str(problem)
    for relative, size in listed.items():
        if _saved_model_file(relative):
            continue  # the model may have been saved again; what is there is checked below
        path = directory / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != size:
            return f"{relative} has {path.stat().st_size} bytes where {size} were written"
    return None


def _file_problem(path: Path, relative: str) -> str | None:
    if path.stat().st_size == 0:
        return f"{relative} is empty"
    if path.name == METADATA_NAME:  # a DCP folder of FSDP's shards: every rank's shard there, whole
        return dcp_problem(path.parent)
    if path.suffix == ".safetensors":
        return _safetensors_problem(path)
    if path.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(path):
        return f"{relative} is not a complete torch file"
    if path.suffix == ".json":
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return f"{relative} is not valid JSON"
        shards = content.get("weight_map", {}) if isinstance(content, dict) else {}
        absent = sorted({s for s in shards.values() if not (path.parent / s).is_file()})
        if absent:  # the index of sharded weights
            return f"{relative} names {absent[0]}, which is missing"
    return None


class _Inert:
    """Stands for every class a pickle names: reading it imports and runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return _Inert

    def persistent_load(self, pid: Any) -> None:
        return None


def _saved_only_model(directory: Path) -> bool:
    """Whether the checkpoint's training_args.bin (a torch-saved pickle, read inertly) says --save_only_model."""
    try:
        with zipfile.ZipFile(directory / "training_args.bin") as archive:
            pickled = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            args = _InertUnpickler(io.BytesIO(archive.read(pickled))).load()
    except Exception:  # absent or unreadable: nothing says the optimizer was left out on purpose
        return False
    state = getattr(args, "state", None)
    return isinstance(state, dict) and state.get("save_only_model") is True


def _missing_training_state(directory: Path) -> str | None:
    """'optimizer.pt or scheduler.pt' when a checkpoint lacks them: transformers resumes without them, silently,
    with a fresh optimizer and schedule. None with --save_only_model, and for DeepSpeed (global_step* holds both);
    FSDP writes optimizer.bin or optimizer_0/."""
    if any(directory.glob("global_step*")) or _saved_only_model(directory):
        return None
    found = {"optimizer.pt": any(directory.glob("optimizer*")), "scheduler.pt": (directory / "scheduler.pt").is_file()}
    return " or ".join(name for name, present in found.items() if not present) or None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint to resume from, in a few words; None when it is one."""
    directory = Path(path)
    if not directory.exists():
        return "does not exist"
    if not directory.is_dir():
        return "is a file, not a checkpoint directory"
    if not any(directory.iterdir()):
        return "is an empty directory"
    if (directory / MANIFEST_NAME).is_file():
        problem = _manifest_problem(directory)
        if problem:
            return problem
    inner = list_checkpoints(directory)
    hint = f" (it holds {_span(inner)}: pass {inner[-1]}, or --output_dir {directory} with 'true')" if inner else ""
    if not (directory / TRAINER_STATE_NAME).is_file():
        return f"has no {TRAINER_STATE_NAME}{hint}"
    try:
        TrainerState.load_from_json(str(directory / TRAINER_STATE_NAME))
    except Exception as e:  # invalid JSON, unknown keys, wrong types: anything means unusable
        return f"{TRAINER_STATE_NAME} is not a trainer state ({type(e).__name__})"
    has_weights = any((directory / name).is_file() for name in WEIGHT_FILES) or any(
        any(directory.glob(pattern)) for pattern in _WEIGHT_PATTERNS
    )
    if not has_weights:
        gone = [name for name in model_saved_again(directory) if _WEIGHT_NAME.match(Path(name).name)]
        return f"holds no model weights ({gone[0]} is missing)" if gone else "holds no model weights"
    missing = _missing_training_state(directory)
    if missing:
        return f"is a saved model, not a checkpoint: it has no {missing}{hint}"
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        problem = _file_problem(file, str(file.relative_to(directory)))
        if problem:
            return problem
    return None


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of ``output_dir``; newer incomplete ones are skipped with one warning."""
    skipped = []
    for candidate in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(candidate)
        if problem is None:
            if skipped:
                logger.warning("Skipping incomplete %s; resuming from %s.", "; ".join(skipped), candidate.name)
            return candidate
        skipped.append(f"{candidate.name} ({problem})")
    if skipped:
        logger.warning("Skipping incomplete %s.", "; ".join(skipped))
    return None
