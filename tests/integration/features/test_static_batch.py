"""A short last batch never changes a loss or a gradient, whatever the loss (issue 9, point 1).

On CPU (and CUDA) lazy mode is a no-op and nothing is padded. On the simulated Gaudi (tests/fakes, a test
double) lazy mode and HPU Graphs compile per shape, so the short batch is padded where the padding rows
provably stay out of the loss, and runs unpadded otherwise.
"""

import logging

import pytest
import torch
from conftest import ON_DEVICE
from tiny import NO_DROPOUT, gpt2_config
from torch import nn
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import CPUDevice, CUDADevice, HPUDevice
from optimum_gaudi.features.static_batches import StaticRows, cut_rows, pad_rows

SAMPLES, BATCH, LENGTH = 66, 8, 8  # 8 full batches and a last one of 2 rows
UNPADDED = "run unpadded"


class OwnLossTrainer(GaudiTrainer):
    """A user's compute_loss: MSE on the regression head, labels never given to the model."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        loss = nn.functional.mse_loss(outputs.logits.squeeze(-1), inputs["labels"])
        return (loss, outputs) if return_outputs else loss


class PlainRegressor(nn.Module):
    """A user's own model, no transformers loss machinery: MSE on a float label inside its forward."""

    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(100, 16), nn.Linear(16, 1)

    def forward(self, input_ids, labels=None):
        prediction = self.head(self.wte(input_ids).mean(dim=1)).squeeze(-1)
        loss = None if labels is None else nn.functional.mse_loss(prediction, labels)
        return {"loss": loss, "logits": prediction}


def config(**overrides):
    # dropout off: a padded batch draws masks of another shape, so equality could only hold in distribution;
    # eager attention: the CPU reference and the simulated device then run the same kernels (sdpa takes torch's
    # flash kernel on CPU, its math one on the device: last-bit differences that padding has nothing to do with)
    return gpt2_config(n_positions=LENGTH, pad_token_id=0, attn_implementation="eager", **NO_DROPOUT, **overrides)


def data(task):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (SAMPLES, LENGTH), generator=g)
    if task in ("regression", "own_compute_loss", "plain_regression"):
        labels = (torch.randn(SAMPLES, generator=g) * 0.5).tolist()
    elif task == "classification":
        labels = torch.randint(0, 3, (SAMPLES,), generator=g).tolist()
    else:
        labels = ids.tolist()
    return [{"input_ids": i, "labels": label} for i, label in zip(ids.tolist(), labels, strict=True)]


def model(task):
    torch.manual_seed(0)
    if task == "plain_regression":
        return PlainRegressor()
    if task in ("regression", "own_compute_loss"):
        return GPT2ForSequenceClassification(config(num_labels=1))
    if task == "classification":
        return GPT2ForSequenceClassification(config(num_labels=3))
    return GPT2LMHeadModel(config())


TASKS = {
    "regression": ({}, GaudiTrainer),
    "plain_regression": ({}, GaudiTrainer),
    "classification": ({}, GaudiTrainer),
    "own_compute_loss": ({}, OwnLossTrainer),
    "label_smoothing": ({"label_smoothing_factor": 0.1}, GaudiTrainer),
    "causal_lm": ({}, GaudiTrainer),
}


def train(task, tmp_path, **kwargs):
    """Per-step losses and grad norms, final weights and the row count of every forward."""
    extra, trainer_cls = TASKS[task]
    settings = dict(num_train_epochs=1, per_device_train_batch_size=BATCH, logging_steps=1, learning_rate=1e-3)
    settings.update(report_to=[], save_strategy="no", seed=0, **extra, **kwargs)
    args = GaudiTrainingArguments(output_dir=str(tmp_path), **settings)
    net = model(task)
    rows = []
    embedding = net.transformer.wte if hasattr(net, "transformer") else net.wte
    embedding.register_forward_pre_hook(lambda module, inputs: rows.append(inputs[0].size(0)))
    trainer = trainer_cls(model=net, args=args, train_dataset=data(task))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return trainer, [h["loss"] for h in logs], [h["grad_norm"] for h in logs], weights, rows


