"""A model's shape, read from its config (a dict, a config.json, a folder, a transformers config or, online, a
Hub id): only the numbers the memory and speed arithmetic needs, and its parameter count worked out from them.

Two families are understood: decoder-only models with a gated MLP, RMSNorm and rotary positions (Llama, Mistral,
Qwen2/3, ...) and GPT-2. Anything else is one line saying so, not a guess.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

GATED_FAMILY = {"llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "smollm3"}
GPT2_FAMILY = {"gpt2"}
# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the families (peft 0.21: llama, mistral, qwen2, qwen3,
# gpt2; it has none for granite, olmo2 and smollm3, where PEFT asks for target modules)
LORA_DEFAULT_TARGETS = {"gated": ("q_proj", "v_proj"), "gpt2": ("c_attn",)}


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a causal language model."""

    name: str
    family: str  # "gated" (Llama-like) or "gpt2"
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    positions: int
    tied_embeddings: bool
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head norms of q and k (Qwen3)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """One decoder layer's parameters (weights, biases, norms)."""
        h, i = self.hidden, self.intermediate
        if self.family == "gpt2":
            return (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
        attention = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        attention += (self.q_width + 2 * self.kv_width) * self.attention_bias + 2 * self.head_dim * self.qk_norm
        return attention + 3 * h * i + 2 * h

    def layer_norm_and_bias_parameters(self) -> int:
        """The part of a layer's parameters that no matmul multiplies by (norms, biases): never cast for one."""
        h, i = self.hidden, self.intermediate
        if self.family == "gpt2":
            return 3 * h + h + i + h + 4 * h
        return (self.q_width + 2 * self.kv_width) * self.attention_bias + 2 * self.head_dim * self.qk_norm + 2 * h

    def embedding_parameters(self) -> int:
        """The token embedding (and GPT-2's position embedding)."""
        return self.vocab * self.hidden + (self.positions * self.hidden if self.family == "gpt2" else 0)

    def head_parameters(self) -> int:
        """The output layer's own parameters: none when it shares the embedding's."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def parameters(self) -> int:
        final_norm = 2 * self.hidden if self.family == "gpt2" else self.hidden
        return self.embedding_parameters() + self.layers * self.layer_parameters() + final_norm + self.head_parameters()

    def matmul_parameters(self) -> int:
        """Parameters that multiply every token (the layers' linear weights and the output layer): 6 FLOPs each per
        trained token."""
        return self.layers * self.layer_parameters() + self.vocab * self.hidden

    def linear_groups(self) -> tuple[tuple[tuple[str, int, int], ...], ...]:
        """A decoder layer's linear layers as (module name, inputs, outputs), grouped by the input they share (q, k
        and v read one normalised input): what a LoRA adapter on each sees. GPT-2 names two layers c_proj."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_width, self.kv_width
        if self.family == "gpt2":
            return ((("c_attn", h, 3 * h),), (("c_proj", h, h),), (("c_fc", h, i),), (("c_proj", i, h),))
        return (
            (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv)), (("o_proj", q, h),),
            (("gate_proj", h, i), ("up_proj", h, i)), (("down_proj", i, h),),
        )  # fmt: skip

    def lora_targets(self, targets: tuple[str, ...] | list[str] | str | None) -> tuple[str, ...]:
        """The module names LoRA adapts, as PEFT matches them: the names given (a module's last name, as PEFT
        matches a suffix; ``all-linear``: every layer's linear layers), or PEFT's default for the family (Llama,
        Mistral, Qwen: q_proj and v_proj; GPT-2: c_attn). ``lm_head`` is the output layer. A name the planner
        does not know is one line (a regular expression, a module that is not a linear layer)."""
        names = {name for group in self.linear_groups() for name, _, _ in group}
        if not targets:
            return LORA_DEFAULT_TARGETS[self.family]
        targets = [targets] if isinstance(targets, str) else list(targets)
        if "all-linear" in targets:  # PEFT's shorthand: every linear layer but the output layer
            return tuple(sorted(names))
        found = {str(t).rsplit(".", 1)[-1] for t in targets}
        unknown = found - names - {"lm_head"}
        if unknown:
            raise UserError(
                f"{self.name}: LoRA on {', '.join(sorted(unknown))} is not something the planner counts; it counts "
                f"adapters on {', '.join(sorted(names | {'lm_head'}))}."
            )
        return tuple(sorted(found))


def shape_from_config(config: dict[str, Any], name: str = "model") -> ModelShape:
    """The shape of a config given as a dict (config.json's keys)."""
    kind = str(config.get("model_type", "")).lower()
    get = config.get
    if kind in GPT2_FAMILY:
        h = int(get("n_embd"))
        heads = int(get("n_head"))
        return ModelShape(
            name, "gpt2", int(get("n_layer")), h, int(get("n_inner") or 4 * h), heads, heads, h // heads,
            int(get("vocab_size")), int(get("n_positions", 1024)), bool(get("tie_word_embeddings", True)),
        )  # fmt: skip
    if kind in GATED_FAMILY:
        h, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return ModelShape(
            name, "gated", int(get("num_hidden_layers")), h, int(get("intermediate_size")), heads,
            int(get("num_key_value_heads") or heads), int(get("head_dim") or h // heads), int(get("vocab_size")),
            int(get("max_position_embeddings", 4096)), bool(get("tie_word_embeddings", False)),
            bool(get("attention_bias", kind == "qwen2")), kind == "qwen3",
        )  # fmt: skip
    known = ", ".join(sorted(GATED_FAMILY | GPT2_FAMILY))
    raise UserError(f"{name}: model_type {kind or '(none)'!r} is not one the planner knows; it knows {known}.")


def _hub_config(model_id: str) -> dict[str, Any]:
    """config.json of a Hub model, or one line when offline or unknown."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(model_id, "config.json", local_files_only=offline)
    except Exception as e:  # no network, no such repository, gated: all are the user's to fix
        raise UserError(
            f"{model_id!r} is neither a local folder nor a config file, and its config could not be fetched from the "
            f"Hub ({type(e).__name__}); give a local path to the model or its config.json."
        ) from None
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_model_shape(model: Any) -> ModelShape:
    """The shape of ``model``: a transformers config, a dict, a config.json, a folder holding one, or a Hub id."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        return shape_from_config(model, str(model.get("_name_or_path") or model.get("model_type", "model")))
    if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
        config = model.to_dict()
        return shape_from_config(config, str(config.get("_name_or_path") or config.get("model_type", "model")))
    path = Path(str(model)).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UserError(f"{model}: the folder holds no config.json; point at the model's folder or config file.")
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not a JSON config ({e}).") from None
        return shape_from_config(config, str(model))
    if str(model).count("/") > 1 or str(model).startswith((".", "~")) or str(model).endswith(".json"):
        raise UserError(f"{model}: no such file or folder.")
    return shape_from_config(_hub_config(str(model)), str(model))
