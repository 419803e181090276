"""The tiny GPT-2 and Llama and the data the tests train, as plain functions.

conftest.py's fixtures wrap them; scripts run under torchrun and forkserver children cannot use fixtures, so
they import these (``sys.path`` holds tests/ under pytest; a script adds it itself).
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB, LENGTH = 100, 16
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2_config(**overrides) -> GPT2Config:
    """1 layer, width 32, 2 heads, a 100-token vocabulary, 16 positions; ``overrides`` replace any of them."""
    return GPT2Config(
        **{"vocab_size": VOCAB, "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": LENGTH, **overrides}
    )


def gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """The same freshly initialised weights for every call with the same seed and overrides."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(**overrides))


def llama_config(**overrides) -> LlamaConfig:
    """2 layers, width 32, 4 query heads over 2 key/value heads (grouped-query), the same vocabulary and length."""
    return LlamaConfig(
        **{
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": LENGTH, **overrides,
        }
    )  # fmt: skip


def llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A Llama-family model: the same freshly initialised weights for every call with the same seed."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides))


def lm_data(rows: int = 64, length: int = LENGTH) -> list[dict]:
    """``rows`` random sequences over the vocabulary, labels = inputs, the same on every call."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(rows)]
    return [{"input_ids": r, "labels": r} for r in ids]


def losses(trainer) -> list[float]:
    """Train, then the loss of each logged step."""
    trainer.train()
    return logged_losses(trainer)


def logged_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