def test_only_a_lazy_mode_gaudi_asks_for_static_shapes():
    assert HPUDevice().static_shapes(lazy_mode=True) and not HPUDevice().static_shapes(lazy_mode=False)
    assert not any(device.static_shapes(lazy_mode=True) for device in (CPUDevice(), CUDADevice()))


def cpu_reference(task, tmp_path, **kwargs):
    """The unpadded run, on CPU. Lazy mode is a no-op there (see the test above), but it sets PT_HPU_LAZY_MODE=1
    as the simulated Gaudi run that follows needs it: accelerate imports habana_frameworks whenever it can."""
    reference = train(task, tmp_path / "cpu", use_cpu=True, use_lazy_mode=True, **kwargs)
    assert reference[-1][-1] == SAMPLES % BATCH  # the short batch really ran short
    return reference


@pytest.mark.cpu
@pytest.mark.parametrize("task", TASKS)
def test_lazy_mode_on_cpu_pads_nothing_and_changes_nothing(task, tmp_path):
    _, ref_loss, ref_norm, ref_weights, ref_rows = train(task, tmp_path / "eager")
    _, loss, norm, weights, rows = train(task, tmp_path / "lazy", use_lazy_mode=True)
    assert ref_rows == rows == [BATCH] * 8 + [2]
    assert len(loss) == 9
    assert loss == ref_loss and norm == ref_norm  # bit for bit, the last step included
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


# Where padding is provably inert the simulated Gaudi sees 8 rows; elsewhere the short batch runs unpadded.
# The first short batch is checked first (evaluation mode, no gradients): masked, the batch alone and padded
# with label -100 rows must give the same loss and real-row outputs (language modeling, classification and a
# label smoother skip -100; MSE does not); else cut, the real rows' outputs padded and alone must agree.
MASKED_CHECK = [2, 8]  # the trainer's loss alone, then padded with -100 labels
CUT_CHECK = [8, 2]  # the forward padded, then alone
LAST_ROWS_LAZY = {
    "regression": [*MASKED_CHECK, *CUT_CHECK, 2],  # its inline MSE counts -100 labels and the padding rows
    "plain_regression": [*MASKED_CHECK, 2],  # labels go into a forward without loss_function: never cut
    "classification": [*MASKED_CHECK, 8],
    "own_compute_loss": [*MASKED_CHECK, *CUT_CHECK, 8],  # its MSE counts -100 labels: cut instead
    "label_smoothing": [*MASKED_CHECK, 8],
    "causal_lm": [*MASKED_CHECK, 8],
}
# masked padding needs no cut inside the captured forward; the cut one does, which a replayed graph cannot take
LAST_ROWS_GRAPHS = {**LAST_ROWS_LAZY, "regression": [*MASKED_CHECK, 2]}


@pytest.mark.parametrize("graphs", [False, True], ids=["lazy", "lazy+hpu_graphs"])
@pytest.mark.parametrize("task", TASKS)
def test_simulated_gaudi_pads_only_inert_rows(task, graphs, bridge, tmp_path, caplog):
    _, ref_loss, ref_norm, ref_weights, _ = cpu_reference(task, tmp_path)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        trainer, loss, norm, weights, rows = train(
            task, tmp_path / "hpu", use_habana=True, use_lazy_mode=True, use_hpu_graphs_for_training=graphs
        )
    assert isinstance(trainer.args.gaudi_device, HPUDevice)
    expected = (LAST_ROWS_GRAPHS if graphs else LAST_ROWS_LAZY)[task]
    first = [BATCH] if graphs else []  # under training graphs, step 1 also finds unused parameters: one forward
    assert rows == first + [BATCH] * 8 + expected
    assert sum(UNPADDED in r.getMessage() for r in caplog.records) == (expected[-1] == 2)
    assert loss == ref_loss and norm == ref_norm  # bit for bit, padded or not
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.mark.parametrize("task", ["causal_lm", "own_compute_loss"])
def test_padding_under_gradient_accumulation_changes_nothing(task, bridge, tmp_path):
    _, ref_loss, ref_norm, ref_weights, _ = cpu_reference(task, tmp_path, gradient_accumulation_steps=2)
    _, loss, norm, weights, rows = train(
        task, tmp_path / "hpu", use_habana=True, use_lazy_mode=True, gradient_accumulation_steps=2
    )
    expected = LAST_ROWS_LAZY[task]
    assert rows == [BATCH] * 8 + expected and len(loss) == 5  # the last step has one padded micro-batch
    assert loss == ref_loss and norm == ref_norm
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_padding_rows_count_in_no_throughput(bridge, tmp_path):
    trainer, *_, rows = train("causal_lm", tmp_path, use_habana=True, use_lazy_mode=True)
    assert rows[-1] == BATCH  # padded for the graph...
    totals = trainer._throughput.totals(trainer.state.global_step)
    assert totals["samples"] == SAMPLES and totals["tokens"] == SAMPLES * LENGTH  # ...but counted as 2 rows


