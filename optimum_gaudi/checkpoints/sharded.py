"""FSDP's sharded checkpoints: the ``torch.distributed.checkpoint`` (DCP) folders every rank writes its shards into.

With ``state_dict_type`` SHARDED_STATE_DICT, accelerate saves the model into ``pytorch_model_fsdp_0/`` and the
optimizer into ``optimizer_0/``: one ``__R_0.distcp`` file per rank and a ``.metadata`` file (written by rank 0
once every rank wrote its part) naming each tensor's global shape and the byte range of each shard. The
metadata is read here to tell a complete folder (every shard file there, long enough for the ranges it holds)
and the model it holds (tensor names and global shapes), before torch loads anything. DCP reshards on load, so
a checkpoint saved by N processes resumes on any number of processes that run FSDP.

torch reads ``.metadata`` with a plain ``pickle.load``. It is read here with an unpickler that admits DCP's own
classes and a few torch and standard types only, so a ``.metadata`` naming anything else is refused before torch
loads it (docs/security.md).
"""

from __future__ import annotations

import os
import pathlib
import pickle
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

METADATA_NAME = ".metadata"
# accelerate's FSDP_MODEL_NAME and OPTIMIZER_NAME, each folder named <name>_<index>
MODEL_FOLDER_NAME, OPTIMIZER_FOLDER_NAME = "pytorch_model_fsdp", "optimizer"
MODEL_FOLDER = re.compile(rf"^{MODEL_FOLDER_NAME}(_\d+)?$")
_MODEL_KEY = "model."  # accelerate saves {"model": state_dict}: the tensors are named model.<parameter name>
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # its classes are plain data: dataclasses, enums
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a name -> torch layout lookup
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes of DCP's metadata, torch dtypes and the few other types its metadata holds, each by its
    own name (no dotted path through a module); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        import torch
        import torch.distributed.checkpoint.metadata as dcp_metadata

        found = getattr(dcp_metadata, name, None) if module == _METADATA_MODULE else None
        if "." not in name and (
            (module, name) in _SAFE_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
            or (isinstance(found, type) and found.__module__ == _METADATA_MODULE)
        ):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: Path) -> Any:
    """The DCP metadata of ``folder``; ValueError with a few words when it cannot be read safely."""
    try:
        with (folder / METADATA_NAME).open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise ValueError(f"{folder.name}/{METADATA_NAME} is not DCP metadata ({e})") from None
    except Exception as e:  # truncated, garbage: anything means unreadable
        raise ValueError(f"{folder.name}/{METADATA_NAME} is unreadable ({type(e).__name__})") from None
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise ValueError(f"{folder.name}/{METADATA_NAME} is not DCP metadata")
    return metadata


def dcp_folders(checkpoint: Path) -> list[Path]:
    """The DCP folders of a checkpoint (model and optimizer), by their metadata file."""
    return sorted(p.parent for p in checkpoint.glob(f"*/{METADATA_NAME}"))


def dcp_problem(folder: Path) -> str | None:
    """Why a DCP folder cannot be loaded, in a few words (a shard missing or shorter than its metadata says)."""
    try:
        metadata = read_metadata(folder)
    except ValueError as problem:
        return str(problem)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file():
            return f"{folder.name}/{name} is missing (a rank's shard)"
        if shard.stat().st_size < end:
            return f"{folder.name}/{name} is truncated ({shard.stat().st_size} bytes, its {METADATA_NAME} needs {end})"
    return None


def sharded_model_folder(checkpoint: str | pathlib.PurePath) -> Path | None:
    """The folder of a checkpoint's sharded model weights, if it has one."""
    found = sorted(p for p in Path(checkpoint).iterdir() if p.is_dir() and MODEL_FOLDER.match(p.name))
    return found[0] if found else None


def sharded_shapes(folder: Path) -> dict[str, list[int]]:
    """Parameter name -> global shape of the model a DCP folder holds, from its metadata alone."""
    shapes = {}
    for key, item in read_metadata(folder).state_dict_metadata.items():
        size = getattr(item, "size", None)
        if size is not None:
            shapes[key.removeprefix(_MODEL_KEY)] = list(size)
    return shapes


def sharded_resume_problem(checkpoint: str | pathlib.PurePath, fsdp_plugin: Any) -> str | None:
    """Why this run cannot load a checkpoint's sharded weights: it does not run FSDP (one process on a CPU, no
    --fsdp), or it saves full state dicts, which accelerate loads from another file. None when it can, or when
    the checkpoint has no sharded weights."""
    folder = sharded_model_folder(checkpoint)
    if folder is None:
        return None
    if fsdp_plugin is None:
        return (
            f"holds FSDP sharded weights ({folder.name}/), which only a run with --fsdp loads (FSDP reshards them "
            "to any number of processes; on CPU it needs 2 or more)"
        )
    if "SHARDED_STATE_DICT" not in str(getattr(fsdp_plugin, "state_dict_type", "")):
        return (
            f"holds FSDP sharded weights ({folder.name}/), which this run's fsdp_config state_dict_type "
            f"{getattr(fsdp_plugin.state_dict_type, 'name', fsdp_plugin.state_dict_type)} does not load: "
            'resume with "state_dict_type": "SHARDED_STATE_DICT"'
        )
    return None


def save_sharded_async(model: Any, optimizer: Any, checkpoint: str | os.PathLike, groups: list[Any]) -> list[Future]:
    """Start writing the model's and the optimizer's shards where accelerate writes them (``pytorch_model_fsdp_0/``,
    ``optimizer_0/``, the layout it loads), in the background: each state is copied to host memory now (training
    may go on and change it), then written by DCP's ``async_save`` on a thread. ``groups``: two process groups
    with a CPU backend, one per thread, apart from the one training all-reduces on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))
    parts = {
        f"{MODEL_FOLDER_NAME}_0": {"model": model_state},
        f"{OPTIMIZER_FOLDER_NAME}_0": {"optimizer": optimizer_state},
    }
    futures = []
    for (name, state), group in zip(parts.items(), groups, strict=True):
        folder = Path(checkpoint) / name
        folder.mkdir(parents=True, exist_ok=True)
        futures.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(folder), process_group=group))
    return futures
