"""Two trainers in one process keep their own settings (issue 39): the fused attention's kernel and modes, the
sequence split's local kernel and the fused rotary belong to each trainer's model, not to the process. Before,
module globals held them, and a Gaudi 3 fp8-attention run left its kernel to the next model in the process."""

from __future__ import annotations

import torch
from test_llm_kernels import args, full_data, llama, train_losses

from optimum_gaudi import GaudiTrainer


def test_a_second_trainers_attention_modes_do_not_reach_the_first_ones_model(tmp_path, bridge):
    """Trainer A: FusedSDPA with recompute; trainer B: without. A's model, run after B trained: A's modes."""
    flags = dict(use_habana=True, attn_implementation="gaudi_fused_sdpa")
    first = GaudiTrainer(
        model=llama(),
        args=args(tmp_path / "a", flash_attention_recompute=True, **flags),
        train_dataset=full_data(),
    )
    first.train()
    second = GaudiTrainer(model=llama(), args=args(tmp_path / "b", **flags), train_dataset=full_data())
    second.train()
    bridge().reset()
    ids = torch.tensor([row["input_ids"] for row in full_data(2)], device=first.model.device)
    with torch.no_grad():
        first.model(ids)
    calls = bridge().calls_named("hpex.kernels.FusedSDPA")
    assert calls and all(call.kwargs["recompute"] for call in calls)


def test_a_model_no_trainer_was_given_runs_sdpa_after_a_gaudi_trainer(tmp_path, bridge):
    """After a trainer ran FusedSDPA, a model set to gaudi_fused_sdpa outside any trainer is transformers' sdpa
    (what tests/test_habana_api.py's adapt_transformers_to_gaudi check failed on after tests/test_fp8.py)."""
    train_losses(llama(), args(tmp_path, use_habana=True, attn_implementation="gaudi_fused_sdpa"), full_data())
    bridge().reset()
    ids = torch.tensor([row["input_ids"] for row in full_data(2)])
    plain, fused = llama(seed=3), llama(seed=3)
    fused.set_attn_implementation("gaudi_fused_sdpa")
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, plain(ids).logits)
    assert not bridge().calls_named("hpex.kernels.FusedSDPA")
