"""The trainer prepares its model in the order preparation/pipeline.py writes down (issues 39 and 47), and
the model it prepared comes back whole with one call."""

from __future__ import annotations

import pytest
import torch
from tiny import llama

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.preparation import pipeline
from optimum_gaudi.seam import Seam, undo


def trainer(tmp_path, **flags) -> GaudiTrainer:
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], save_strategy="no", **flags)
    ids = torch.randint(1, 100, (8, 8), generator=torch.Generator().manual_seed(0)).tolist()
    return GaudiTrainer(model=llama(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])


def test_the_stages_run_in_the_order_of_the_list(tmp_path, monkeypatch):
    """The order is the list: it names the stages as issue 39 fixed them, and _wrap_model runs each of them, in
    that order, once (every stage recorded as it runs; one process here)."""
    assert [name for name, _ in pipeline.STAGES] == [
        "attention",
        "sequence_parallel",
        "kernels",
        "precision",
        "compile",
        "fused_loss",
        "accelerate",
        "graphs",
        "fast_ddp",
    ]
    ran: list[str] = []
    gaudi = trainer(
        tmp_path,
        attn_implementation="sdpa",
        torch_compile=True,
        torch_compile_backend="eager",
        use_regional_compilation=True,
        use_fused_linear_cross_entropy=True,
    )

    def recording(name, stage):
        def record(*args, **kwargs):
            ran.append(name)
            return stage(*args, **kwargs)

        return record

    monkeypatch.setattr(pipeline, "STAGES", tuple((name, recording(name, stage)) for name, stage in pipeline.STAGES))
    gaudi._wrap_model(gaudi.model, training=True)
    assert ran == [name for name, _ in pipeline.STAGES]
    fused = Seam.find(gaudi.model, "loss_function")
    assert fused is not None and fused.stages == ("pinned", "compiled", "fused_loss")  # the stages did their work


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


def test_a_trainer_without_a_split_takes_an_earlier_trainers_split_off_its_model(tmp_path):
    """Another trainer's sequence split left on the model would keep running; this trainer's preparation, with no
    split of its own, takes it off (the model runs what the split wrapped)."""
    from optimum_gaudi.distributed.sequence_parallel import SequenceParallel

    gaudi = trainer(tmp_path)
    split = SequenceParallel(2, group=None, data_parallel_size=1, data_parallel_index=0)
    split.use(gaudi.model)
    assert gaudi.model.config._attn_implementation == split.name
    gaudi._wrap_model(gaudi.model, training=False)
    assert gaudi.model.config._attn_implementation == split.base
