"""A plain transformers checkpoint from an FSDP2 model, streamed piece by piece: no rank holds the whole model.

Under FSDP2 (``fully_shard``) each parameter is a DTensor holding 1/world of its rows. transformers saves such a
model only after gathering its whole state dict on rank 0 (accelerate's ``get_state_dict``), and its
``save_pretrained`` then touches the sharded parameters on rank 0 alone (the tied-weight check): over gloo that
collective on one rank kills the job. Here every rank walks the same tensors in the same order; rank 0 writes each
tensor's rows into the safetensors file as they come: its own shard, then each other rank's, sent to it alone
(FSDP2 splits dim 0 as ``torch.chunk`` does). Rank 0's extra memory is one shard of one tensor, the other ranks'
none; tensors sharded otherwise (a 2-D mesh) are gathered whole (``full_tensor``). The files, their split at
``max_shard_size`` and the index are those ``save_pretrained`` writes, so ``from_pretrained`` loads them without
optimum_gaudi and without torch.distributed.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..devices.host_memory import freed_memory_kept
from ..errors import UserError

# The safetensors dtype names (https://github.com/huggingface/safetensors, the file format's "dtype" field).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# save_pretrained's default split (transformers 5): one file up to this size.
DEFAULT_MAX_SHARD_SIZE = "50GB"

StateFilter = Callable[[dict[str, Any]], dict[str, Any]]


def is_sharded(model: nn.Module) -> bool:
    """True where the model's parameters are FSDP2 shards (DTensors), which ``save_pretrained`` cannot save."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor), on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu")


def _rank0_writes_alone(is_main_process: bool, group: Any) -> bool:
    """True (on every rank) where global rank 0 is the only writer: then the other ranks send rank 0 their rows;
    otherwise (``save_on_each_node``) every tensor is gathered whole on every rank."""
    import torch.distributed as dist

    flags = torch.tensor([int(is_main_process), int(is_main_process and dist.get_rank() == 0)])
    dist.all_reduce(flags, group=group)
    return flags.tolist() == [1, 1]


def _pieces(tensor: torch.Tensor, is_main_process: bool, rank0_alone: bool, group: Any) -> Iterator[torch.Tensor]:
    """The tensor as consecutive row blocks, yielded on the writing ranks; a collective every rank runs in turn.
    The rows travel between host memories, over the gloo group (the accelerator's backend takes no CPU tensor)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    row_sharded = (
        rank0_alone
        and isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
        and tensor.device_mesh.mesh.tolist()[0] == 0
    )
    if not row_sharded:
        whole = _full(tensor)
        if is_main_process:
            yield whole
        return
    ranks = tensor.device_mesh.mesh.tolist()
    rows, per = tensor.shape[0], -(-tensor.shape[0] // len(ranks))  # torch.chunk's sizes: ceil, the rest last
    local = tensor.to_local().detach().to("cpu").contiguous()
    if not is_main_process:
        if local.shape[0]:
            dist.send(local, dst=0, group=group)
        return
    yield local
    for index, source in enumerate(ranks[1:], start=1):
        count = max(0, min(per, rows - index * per))
        if count:
            piece = torch.empty((count, *tensor.shape[1:]), dtype=tensor.dtype)
            dist.recv(piece, src=source, group=group)
            yield piece
            del piece  # before the next one is received


def is_peft(model: nn.Module) -> bool:
    """A peft model (saved as its adapters)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def saves(model: nn.Module) -> bool:
    """A transformers model (its weights and config) or a peft model (its adapters): what this module saves."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel) or is_peft(model)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A peft model's adapter weights, gathered on every rank and keyed as in ``model.state_dict()``: what peft's
    ``save_pretrained(state_dict=...)`` saves (adapters are small; the frozen base stays sharded)."""
    from peft.utils import get_peft_model_state_dict

    local = model.state_dict()
    kept = {id(value) for value in get_peft_model_state_dict(model, state_dict=dict(local)).values()}
    return {name: _full(value) for name, value in local.items() if id(value) in kept}


