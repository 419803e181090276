"""GaudiSeq2SeqTrainer: the Gaudi mixin on transformers' Seq2SeqTrainer (T5, BART, ... evaluated with generate).

Generation is transformers' own. Where the device compiles a graph per shape (a Gaudi in lazy mode, the
only place HPU Graphs run too), evaluation keeps generation's shapes fixed: the inputs are padded to a
multiple of ``STATIC_INPUT_MULTIPLE`` (masked, so the outputs do not change; on the right of an encoder's
inputs, on the left of a decoder-only model's prompt, whose continuation starts at its right end, and cut
off the generated tokens again) and the decoder uses a fixed-size key/value cache. Elsewhere nothing changes.
With ``--use_hpu_graphs_for_inference`` the loss forward replays as a graph; decoding steps, given the cache,
run without (``Device.wrap_for_inference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from .trainer import GaudiTrainerMixin
from .training_args import GaudiTrainingArgumentsMixin

# Encoder inputs are padded up to a multiple of this during generation with static shapes: one compiled
# graph serves every batch whose longest input falls in the same bucket.
STATIC_INPUT_MULTIPLE = 32


@dataclass
class GaudiSeq2SeqTrainingArguments(GaudiTrainingArgumentsMixin, Seq2SeqTrainingArguments):
    """Seq2SeqTrainingArguments (``predict_with_generate``, ``generation_max_length``,
    ``generation_num_beams``, ``generation_config``) with the Gaudi options."""


class GaudiSeq2SeqTrainer(GaudiTrainerMixin, Seq2SeqTrainer):
    """Seq2SeqTrainer with the Gaudi features; on HPU, generation during evaluation keeps static shapes in
    lazy mode."""

    gaudi_args_class = GaudiSeq2SeqTrainingArguments

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ):
        generating = self.args.predict_with_generate and not prediction_loss_only
        if not (generating and self.gaudi_device.static_shapes(self.args.use_lazy_mode)):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        gen_kwargs = {**(gen_kwargs or getattr(self, "_gen_kwargs", {}))}
        gen_kwargs.setdefault("cache_implementation", "static")
        encoder_decoder = bool(getattr(self.model.config, "is_encoder_decoder", False))
        side = "right" if encoder_decoder else "left"
        padded = pad_encoder_inputs(inputs, self._encoder_pad_token_id(), STATIC_INPUT_MULTIPLE, side=side)
        added = padded["input_ids"].shape[1] - inputs["input_ids"].shape[1] if padded is not inputs else 0
        aligned_labels = not encoder_decoder and _same_shape(inputs.get("labels"), inputs.get("input_ids"))
        if added and aligned_labels:  # a decoder-only model's labels run along its inputs: padded alike, ignored
            padded["labels"] = nn.functional.pad(inputs["labels"], (added, 0), value=-100)
        loss, generated, labels = super().prediction_step(
            model, padded, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs
        )
        if added and not encoder_decoder:  # the output starts with the (padded) prompt: cut what was added
            generated = self._as_wide_as_unpadded(generated[:, added:]) if generated is not None else None
            labels = labels[:, added:] if labels is not None and aligned_labels else labels
        return loss, generated, labels

    def _as_wide_as_unpadded(self, generated: torch.Tensor) -> torch.Tensor:
        """Seq2SeqTrainer pads generated tokens up to the generation config's length; after cutting the added
        prompt padding, the same rule gives the width the unpadded batch had."""
        config = self.model.generation_config
        if generated.shape[-1] < config.max_length:
            return self._pad_tensors_to_max_len(generated, config.max_length)
        if config.max_new_tokens is not None and generated.shape[-1] < config.max_new_tokens + 1:
            return self._pad_tensors_to_max_len(generated, config.max_new_tokens + 1)
        return generated

    def _encoder_pad_token_id(self) -> int:
        pad = getattr(self.model.config, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.processing_class, "pad_token_id", None)
        return 0 if pad is None else int(pad)  # masked out: any id in the vocabulary will do


def _same_shape(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape


def pad_encoder_inputs(inputs: dict[str, Any], pad_token_id: int, multiple: int, side: str = "right") -> dict[str, Any]:
    """``input_ids`` and ``attention_mask`` padded on ``side`` to a multiple of ``multiple``; the padding is
    masked, so the outputs at the real positions stay the same."""
    input_ids = inputs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return inputs
    length = input_ids.shape[1]
    extra = -length % multiple
    if extra == 0:
        return inputs
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    widths = (0, extra) if side == "right" else (extra, 0)
    padded = dict(inputs)
    padded["input_ids"] = nn.functional.pad(input_ids, widths, value=pad_token_id)
    padded["attention_mask"] = nn.functional.pad(mask, widths, value=0)
    return padded
