"""Checkpoints that survive a crash, and an output directory that never mixes two runs.

A checkpoint appears complete or not at all. The trainer writes ``checkpoint-N`` inside a staging directory
beside it (``OUTPUT_DIR/.staging-checkpoint-N/checkpoint-N``): every rank writes its part there (the main
process alone under DDP, every rank under DeepSpeed or FSDP). After a barrier the saving process lists every
file with its size in ``checkpoint_manifest.json``, fsyncs the files and directories, and renames the directory
to ``OUTPUT_DIR/checkpoint-N``: one atomic rename on one file system. A kill at any moment leaves no
``checkpoint-N`` or a complete one; staging leftovers are never resumed from, and are removed when the next run
starts (which also applies ``--save_total_limit`` to the checkpoints it resumes) and by the next save.

A checkpoint directory is *complete* when (see :func:`checkpoint_problem`): every file its manifest lists is
there with the size written (checkpoints of plain transformers have no manifest: this part is skipped), but for
the files of the saved model, which a user may save again (in shards, in another dtype) and which are judged by
what is there, with one warning on resume; ``trainer_state.json`` loads; model weights are there (safetensors
checked against their header, the shards an index names present and checked, torch files against their zip
directory); no file is empty. Resuming from the newest (``--resume_from_checkpoint true``)
skips incomplete ones with one warning, and rotation (``--save_total_limit``) never deletes the newest
complete checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .errors import UserError, exception_chain, quiet_logger

logger = logging.getLogger(__name__)

MANIFEST_NAME = "checkpoint_manifest.json"
TRAINER_STATE_NAME = "trainer_state.json"
STAGING_PREFIX = ".staging-"
MIN_FREE_BYTES = 1 << 20  # less than this free where --output_dir lives: the disk is full
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_STAGING_NAME = re.compile(rf"^{re.escape(STAGING_PREFIX)}(replaced-)?{PREFIX_CHECKPOINT_DIR}-\d+$")  # as we name them
# Model weights as transformers, PEFT, FSDP and DeepSpeed write them (any one is enough); the files in the order
# Trainer._load_from_checkpoint looks for them.
_WEIGHT_FILES = (
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
    has_weights = any((directory / name).is_file() for name in _WEIGHT_FILES) or any(
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


# ---- resuming -----------------------------------------------------------------------------------------------


def resume_arg(value: str | bool | None) -> str | bool | None:
    """``--resume_from_checkpoint true`` (or ``last``) means the newest checkpoint in --output_dir."""
    if isinstance(value, str) and value.strip().lower() in {"true", "last"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"false", "none", ""}:
        return None
    return value


# Set by torchrun's elastic agent in each worker: how many times the job was restarted after a rank died.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times ``optimum-gaudi launch --max_restarts`` has restarted this job (0: the first attempt)."""
    try:
        return max(int(os.environ.get(RESTART_COUNT_ENV, "0")), 0)
    except ValueError:
        return 0


def check_resume_before_data(args: Any, model: Any = None) -> None:
    """The resume problems an example finds before it reads or tokenizes any data (CheckpointError, one line):
    the checkpoint must exist and be complete, and (given the model) hold the same weights. The trainer checks
    again when training starts, for scripts that do not call this; the warnings are left to that check."""
    if not getattr(args, "do_train", True):
        return
    with quiet_logger(__name__):  # the trainer's own check warns later
        checkpoint = resolve_resume(getattr(args, "resume_from_checkpoint", None), args.output_dir)
    if checkpoint is not None and model is not None:
        check_weights_fit(model, checkpoint)