def save_pretrained(
    model: nn.Module,
    output_dir: str,
    *,
    is_main_process: bool,
    host_group: Any,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    state_filter: StateFilter | None = None,
) -> None:
    """``model.save_pretrained(output_dir)`` for an FSDP2 model; every rank calls it, ``is_main_process`` writes.

    ``state_filter`` drops entries of the state dict that are not to be saved (the trainer's fp8 scaling state).
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    local = model.state_dict()
    if state_filter is not None:
        local = state_filter(local)
    for ignored in model._keys_to_ignore_on_save or ():
        local.pop(ignored, None)
    specs = _specs(model, local)
    check_saves(model, specs)
    pattern = SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(specs, filename_pattern=pattern, max_shard_size=max_shard_size)

    if is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        _save_config(model, output_dir)
        _remove_stale_weights(output_dir, set(split.filename_to_tensors))
    rank0_alone = _rank0_writes_alone(is_main_process, host_group)
    # each piece is host memory, on every device: given back when dropped, else glibc keeps a heap block of each
    # size below 32 MiB and the next piece, memalign'ed, may not fit in it (two 31 MiB rows grew rank 0 by 65 MB)
    with freed_memory_kept(returned=True):
        for filename, names in split.filename_to_tensors.items():
            pieces = ((name, _pieces(local[name], is_main_process, rank0_alone, host_group)) for name in names)
            if is_main_process:
                _write_safetensors(os.path.join(output_dir, filename), {n: specs[n] for n in names}, pieces)
            else:
                for _, sent in pieces:  # this rank's part of each tensor
                    for _ in sent:
                        pass
    if is_main_process and split.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        with open(os.path.join(output_dir, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


class WeightConversionError(UserError, NotImplementedError):
    """A model that transformers saves under other weight names than it trains them, under FSDP2."""


def check_saves(model: nn.Module, specs: dict[str, torch.Tensor] | None = None) -> None:
    """Raise :class:`WeightConversionError` where ``save_pretrained`` here cannot write this model (transformers 5
    converts some models' weights back to their checkpoint layout when it saves them, as Mixtral's experts): the
    trainer asks as it is built, on the names alone, before a run that could not save its result."""
    if not saves(model) or is_peft(model):  # adapters keep their names
        return
    specs = _specs(model, model.state_dict()) if specs is None else specs
    if _saved_names(model, specs) != specs.keys():
        raise WeightConversionError(
            f"--fsdp cannot save a {type(model).__name__.removeprefix('FSDP')}: transformers saves its weights"
            " converted to another layout (a weight conversion), which the FSDP save does not do yet;"
            " train it without --fsdp, or train LoRA adapters of it."
        )


def _specs(model: nn.Module, local: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict's shapes as meta tensors, less the tied weights ``save_pretrained`` drops: transformers finds
    tied weights of meta tensors by their parameters, touching no shard."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    specs = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in local.items()}
    return remove_tied_weights_from_state_dict(specs, model)


def _saved_names(model: nn.Module, specs: dict[str, torch.Tensor]) -> set[str]:
    """The names ``save_pretrained`` gives these tensors in the file (transformers 5 converts some models' weights
    back to their checkpoint layout; 4.57 saves every weight under its own name)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return set(specs)
    return set(revert_weight_conversion(model, dict(specs)))


def _save_config(model: nn.Module, output_dir: str) -> None:
    """The config (dtype and architecture as ``save_pretrained`` records them) and the generation config."""
    from transformers.dynamic_module_utils import custom_object_save

    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    if model.is_remote_code():
        custom_object_save(model, output_dir, config=model.config)
    model.config.save_pretrained(output_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(output_dir)


def _remove_stale_weights(output_dir: str, keep: set[str]) -> None:
    """The weight files of an earlier save that this one does not replace, of either layout: ``from_pretrained``
    loads a ``model.safetensors`` before an index, so one left beside a new split save would be loaded instead of
    it (``save_pretrained`` removes stale shard files only)."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    patterns = [r"model-\d{5}-of-\d{5}\.safetensors", re.escape(SAFE_WEIGHTS_NAME)]
    if keep == {SAFE_WEIGHTS_NAME}:  # one file now: an index left would name files that are gone
        patterns.append(re.escape(SAFE_WEIGHTS_INDEX_NAME))
    stale = re.compile("|".join(patterns))
    for name in os.listdir(output_dir):
        if stale.fullmatch(name) and name not in keep:
            os.remove(os.path.join(output_dir, name))


def _write_safetensors(
    path: str, specs: dict[str, torch.Tensor], tensors: Iterable[tuple[str, Iterable[torch.Tensor]]]
) -> None:
    """A safetensors file whose header comes from the shapes (``specs``) and whose tensors are appended as
    ``tensors`` yields their row blocks (in ``specs``' order), each block dropped before the next arrives."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, spec in specs.items():
        size = spec.numel() * spec.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape)}
        header[name]["data_offsets"] = [offset, offset + size]
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the tensors start 8-byte aligned, as safetensors writes them
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, pieces in tensors:
            start, end = header[name]["data_offsets"]
            for piece in pieces:
                if piece.dtype != specs[name].dtype:
                    raise RuntimeError(f"{name}: got {piece.dtype}, planned {specs[name].dtype}")
                f.write(piece.contiguous().reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
                del piece  # before the next one arrives
            if f.tell() - 8 - len(encoded) != end:
                raise RuntimeError(f"{name}: wrote {f.tell() - 8 - len(encoded) - start} bytes, planned {end - start}")
