"""``--context_parallel_size N``: each sequence split over N processes, attention whole (Ulysses sequence parallelism).

torch's context parallelism shards its own SDPA kernels only (it has no rule for the CPU's, nor for Gaudi's
FusedSDPA), so here the split sits around transformers' attention registry instead. The N ranks of a group train
the same batch, each on its contiguous 1/N of every sequence; everything but attention is per token and runs on the
slice. Before each attention layer an all-to-all turns the query/key/value slices [batch, heads, seq/N, dim] into
[batch, heads/N, seq, dim]: every rank attends over the whole sequence for 1/N of the heads with the model's own
kernel (``sdpa``, ``eager`` or ``gaudi_fused_sdpa``, FusedSDPA on a Gaudi), and the inverse all-to-all brings
the output back to the sequence slices. The backward of an all-to-all is the same all-to-all, so gradients reach
each rank's slice; summed over the group by the data-parallel averaging (DDP, FSDP, fast_ddp), with the token
count transformers divides by ``Trainer.get_cp_size()``, they are the whole batch's.

The data-parallel world is world/N: the sampler gives the ranks of a group the same batches. Labels are shifted
over the whole sequence before the split (transformers' ``shift_labels``), positions are global (RoPE), the
attention mask is built once over the whole sequence from the full padding mask and positions, as the model
would build it, and ``num_items_in_batch`` is counted on the full batch. A length that N does not divide is padded at
the end with tokens nothing attends to (causal) and no label. Evaluation is not split: each rank evaluates its
own batches whole, and ``get_cp_size()`` is 1 there, so its token count is not divided.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UserError
from ..seam import Named, Seam

# Each SequenceParallel registers its attention under this name and its own id: the local kernel behind it and
# the step being split are that trainer's, never another's of the same process. The entry stays while a model
# names it (the model runs it) and goes with the last such model (``release``).
ATTENTION_NAME = "gaudi_sequence_parallel"
# The kernels that take a whole sequence's heads and a transformers mask (or None for causal).
LOCAL_KERNELS = ("sdpa", "eager", "gaudi_fused_sdpa")
IGNORE_INDEX = -100


def _all_to_all(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    chunks = chunks.contiguous()  # before empty_like, which would keep a permuted layout the collective ignores
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received


def model_problem(model: nn.Module, size: int) -> str | None:
    """Why this transformers model cannot split its sequences over ``size`` ranks, in one line; None when it can."""
    flag = f"--context_parallel_size {size}"
    config = model.config
    kernel = getattr(config, "_attn_implementation", None) or "eager"
    if kernel not in LOCAL_KERNELS and not kernel.startswith(ATTENTION_NAME):
        return f"{flag} runs attention with sdpa, eager or gaudi_fused_sdpa; the model uses {kernel}."
    if any(getattr(module, "is_causal", None) is False for module in model.modules()):  # BERT's, cross-attention
        return f"{flag} splits causal (decoder) models only; this model has bidirectional attention (an encoder)."
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if sliding or (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        return f"{flag} builds a causal mask over the whole sequence; this model attends through a sliding window."
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or heads % size or kv_heads % size:
        return (
            f"{flag} gives each process 1/{size} of the attention heads: the model has {heads} query and {kv_heads} "
            "key/value heads; choose a size that divides both."
        )
    return None


def release(name: str) -> None:
    """Take ``name`` out of transformers' attention and mask registries. They offer registration only (deleting
    from an instance removes its local overrides, not a ``register``'s entry), hence the class mappings."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for interface in (AttentionInterface, AttentionMaskInterface):
        interface._global_mapping.pop(name, None)