def resolve_resume(resume: str | bool | None, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint directory to resume from, checked complete; raise CheckpointError with the reason.

    In a job restarted after a rank died, the newest complete checkpoint in ``output_dir`` (the job's own
    progress) wins over the command line's choice, which only held for the first attempt."""
    resume = resume_arg(resume)
    restarts = restart_count()
    if restarts:
        found = latest_complete_checkpoint(output_dir)
        if found is not None:
            logger.warning("Restart %d of this job: resuming from %s.", restarts, found)
            return str(found)
    if resume is None or resume is False:
        return None
    if resume is True:
        found = latest_complete_checkpoint(output_dir)
        if found is None:
            holds = list_checkpoints(output_dir)
            what = f"only incomplete checkpoints ({', '.join(p.name for p in holds)})" if holds else "no checkpoint"
            raise CheckpointError(
                f"No valid checkpoint found in output directory ({output_dir}): --resume_from_checkpoint true, but "
                f"--output_dir {output_dir} holds {what}; drop --resume_from_checkpoint to start a new run."
            )
        _say_model_saved_again(found)
        return str(found)
    problem = checkpoint_problem(resume)
    if problem:
        raise CheckpointError(
            f"Can't find a valid checkpoint at {resume}: --resume_from_checkpoint {resume} {problem}; pass a complete "
            "checkpoint-N directory, or 'true' for the newest one in --output_dir."
        )
    _say_model_saved_again(resume)
    return str(resume)


def _say_model_saved_again(checkpoint: str | os.PathLike) -> None:
    changed = model_saved_again(checkpoint)
    if changed:
        logger.warning(
            "%s: its model was saved again after the checkpoint was written (%s differ from its manifest); "
            "the weights there are complete: resuming from them.",
            Path(checkpoint).name,
            ", ".join(changed),
        )


def _tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape of one weight file: a safetensors header, or a memory-mapped torch file whose tensor
    data is never read."""
    if path.suffix == ".safetensors":
        return safetensors_shapes(path)
    import torch

    return {
        name: list(t.shape) for name, t in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()
    }


def saved_weights(checkpoint: str | os.PathLike) -> tuple[str, dict[str, list[int]]] | None:
    """(the weight file resuming loads, tensor name -> shape of all it holds, shards included); None for weights
    only DeepSpeed or FSDP read."""
    directory = Path(checkpoint)
    name = next((n for n in _WEIGHT_FILES if (directory / n).is_file()), None)
    if name is None:
        return None
    if not name.endswith(".index.json"):
        return name, _tensor_shapes(directory / name)
    shards = sorted(set(json.loads((directory / name).read_text(encoding="utf-8"))["weight_map"].values()))
    return name, {k: v for shard in shards for k, v in _tensor_shapes(directory / shard).items()}


def _expected_weights(model: Any, adapter: bool) -> tuple[dict[str, list[int]], dict[str, set[str]]]:
    """(name -> shape of what resuming loads into ``model``, name -> the names of its tensor: a full save keeps one
    name of tied weights, as GPT-2's lm_head is its embedding). Adapter files hold the trainable state of a PEFT
    model, none for a model without adapters."""
    if adapter:
        if not hasattr(model, "peft_config"):
            return {}, {}
        from peft import get_peft_model_state_dict

        shapes = {n: list(t.shape) for n, t in get_peft_model_state_dict(model).items()}
        return shapes, {n: {n} for n in shapes}
    state = model.state_dict(keep_vars=True)  # the parameters themselves: ZeRO-3 keeps their shape in ds_shape
    names: dict[int, set[str]] = {}
    for name, tensor in state.items():
        names.setdefault(id(tensor), set()).add(name)
    shapes = {n: list(getattr(t, "ds_shape", t.shape)) for n, t in state.items()}
    return shapes, {n: names[id(t)] for n, t in state.items()}


def _listed(names: list[str]) -> str:
    return f"{len(names)} weight(s) ({names[0]}{', ...' if len(names) > 1 else ''})"


def check_weights_fit(model: Any, checkpoint: str | os.PathLike) -> None:
    """Raise CheckpointError unless the checkpoint holds the weights of ``model``, names and shapes (read from
    headers): transformers would load another model's weights in part, or fail with a page of traceback.

    Parameters alone decide: a buffer (a counter, an observer's statistics) may change in training, its shape
    included, and the module loads it its own way (torch.ao observers resize theirs when loading)."""
    found = None if model is None else saved_weights(checkpoint)
    if found is None:
        return
    file, saved = found
    adapter = file.startswith("adapter_")
    expected, aliases = _expected_weights(model, adapter)
    buffers = set() if adapter else {name for name, _ in model.named_buffers(remove_duplicate=False)}
    ignored = buffers | set(getattr(model, "_keys_to_ignore_on_save", None) or ())  # + never saved (Marian's)
    extra = sorted(saved.keys() - expected.keys() - ignored)
    missing = [n for n in expected if not aliases[n] & saved.keys() and n not in ignored]
    resized = [n for n in expected if n in saved and n not in buffers and expected[n] != list(saved[n])]
    if resized:
        name = resized[0]
        detail = f"{name} is {'x'.join(map(str, saved[name]))} there and {'x'.join(map(str, expected[name]))} here"
    elif extra or missing:
        detail = f"it has {_listed(extra)} this model lacks" if extra else f"it lacks {_listed(missing)} of this model"
    else:
        return
    settings = "adapter settings (--lora_rank, ...)" if adapter else "model configuration"
    raise CheckpointError(
        f"--resume_from_checkpoint {checkpoint} holds another model ({file}): {detail}; "
        f"resume with the {settings} it was trained with."
    )


# ---- writing ------------------------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path) -> None:
    """List every file and its size, and make all of it durable: files, then the manifest, then directories."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    for path in files:
        _fsync(path)
    listed = {str(p.relative_to(directory)): p.stat().st_size for p in files}
    manifest = directory / MANIFEST_NAME
    with manifest.open("w", encoding="utf-8") as f:
        json.dump({"files": listed}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({p.parent for p in files} | {directory}, key=lambda p: len(p.parts), reverse=True):
        _fsync(sub)


def remove_staging_leftovers(run_dir: str | os.PathLike) -> None:
    """Staging directories of saves that never finished (the process was killed): ours only, by their names."""
    directory = Path(run_dir)
    if directory.is_dir():
        for leftover in directory.iterdir():
            if _STAGING_NAME.match(leftover.name) and leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)


def tidy_before_resuming(run_dir: str | os.PathLike, limit: int | None, resumed: str | None) -> None:
    """What a kill right after a publish leaves (its staging directory; with ``--save_total_limit``, one checkpoint
    too many, as rotation follows the publish) tidied when the next run starts, not at its first save. Checkpoints
    are rotated only when the run resumes (they are its own); the one it resumes from, the best one its state
    names and the newest complete one are kept."""
    remove_staging_leftovers(run_dir)
    if resumed is None:
        return
    try:
        best = TrainerState.load_from_json(os.path.join(resumed, TRAINER_STATE_NAME)).best_model_checkpoint
    except (OSError, ValueError):
        best = None
    rotate_checkpoints(run_dir, limit, keep={resumed, best})


def publish(staged: Path, final: Path) -> None:
    """Rename the staged checkpoint into place. One that exists already (the same step saved again) is moved
    aside first: a kill between the two renames leaves the previous complete checkpoint to resume from."""
    old = final.parent / f"{STAGING_PREFIX}replaced-{final.name}"
    if final.exists():
        os.replace(final, old)
    os.replace(staged, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def rotate_checkpoints(run_dir: str | os.PathLike, limit: int | None, keep: set[str | None]) -> None:
    """Keep at most ``limit`` checkpoints: delete incomplete ones first, then the oldest; never ``keep`` nor the
    newest complete one."""
    if not limit or limit <= 0:
        return
    checkpoints = list_checkpoints(run_dir)
    if len(checkpoints) <= limit:
        return
    complete = [p for p in checkpoints if checkpoint_problem(p) is None]
    protected = {str(Path(k).resolve()) for k in keep if k} | ({str(complete[-1].resolve())} if complete else set())
    incomplete = [p for p in checkpoints if p not in complete]
    remaining = len(checkpoints)
    for candidate in incomplete + complete:
        if remaining <= limit:
            break
        if str(candidate.resolve()) not in protected:
            logger.info("Deleting %s (--save_total_limit %d).", candidate, limit)
            shutil.rmtree(candidate, ignore_errors=True)
            remaining -= 1


def disk_full(path: str | os.PathLike, exc: BaseException | None = None) -> bool:
    """Whether a failure is the disk being full: ENOSPC somewhere in the chain, or almost no space left.

    torch.save reports a full disk as an opaque RuntimeError, hence the look at the free space."""
    for cause in exception_chain(exc):
        if getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(cause):
            return True
    return free_bytes(path) < MIN_FREE_BYTES


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    try:
        return shutil.disk_usage(_nearest_existing(Path(path))).free
    except OSError:
        return 1 << 62  # unknown: not full


class DiskFullError(UserError, OSError):
    """Saving failed because the disk is full."""


@contextlib.contextmanager
def disk_full_is_user_error(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn a failure while writing ``what`` under ``path`` into one line when the disk is full."""
    try:
        yield
    except Exception as e:
        if isinstance(e, UserError) or not disk_full(path, e):
            raise
        raise DiskFullError(
            f"no space left on the device of {path} while saving {what} ({free_bytes(path) // 1024} KiB free); "
            "free some space or choose another --output_dir, then resume with --resume_from_checkpoint true."
        ) from e


def _publish_checkpoint(staged: Path, run_dir: Path, state: Any, limit: int | None, resave_state: bool) -> None:
    """Manifest, atomic rename into ``run_dir``, then ``save_total_limit``. With ``resave_state`` the saved
    trainer state is first rewritten, so that it names the best checkpoint's final place."""
    final = run_dir / staged.name
    if resave_state and (staged / TRAINER_STATE_NAME).is_file():
        state.save_to_json(str(staged / TRAINER_STATE_NAME))
    write_manifest(staged)
    publish(staged, final)
    rotate_checkpoints(run_dir, limit, keep={str(final), state.best_model_checkpoint})


def _name_earlier_best(run_dir: Path, state: Any, args: Any) -> None:
    """Trainer._save_checkpoint names the best checkpoint when ``checkpoint-{best_global_step}`` exists where it
    saves; it saves into the staging root, where only this step's checkpoint is. A best checkpoint saved
    earlier (its step saved before the evaluation that made it the best) is looked for in ``run_dir`` here,
    under the same conditions, so that rotation keeps it and the end of training loads it."""
    step = getattr(state, "best_global_step", None)
    if not step or step == state.global_step or args.save_strategy == "no":
        return
    earlier = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    if earlier.exists():
        state.best_model_checkpoint = str(earlier)


@contextlib.contextmanager
def staged_checkpoint(run_dir: str | os.PathLike, state: Any, args: Any, barrier: Callable[[], None]) -> Iterator[Path]:
    """Yield the staging root to write ``checkpoint-{state.global_step}`` into, as if it were ``run_dir``; when
    the body is done publish the checkpoint atomically, then apply ``args.save_total_limit``.

    Every rank enters and leaves together (``barrier``, e.g. ``accelerator.wait_for_everyone``); the process with
    ``args.should_save`` (the main one, or each node's with save_on_each_node) publishes. A failure removes the
    staging directory; a full disk is reported as one line (DiskFullError).
    """
    run_dir = Path(run_dir)
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging_root = run_dir / f"{STAGING_PREFIX}{name}"
    saver = bool(args.should_save)
    if saver:
        remove_staging_leftovers(run_dir)
    barrier()
    _name_earlier_best(run_dir, state, args)
    try:
        with disk_full_is_user_error(run_dir, name):
            yield staging_root
            best = state.best_model_checkpoint
            moved_best = best is not None and Path(best).parent == staging_root
            if moved_best:  # transformers found the best checkpoint where it wrote this one: name its final place
                state.best_model_checkpoint = str(run_dir / Path(best).name)
            barrier()
            if saver and (staging_root / name).is_dir():
                _publish_checkpoint(staging_root / name, run_dir, state, args.save_total_limit, moved_best)
    finally:
        if saver:
            shutil.rmtree(staging_root, ignore_errors=True)
    barrier()


# ---- the output directory -----------------------------------------------------------------------------------


def check_output_dir(args: Any) -> None:
    """Before anything is written: ``--output_dir`` must be a writable directory with room, and must not hold
    another run's checkpoints or trained model (a run with --save_strategy no leaves no checkpoint) unless the
    user says to resume them or to overwrite them.

    ``args`` is the training arguments (``output_dir``, ``do_train``, ``resume_from_checkpoint``,
    ``overwrite_output_dir``); with ``--overwrite_output_dir`` GaudiTrainer.train deletes the old checkpoints.
    """
    out = Path(args.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {out} is a file, not a directory; choose another --output_dir.")
    existing = _nearest_existing(out)
    if not existing.is_dir():
        raise UserError(f"--output_dir {out}: {existing} is a file, not a directory; choose another --output_dir.")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".optimum-gaudi-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"--output_dir {out} is not writable ({e.strerror or e} in {existing}); choose another --output_dir."
        ) from None
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"--output_dir {out}: the disk is full ({free // 1024} KiB free); free some space or choose another."
        )
    if not getattr(args, "do_train", True) or resume_arg(getattr(args, "resume_from_checkpoint", None)) is not None:
        return
    if restart_count():  # a job restarted after a rank died: these checkpoints are its own, it resumes them
        return
    if getattr(args, "overwrite_output_dir", False):
        return
    previous = list_checkpoints(out)
    if previous:
        raise UserError(
            f"--output_dir {out} already holds checkpoints of a run ({_span(previous)}): add "
            "--resume_from_checkpoint true to continue it, or --overwrite_output_dir to start over (its checkpoints "
            "are deleted)."
        )
    model = [name for name in (TRAINER_STATE_NAME, *_WEIGHT_FILES) if (out / name).is_file()]
    if model:
        raise UserError(
            f"--output_dir {out} already holds a trained model ({', '.join(model)}): choose another --output_dir, "
            "or add --overwrite_output_dir to replace it."
        )


def remove_previous_checkpoints(output_dir: str | os.PathLike) -> None:
    """--overwrite_output_dir: the previous run's checkpoints go when the new run starts training, so that a later
    resume cannot pick one of them (and a typo found before training deletes nothing)."""
    previous = list_checkpoints(output_dir)
    if previous:
        logger.warning("--overwrite_output_dir: deleting %d checkpoint(s) of the previous run.", len(previous))
    for path in previous:
        shutil.rmtree(path)
    remove_staging_leftovers(output_dir)


class OutputDirGuard(TrainerCallback):
    """Leaves ``--output_dir`` as it was when a run fails before training begins, so a bad input never leaves a
    half-filled directory behind. Use it as a context manager around building the trainer and training, and
    add it to the trainer's callbacks: from ``on_train_begin`` on, what is written is the run's own (complete
    checkpoints, logs) and is kept; a directory the run made and left empty (its first save failed, a full
    disk) still goes."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.output_dir = Path(output_dir).expanduser()
        self.enabled = enabled
        self._restores = enabled  # the process that saves restores the directory; the others leave it
        self._before: set[str] | None = None
        self._existed = False

    def __enter__(self) -> OutputDirGuard:
        self._existed = self.output_dir.is_dir()
        self._before = set(os.listdir(self.output_dir)) if self._existed else set()
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        self.enabled = False

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or not self._restores or not self.output_dir.is_dir():
            return
        if self.enabled:
            for name in set(os.listdir(self.output_dir)) - (self._before or set()):
                path = self.output_dir / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if not self._existed:
            with contextlib.suppress(OSError):
                self.output_dir.rmdir()  # only if empty: nothing of the run is lost


# weights_only's unpickler itself could be bypassed up to this torch release (CVE-2026-24747; docs/security.md)
LAST_UNSAFE_WEIGHTS_ONLY_TORCH = (2, 9, 1)
_PICKLED_STATE = ("optimizer.pt", "scheduler.pt", "scaler.pt", "pytorch_model.bin")


def warn_if_pickles_are_unsafe_here(checkpoint: str | os.PathLike) -> None:
    """One warning when this checkpoint's pickles will be loaded by a torch whose ``weights_only`` loader is known
    to be bypassable: a checkpoint from someone else could run code here."""
    import torch

    release = tuple(int(part) for part in re.findall(r"\d+", torch.__version__.split("+")[0])[:3])
    if release > LAST_UNSAFE_WEIGHTS_ONLY_TORCH:
        return
    directory = Path(checkpoint)
    pickles = sorted(p.name for p in directory.iterdir() if p.name in _PICKLED_STATE or p.name.startswith("rng_state"))
    if pickles:
        logger.warning(
            "Resuming from %s loads pickles (%s) with torch %s, whose weights_only loader can be bypassed "
            "(CVE-2026-24747, fixed after torch 2.9.1): resume only from checkpoints you trust, or upgrade torch.",
            directory,
            ", ".join(pickles),
            torch.__version__,
        )
