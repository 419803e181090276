"""Two trainers in one process keep their own settings (issue 39): the fused attention's kernel and modes, the
sequence split's local kernel and the fused rotary belong to each trainer's model, not to the process. Before,
module globals held them, and a Gaudi 3 fp8-attention run left its kernel to the next model in the process."""

from __future__ import annotations

import pytest
import torch
from tiny import llm_args as args
from tiny import llm_data as full_data
from tiny import llm_llama as llama
from tiny import train_losses

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
    (what tests/unit/optimum_habana/test_habana_api.py's adapt_transformers_to_gaudi check failed on after tests/integration/precision/test_fp8.py)."""
    train_losses(llama(), args(tmp_path, use_habana=True, attn_implementation="gaudi_fused_sdpa"), full_data())
    bridge().reset()
    ids = torch.tensor([row["input_ids"] for row in full_data(2)])
    plain, fused = llama(seed=3), llama(seed=3)
    fused.set_attn_implementation("gaudi_fused_sdpa")
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, plain(ids).logits)
    assert not bridge().calls_named("hpex.kernels.FusedSDPA")


@pytest.fixture
def one_process_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_two_sequence_splits_keep_their_own_local_kernel(one_process_group, monkeypatch):
    """Two trainers' splits of one process (a group of one rank each): the first model's layers still run its
    own kernel (eager) after the second split took sdpa."""
    import transformers.models.llama.modeling_llama as modeling_llama

    from optimum_gaudi.distributed.sequence_parallel import SequenceParallel

    eager = []
    original = modeling_llama.eager_attention_forward
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", lambda *a, **k: eager.append(1) or original(*a, **k))
    first, second = llama(attn_implementation="eager"), llama()
    for model in (first, second):  # each trainer's own split
        SequenceParallel(1, torch.distributed.group.WORLD, data_parallel_size=1, data_parallel_index=0).use(model)
    ids = torch.tensor([row["input_ids"] for row in full_data(2)])
    with torch.no_grad():
        first(ids)
    assert eager  # the first split's own kernel
    eager.clear()
    with torch.no_grad():
        second(ids)
    assert not eager