def _around(name: str, current: str | None) -> None:
    """The split registered as ``name`` goes around ``current``, the implementation the model runs (again, when a
    new one is laid under it). Found by its name: the seam keeps the name, which a model's copy or pickle can keep,
    not the split and its process group."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[name].__self__.base = current or "eager"


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 (one chunk per rank of ``group``); its own inverse, hence its own backward."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(chunks, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """[batch, heads, seq/N, dim] slices -> [batch, heads/N, seq, dim]: this rank's heads over the whole sequence."""
    b, h, t, d = x.shape
    chunks = x.reshape(b, size, h // size, t, d).permute(1, 0, 2, 3, 4)  # [rank to send to, b, h/N, t, d]
    received = _AllToAll.apply(chunks, group)  # [rank it came from = sequence slice, b, h/N, t, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _heads_to_seq(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """[batch, seq, heads/N, dim] attention output -> [batch, seq/N, heads, dim]: all heads of this rank's slice."""
    b, s, h, d = x.shape
    chunks = x.reshape(b, size, s // size, h, d).permute(1, 0, 2, 3, 4)  # [sequence slice, b, t, h/N, d]
    received = _AllToAll.apply(chunks, group)  # [head group it came from, b, t, h/N, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


@dataclass
class _Split:
    """One training step's whole-sequence facts, read by every attention layer of its forward (and recompute)."""

    group: Any
    size: int
    padding_mask: torch.Tensor | None  # [batch, seq] as given, or None
    position_ids: torch.Tensor  # [batch, seq], global
    masks: dict[torch.dtype, Any] = field(default_factory=dict)

    def mask(self, config: Any, like: torch.Tensor) -> Any:
        """The mask the model would build for the whole sequence (None: plain causal), once per dtype."""
        if like.dtype not in self.masks:
            from transformers.masking_utils import create_causal_mask

            batch, seq = self.position_ids.shape
            self.masks[like.dtype] = create_causal_mask(
                config=config,
                inputs_embeds=like.new_empty(batch, seq, 0),
                attention_mask=self.padding_mask,
                cache=None,
                position_ids=self.position_ids,
            )
        return self.masks[like.dtype]


class SequenceParallel:
    """One trainer's split: the hooks it calls (the model, the sampler, each step), the local kernel its model
    runs, the step being split while it runs. The process groups are the layout's (``distributed/layout.py``)."""

    def __init__(self, size: int, group: Any, data_parallel_size: int, data_parallel_index: int) -> None:
        self.size, self.group = size, group
        self.groups, self.group_index = data_parallel_size, data_parallel_index  # the sampler's shards
        self.name = f"{ATTENTION_NAME}_{id(self):x}"  # this split's entry in transformers' attention registry
        self.base = "sdpa"  # the local kernel behind it: the model's own
        self.split: _Split | None = None  # the training step being split, while it runs
        self._models = 0  # the models whose attention names this split's entry, alive

    def local_kernel(self, module: nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
        """The kernel the model would run: a registered one, or ``eager`` from the layer's own modeling file."""
        if self.base == "eager":
            return sys.modules[type(module).__module__].eager_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.base]

    def attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        """transformers' attention signature; inside a split training step, the local kernel over the whole
        sequence for this rank's heads, between two all-to-alls. Outside one (evaluation), the local kernel."""
        kernel, split = self.local_kernel(module), self.split
        if split is None:
            return kernel(module, query, key, value, attention_mask, **kwargs)
        size, group = split.size, split.group
        query, key, value = (_seq_to_heads(x, size, group) for x in (query, key, value))
        mask = split.mask(module.config, query)
        output, _ = kernel(module, query, key, value, mask, **kwargs)
        return _heads_to_seq(output, size, group), None

    def mask_function(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS[self.base](*args, **kwargs)

    def use(self, model: nn.Module) -> None:
        """Put this split's attention around the model's own kernel (idempotent). A model another split wraps
        (an earlier trainer's) keeps the kernel that one wrapped."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        base = getattr(model, "get_base_model", lambda: model)()  # a PEFT model's transformers model
        seam = Seam.of(base, "attn_implementation")
        if "sequence_parallel" in seam and seam.value("sequence_parallel") == self.name:
            return
        problem = model_problem(base, self.size)
        if problem is not None:
            raise UserError(problem)
        seam.remove("sequence_parallel")  # an earlier trainer's split: this one goes around what that one wrapped
        AttentionInterface.register(self.name, self.attention)
        AttentionMaskInterface.register(self.name, self.mask_function)
        try:
            seam.put("sequence_parallel", Named(self.name, around=_around))
        except BaseException:
            if not self._models:
                release(self.name)
            raise
        # transformers' registries are the process's: the entry (and with it this split) goes when no model runs
        # it any more, not at the end of the process. The trainer holds its model, so that is when the trainer
        # is collected, or later where the user keeps the model (which still runs the entry).
        self._models += 1
        weakref.finalize(base, self._model_gone).atexit = False

    def _model_gone(self) -> None:
        self._models -= 1
        if not self._models:
            release(self.name)

    def check_loss(self, compute_loss_func: Callable[..., Any] | None) -> None:
        """The model computes the loss from the labels shifted over the whole sequence; a trainer's own loss
        function would read the slice's own labels."""
        if compute_loss_func is not None:
            raise UserError(
                f"--context_parallel_size {self.size} cannot be combined with a compute_loss_func (it would read the "
                "slice's own labels); drop one."
            )

    def share_batches(self, dataloader: Any) -> Any:
        """The ranks of a group read the same batches: accelerate's sharding over world/N data-parallel ranks."""
        from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

        for shard in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
            if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
                shard.num_processes, shard.process_index = self.groups, self.group_index
                return dataloader
        raise UserError(  # accelerate dispatches an iterable dataset's batches from rank 0 by default
            f"--context_parallel_size {self.size} needs each rank to read its own batches; with an iterable dataset "
            """give --accelerator_config '{"dispatch_batches": false}'."""
        )

    @contextlib.contextmanager
    def splitting(self, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """This rank's slice of a batch, and the whole-sequence facts for the attention layers while it trains."""
        ids = inputs["input_ids"]
        batch, seq = ids.shape
        pad = -seq % self.size
        local = dict(inputs)
        padding_mask = local.pop("attention_mask", None)
        positions = local.get("position_ids")
        if positions is None:
            positions = torch.arange(seq, device=ids.device).expand(batch, seq)
        if "labels" in local and "shift_labels" not in local:  # shifted over the whole sequence, then split
            local["shift_labels"] = nn.functional.pad(local["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        if pad:  # at the end: causal attention never reads them, and they have no label
            local["input_ids"] = nn.functional.pad(ids, (0, pad))
            for name in ("labels", "shift_labels"):
                if name in local:
                    local[name] = nn.functional.pad(local[name], (0, pad), value=IGNORE_INDEX)
            tail = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)
            positions = torch.cat([positions, tail], dim=1)
            if padding_mask is not None:
                padding_mask = nn.functional.pad(padding_mask, (0, pad), value=1)
        local["position_ids"] = positions
        rank = dist.get_rank(self.group)
        width = (seq + pad) // self.size
        for name in ("input_ids", "labels", "shift_labels", "position_ids"):
            if name in local:
                local[name] = local[name][:, rank * width : (rank + 1) * width].contiguous()
        self.split = _Split(self.group, self.size, padding_mask, positions)
        try:
            yield local
        finally:
            self.split = None
