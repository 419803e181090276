"""The tiny GPT-2 and Llama and the data the tests train, as plain functions.

conftest.py's fixtures wrap them; scripts run under torchrun and forkserver children cannot use fixtures, so
they import these (``sys.path`` holds tests/ under pytest; a script adds it itself).
"""

from __future__ import annotations

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

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


def llama_8_heads(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """1 layer, width 32, 8 query and 4 key/value heads (grouped), a 100-token vocabulary; the same weights for
    every call with the same seed and overrides."""
    torch.manual_seed(seed)
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8)
    config |= dict(num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))


def mixtral(seed: int = 0) -> PreTrainedModel:
    """A mixture of experts (1 layer, 2 experts, 1 a token) that transformers 5 saves with its experts converted
    back to the checkpoint layout."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config |= dict(num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    return MixtralForCausalLM(MixtralConfig(**config))


def padded_lm_data(rows: int = 32, longest: int = LENGTH - 1) -> list[dict]:
    """``rows`` random sequences of 3 to ``longest`` tokens (labels = inputs), to be padded into batches."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, longest + 1, (rows,), generator=g).tolist()
    ids = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return [{"input_ids": r, "labels": r} for r in ids]


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


def pad_rows(rows: list[dict], side: str = "right") -> dict:
    """A batch of ``rows`` padded to the longest: token 0, attention mask 0, label -100, on ``side``."""
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for r in rows:
        n, pad = len(r["input_ids"]), longest - len(r["input_ids"])
        for key, value, fill in (("input_ids", r["input_ids"], 0), ("attention_mask", [1] * n, 0), ("labels", r["labels"], -100)):  # fmt: skip
            batch[key].append(value + [fill] * pad if side == "right" else [fill] * pad + value)
    return {k: torch.tensor(v) for k, v in batch.items()}


def trained_llama(args, attn_implementation: str = "sdpa", padding_side: str = "right", eval_rows: int = 0) -> dict:
    """Train the tiny Llama on ``padded_lm_data`` with ``args`` (a GaudiTrainingArguments); rank 0's view of
    the run: per-step losses and the trained parameters, then the eval_loss on ``eval_rows`` rows if any."""
    from optimum_gaudi import GaudiTrainer

    model = llama_8_heads()
    model.set_attn_implementation(attn_implementation)
    trainer = GaudiTrainer(
        model=model,
        args=args,
        train_dataset=padded_lm_data(),
        eval_dataset=padded_lm_data(eval_rows) if eval_rows else None,
        data_collator=lambda rows: pad_rows(rows, padding_side),
    )
    trained = losses(trainer)
    full = [getattr(p, "full_tensor", p.detach)() for p in trainer.model.parameters()]  # FSDP: gathered shards
    parameters = torch.cat([p.detach().reshape(-1) for p in full])
    (end,) = [h for h in trainer.state.log_history if "train_samples_per_second" in h]
    samples, steps = end["train_samples_per_second"], end["train_steps_per_second"]
    # the global batch, as logged: transformers rounds both speeds to 3 decimals, so on a slow (loaded) run it is
    # known within these bounds only
    batch = (samples - 5e-4) / (steps + 5e-4), (samples + 5e-4) / max(steps - 5e-4, 1e-9)
    return {
        "losses": trained,
        "parameters": parameters.tolist(),
        "logged_batch": batch,
        "fsdp": trainer.is_fsdp_enabled,
        "eval_loss": trainer.evaluate()["eval_loss"] if eval_rows else None,
    }


def leave_process() -> None:
    """The end of a torchrun worker, once its results are written: the process group torn down, output flushed,
    then ``os._exit``: after FSDP or DDP over gloo a rank sometimes never finishes interpreter exit (both threads
    idle), which keeps torchrun waiting."""
    import os
    import sys

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    simulator = sys.modules.get("habana_frameworks")  # the simulated bridge's call log, written at exit otherwise
    if simulator is not None and hasattr(simulator, "write_call_log"):
        simulator.write_call_log()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the LLM path's kernels: a Llama with its own vocabulary, built with an attention implementation, and one
# training's losses (tests/integration/features/test_llm_kernels.py, test_two_trainers.py)

LLM_VOCAB = 64


def llm_llama(seed: int = 0, attn_implementation: str = "sdpa", dropout: float = 0.0) -> LlamaForCausalLM:
    """Two layers, grouped-query attention (4 query heads over 2 key/value heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=LLM_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        attention_dropout=dropout,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)


def llm_data(rows: int = 16) -> list[dict]:
    """``rows`` full-length random sequences over ``LLM_VOCAB`` (no padding), labels = inputs."""
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": r, "labels": r} for r in torch.randint(1, LLM_VOCAB, (rows, LENGTH), generator=g).tolist()]


def llm_args(tmp_path, **kwargs):
    """GaudiTrainingArguments for 3 logged steps of batch 4, no saving, seed 0; ``kwargs`` add or replace."""
    from optimum_gaudi import GaudiTrainingArguments

    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        logging_steps=1,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    return GaudiTrainingArguments(**{**defaults, **kwargs})


def train_losses(model, training_args, data, gaudi_config=None) -> list[float]:
    """A GaudiTrainer on ``model`` trained with ``training_args`` on ``data``: the loss of each logged step."""
    from optimum_gaudi import GaudiTrainer

    trainer = GaudiTrainer(model=model, args=training_args, train_dataset=data, gaudi_config=gaudi_config)
    return losses(trainer)


# ---- sequence-to-sequence: a tiny T5 and a decoder-only Llama with their own vocabulary (tests/unit/trainers/test_seq2seq.py, the HPU path's generation tests)

SEQ2SEQ_VOCAB = 40


def tiny_t5() -> PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=SEQ2SEQ_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


class PadCollator:
    """Right-pads inputs with the model's pad id and labels with -100, as DataCollatorForSeq2Seq does."""

    def __init__(self, pad_token_id):
        self.pad = pad_token_id

    def __call__(self, rows):
        def pad(seqs, value):
            width = max(len(s) for s in seqs)
            return torch.tensor([s + [value] * (width - len(s)) for s in seqs])

        ids = [r["input_ids"] for r in rows]
        return {
            "input_ids": pad(ids, self.pad),
            "attention_mask": pad([[1] * len(s) for s in ids], 0),
            "labels": pad([r["labels"] for r in rows], -100),
        }


def tiny_decoder_only() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SEQ2SEQ_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config)
