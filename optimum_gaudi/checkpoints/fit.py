"""Whether a checkpoint holds the weights of the model it is to be loaded into: names and shapes, read from file
headers before anything is loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .complete import WEIGHT_FILES, CheckpointError, safetensors_shapes
from .sharded import sharded_model_folder, sharded_shapes


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
    """(the weight file resuming loads, tensor name -> shape of all it holds, shards included; for FSDP's sharded
    weights their DCP folder and the global shapes); None for weights only DeepSpeed or FSDP's other formats read."""
    directory = Path(checkpoint)
    name = next((n for n in WEIGHT_FILES if (directory / n).is_file()), None)
    if name is None:
        folder = sharded_model_folder(directory)
        return (f"{folder.name}/", sharded_shapes(folder)) if folder is not None else None
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