def test_unpadded_warning_is_given_once_per_run(bridge, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        *_, rows = train("regression", tmp_path, use_habana=True, use_lazy_mode=True, num_train_epochs=3)
    assert rows.count(2) == 3 + 2 and rows.count(BATCH) == 8 * 3 + 2  # the first short batch's checks: 2, 8, 8, 2
    assert sum(UNPADDED in r.getMessage() for r in caplog.records) == 1


# ---- StaticRows on its own --------------------------------------------------------------------------


class InlineLoss(nn.Module):
    """Computes a loss inside its forward from an input no label name announces."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x, y):
        prediction = self.linear(x).squeeze(-1)
        return {"loss": ((prediction - y) ** 2).mean(), "prediction": prediction}


def test_a_loss_computed_over_the_padding_is_caught_and_rerun_unpadded(caplog):
    torch.manual_seed(0)
    net, x, y = InlineLoss(), torch.randn(2, 3), torch.randn(2)
    expected = net(x, y)["loss"]
    static = StaticRows(label_names=["labels"], labels_into_forward=True, rng_snapshot=CPUDevice().rng_snapshot)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"), static.padding(net, net, rows=2, size=8):
        got = net(x, y)["loss"]
    assert torch.equal(got, expected)
    assert not static.enabled and UNPADDED in caplog.text
    assert "forward" not in net.__dict__  # the model is left as it was


def test_batch_norm_models_are_never_padded(caplog):
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    seen = []
    net.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].size(0)))
    static = StaticRows(label_names=["labels"], labels_into_forward=True, rng_snapshot=CPUDevice().rng_snapshot)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"), static.padding(net, net, rows=2, size=8):
        net(torch.randn(2, 3))
    assert seen == [2] and "batch-norm" in caplog.text


def test_pad_and_cut_rows_round_trip_nested_outputs():
    batch = {"ids": torch.arange(6).view(3, 2), "scale": torch.tensor(2.0), "nested": (torch.ones(3, 1),)}
    padded = pad_rows(batch, rows=3, size=5)
    assert padded["ids"].shape == (5, 2) and torch.equal(padded["ids"][3:], batch["ids"][-1:].expand(2, 2))
    assert padded["scale"] is batch["scale"] and padded["nested"][0].shape == (5, 1)
    back = cut_rows(padded, rows=3, size=5)
    assert torch.equal(back["ids"], batch["ids"]) and back["nested"][0].shape == (3, 1)


# ---- rows that interact, and the generators (issue 20, point 8) -----------------------------------------------


class InBatchContrastive(nn.Module):
    """CLIP-style in-batch logits: each row scored against every row of the batch, the diagonal the answer."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(100, 16)

    def forward(self, input_ids):
        h = nn.functional.normalize(self.wte(input_ids).mean(dim=1), dim=-1)
        return {"logits": h @ h.t() / 0.1}


class CenteredRows(nn.Module):
    """Batch-centred features (capacity-style coupling without batch-norm): every row moves with the others."""

    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(100, 16), nn.Linear(16, 1)

    def forward(self, input_ids):
        h = self.wte(input_ids).mean(dim=1)
        return {"logits": self.head(h - h.mean(dim=0, keepdim=True)).squeeze(-1)}


class DiagonalLoss(GaudiTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        logits = outputs["logits"]
        if logits.dim() == 2:
            loss = nn.functional.cross_entropy(logits, torch.arange(logits.size(0), device=logits.device))
        else:
            loss = nn.functional.mse_loss(logits, inputs["labels"])
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("net_cls", [InBatchContrastive, CenteredRows])
def test_models_whose_rows_interact_are_not_padded(net_cls, bridge, tmp_path, caplog):
    def run(**kwargs):
        torch.manual_seed(0)
        net = net_cls()
        rows = []
        net.wte.register_forward_pre_hook(lambda module, inputs: rows.append(inputs[0].size(0)))
        args = GaudiTrainingArguments(output_dir=str(tmp_path / str(len(kwargs))), num_train_epochs=1,
                                      per_device_train_batch_size=BATCH, logging_steps=1, report_to=[],
                                      save_strategy="no", seed=0, remove_unused_columns=False, **kwargs)  # fmt: skip
        trainer = DiagonalLoss(model=net, args=args, train_dataset=data("regression"))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], rows

    reference, _ = run(use_cpu=True, use_lazy_mode=True)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        losses, rows = run(use_habana=True, use_lazy_mode=True)
    assert rows == [BATCH] * 8 + [*MASKED_CHECK, *CUT_CHECK, 2]  # checked both ways, then unpadded
    assert "outputs for the real rows change when rows are added" in caplog.text
    assert losses == reference


def test_the_check_leaves_the_gaudis_generator_as_it_found_it(bridge, tmp_path):
    """Dropout on a Gaudi draws from the device's generator: the check's extra forwards must not move it."""
    import habana_frameworks.torch.hpu.random as hpu_random

    if ON_DEVICE:  # a real dropout mask on an hpu tensor, drawn by the device's generator

        def draw():
            nn.functional.dropout(torch.ones(16, device="hpu"), 0.5)
    else:
        draw = hpu_random.draw  # the simulator's stand-in for a draw on the device

    class DrawsOnTheDevice(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x):
            draw()
            return {"prediction": self.linear(x).squeeze(-1)}

    net, x = DrawsOnTheDevice(), torch.randn(2, 3)
    hpu_random.manual_seed(7)
    draw()  # what one forward draws, alone
    expected = hpu_random.get_rng_state()
    hpu_random.manual_seed(7)
    static = StaticRows(label_names=["labels"], labels_into_forward=True, rng_snapshot=HPUDevice().rng_snapshot)
    with static.padding(net, net, rows=2, size=8):
        net(x)  # checked (two forwards, generators restored), then padded
    assert static.enabled and torch.equal(hpu_random.get_rng_state(), expected)


# ---- the step's graph: a padded short batch compiles nothing new (issue 20, point 7) ----------------------------


def device_ops_per_step(monkeypatch) -> list[list[tuple]]:
    """What a lazy-mode Gaudi compiles per step: the ops the step runs on the device, with their input shapes
    and dtypes (one graph per distinct sequence, the bridge's recipe cache key in effect). Recorded from where
    transformers' training step starts, so the host-side padding before it is not among them, as on a Gaudi."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Trainer

    steps: list[list[tuple]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shapes = tuple(
                (tuple(a.shape), a.dtype) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)
            )
            steps[-1].append((str(func), shapes))
            return func(*args, **(kwargs or {}))

    original = Trainer.training_step

    def recorded(self, *args, **kwargs):
        steps.append([])
        with Record():
            return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", recorded)
    return steps


@pytest.mark.parametrize("task", ["causal_lm", "classification"])
def test_a_masked_short_batch_runs_the_full_batches_graph(task, bridge, tmp_path, monkeypatch):
    steps = device_ops_per_step(monkeypatch)
    train(task, tmp_path, use_habana=True, use_lazy_mode=True, num_train_epochs=2)
    assert len(steps) == 18
    # every step, the short ones (9 and 18) included, is the same sequence of device ops: one graph. The check of
    # the first short batch runs before the step, in evaluation mode: graphs of its own, once per run.
    assert len({tuple(step) for step in steps[1:]}) == 1 and steps[8] == steps[17] == steps[1]


def test_a_cut_short_batch_changes_the_steps_graph_in_lazy_mode(bridge, tmp_path, monkeypatch):
    """The cut padding (a loss that does not skip -100) keeps the forward's shape, not the loss's and backward's:
    in lazy mode the step is another graph. Said in the module docstring; here measured."""
    steps = device_ops_per_step(monkeypatch)
    train("own_compute_loss", tmp_path, use_habana=True, use_lazy_mode=True, num_train_epochs=2)
    assert steps[17] != steps[1]
