"""The trainer prepares its model in the order features/preparation.py writes down (issue 39, item 3), and
the model it prepared comes back whole with one call."""

from __future__ import annotations

import pytest
import torch
from tiny import llama
from transformers import Trainer

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.features import attention
from optimum_gaudi.features.preparation import STAGES, Seam, undo


def trainer(tmp_path, **flags) -> GaudiTrainer:
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], save_strategy="no", **flags)
    ids = torch.randint(1, 100, (8, 8), generator=torch.Generator().manual_seed(0)).tolist()
    return GaudiTrainer(model=llama(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])


def test_wrap_model_runs_the_stages_in_the_written_order(tmp_path, monkeypatch):
    """Every stage recorded as it runs (the sequence split and fast_ddp stood in for: one process here)."""
    ran: list[str] = []
    gaudi = trainer(
        tmp_path,
        attn_implementation="sdpa",
        torch_compile=True,
        torch_compile_backend="eager",
        use_regional_compilation=True,
        use_fused_linear_cross_entropy=True,
    )

    def recording(stage, run):
        def record(*args, **kwargs):
            ran.append(stage)
            return run(*args, **kwargs)

        return record

    for stage, name in [
        ("kernels", "_prepare_kernels"),
        ("compile", "_prepare_compile"),
        ("fused_loss", "_prepare_fused_loss"),
        ("graphs", "_with_training_graphs"),
    ]:
        monkeypatch.setattr(gaudi, name, recording(stage, getattr(gaudi, name)))
    monkeypatch.setattr(attention, "use", recording("attention", attention.use))
    monkeypatch.setattr(gaudi._precision, "convert", recording("precision", gaudi._precision.convert))
    monkeypatch.setattr(Trainer, "_wrap_model", recording("accelerate", Trainer._wrap_model))
    monkeypatch.setattr(
        gaudi, "_sequence_parallel", type("Split", (), {"use": staticmethod(recording("sequence_parallel", id))})()
    )
    monkeypatch.setattr(gaudi, "_use_fast_ddp", lambda: True)
    monkeypatch.setattr(gaudi, "_wrap_for_fast_ddp", recording("fast_ddp", lambda model: model))

    gaudi._wrap_model(gaudi.model, training=True)
    assert ran == [stage for stage, _ in STAGES]


@pytest.mark.parametrize("fused", [False, True])
def test_a_trained_model_undone_computes_what_its_weights_compute(tmp_path, fused):
    """Trained with regional compilation (and the fused loss), then undone: plain transformers' forward and loss
    on the trained weights, nothing of the preparation left."""
    gaudi = trainer(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=4,
        torch_compile=True,
        torch_compile_backend="eager",
        use_regional_compilation=True,
        use_fused_linear_cross_entropy=fused,
    )
    gaudi.train()
    model = gaudi.model
    assert Seam.find(model, "loss_function").stages == ("pinned", "compiled", "fused_loss")[: 3 if fused else 2]
    undo(model)
    plain = llama()
    plain.load_state_dict(model.state_dict())
    batch = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(input_ids=batch, labels=batch), plain(input_ids=batch, labels=batch)
    assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.loss, theirs.loss)
    left = [(type(m).__name__, k) for m in model.modules() for k in vars(m) if k.startswith("_gaudi") or k == "forward"]
    assert not left and "_loss_function" not in vars(model)


def test_a_second_trainer_compiles_a_model_an_earlier_one_gave_the_fused_loss(tmp_path):
    """Trainer A: the fused loss; trainer B, on the same model: regional compilation. B compiles the model's own
    loss under A's fused loss (a stage laid under one already there) and trains."""
    model = llama()
    first = trainer(tmp_path / "a", max_steps=1, per_device_train_batch_size=4, use_fused_linear_cross_entropy=True)
    first.model = first.model_wrapped = model
    first.train()
    second = trainer(
        tmp_path / "b",
        max_steps=1,
        per_device_train_batch_size=4,
        torch_compile=True,
        torch_compile_backend="eager",
        use_regional_compilation=True,
    )
    second.model = second.model_wrapped = model
    second.train()
    assert Seam.find(model, "loss_function").stages == ("compiled", "fused_loss")
    assert torch.isfinite(torch.tensor(second.state.log_history[-1]["train_loss"]))
