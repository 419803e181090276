"""The Gaudi features as a mixin: a user's own Trainer subclass becomes a Gaudi trainer in one line."""

from dataclasses import dataclass, field, fields

import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import FALLBACK_DEVICE
from tiny import losses
from transformers import Trainer, TrainingArguments

from optimum_gaudi import (
    GaudiArgumentError,
    GaudiConfig,
    GaudiTrainer,
    GaudiTrainerMixin,
    GaudiTrainingArguments,
    GaudiTrainingArgumentsMixin,
)
from optimum_gaudi.trainers.compat import TRAINER_HOOKS, TrainerHookError

COMMON = dict(max_steps=5, per_device_train_batch_size=4, logging_steps=1, report_to=[], seed=0, save_strategy="no")


class LabelSmoothingTrainer(Trainer):
    """A user's Trainer: its own constructor keyword and its own loss."""

    def __init__(self, model=None, args=None, smoothing: float = 0.0, **kwargs):
        self.smoothing = smoothing
        self.losses_seen = []
        super().__init__(model=model, args=args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.size(-1))
        labels = inputs["labels"][:, 1:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=self.smoothing)
        self.losses_seen.append(loss.item())
        return (loss, outputs) if return_outputs else loss


class GaudiLabelSmoothingTrainer(GaudiTrainerMixin, LabelSmoothingTrainer):
    pass


@dataclass
class MyArguments(TrainingArguments):
    """A user's arguments with a field of their own."""

    smoothing: float = field(default=0.0)


@dataclass
class GaudiMyArguments(GaudiTrainingArgumentsMixin, MyArguments):
    pass


def test_user_subclass_made_gaudi_in_one_line_equals_its_parent(tiny_gpt2, tiny_lm_data, tmp_path):
    # Each trainer is built right before it trains: Trainer seeds the RNG at construction (dropout).
    ref = LabelSmoothingTrainer(
        tiny_gpt2(), MyArguments(output_dir=str(tmp_path / "a"), smoothing=0.1, **COMMON), 0.1,
        train_dataset=tiny_lm_data,
    )  # fmt: skip
    ref_losses = losses(ref)
    got = GaudiLabelSmoothingTrainer(
        tiny_gpt2(), GaudiMyArguments(output_dir=str(tmp_path / "b"), smoothing=0.1, **COMMON), 0.1,
        train_dataset=tiny_lm_data,
    )  # fmt: skip
    got_losses = losses(got)
    assert len(got_losses) == 5
    assert got_losses == ref_losses
    assert got.losses_seen == ref.losses_seen  # the user's compute_loss ran, with their smoothing
    assert got.smoothing == 0.1 and got.gaudi_config == GaudiConfig()


def test_args_found_by_keyword_or_position_and_gaudi_config_keyword_composes(tiny_gpt2, tiny_lm_data, tmp_path):
    args = GaudiMyArguments(output_dir=str(tmp_path), **COMMON)
    by_keyword = GaudiLabelSmoothingTrainer(model=tiny_gpt2(), args=args, gaudi_config="gpt2")
    by_position = GaudiLabelSmoothingTrainer(tiny_gpt2(), args, 0.2, gaudi_config=GaudiConfig(use_fused_adam=True))
    assert by_keyword.args is args and by_position.args is args
    assert by_keyword.gaudi_config == GaudiConfig.from_pretrained("gpt2")
    assert by_position.gaudi_config.use_fused_adam and by_position.smoothing == 0.2


class PassThroughTrainer(Trainer):
    """A user's Trainer whose constructor only passes everything on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


class GaudiPassThroughTrainer(GaudiTrainerMixin, PassThroughTrainer):
    pass


def test_args_found_through_a_pass_through_constructor(tiny_gpt2, tmp_path, monkeypatch):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), **COMMON)
    assert GaudiPassThroughTrainer(tiny_gpt2(), args).args is args
    assert GaudiPassThroughTrainer(model=tiny_gpt2(), args=args).args is args
    monkeypatch.chdir(tmp_path)
    assert isinstance(GaudiPassThroughTrainer(tiny_gpt2(), None).args, GaudiTrainingArguments)
    with pytest.raises(TypeError, match="GaudiPassThroughTrainer needs GaudiTrainingArguments"):
        GaudiPassThroughTrainer(tiny_gpt2(), TrainingArguments(output_dir=str(tmp_path)))


def test_gaudi_features_apply_to_the_user_subclass(tiny_gpt2, tiny_lm_data, tmp_path):
    args = GaudiMyArguments(output_dir=str(tmp_path), optim="adamw_torch", **COMMON)
    trainer = GaudiLabelSmoothingTrainer(
        tiny_gpt2(), args, train_dataset=tiny_lm_data, gaudi_config=GaudiConfig(use_fused_adam=True)
    )
    assert len(losses(trainer)) == 5
    assert trainer.optimizer.optimizer.defaults.get("fused") is True  # create_optimizer hook of the mixin
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "gaudi_config.json").exists()  # _save hook of the mixin


class PlainContextTrainer(Trainer):
    """A user's Trainer whose loss context is a plain context manager, not transformers' ExitStack."""

    def compute_loss_context_manager(self):
        return torch.autocast("cpu", enabled=False)


class GaudiPlainContextTrainer(GaudiTrainerMixin, PlainContextTrainer):
    pass


def test_pipelining_wraps_a_user_loss_context_that_is_no_exit_stack(tiny_gpt2, tiny_lm_data, tmp_path):
    def train(**flags):
        args = GaudiTrainingArguments(output_dir=str(tmp_path), **COMMON, **flags)
        return losses(GaudiPlainContextTrainer(tiny_gpt2(), args, train_dataset=tiny_lm_data))

    assert train(use_lazy_mode=True, pipelining_fwd_bwd=True) == train()  # no-ops on CPU


def test_missing_args_get_the_declared_gaudi_arguments_class(tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = GaudiLabelSmoothingTrainer(model=tiny_gpt2())
    assert isinstance(trainer.args, GaudiTrainingArguments)


def test_arguments_mixin_composes_fields_validation_and_post_init(tmp_path):
    args = GaudiMyArguments(output_dir=str(tmp_path), smoothing=0.3, use_habana=True, throughput_warmup_steps=2)
    assert isinstance(args, MyArguments) and isinstance(args, GaudiTrainingArgumentsMixin)
    assert args.smoothing == 0.3 and args.gaudi_flags()["throughput_warmup_steps"] == 2
    assert args.gaudi_device.type == FALLBACK_DEVICE  # the mixin's __post_init__ ran, then the parent's
    assert args.use_cpu == (FALLBACK_DEVICE == "cpu")
    names = {f.name for f in fields(GaudiMyArguments)}
    assert {"smoothing", "use_lazy_mode", "learning_rate"} <= names
    from optimum_gaudi.trainers.removed_args import RemovedTrainingArguments
    from optimum_gaudi.trainers.use_cache import UseCacheOffTheCommandLine

    # transformers 4 arguments and transformers 5's use_cache are not Gaudi flags
    removed = {f.name for f in (*fields(RemovedTrainingArguments), *fields(UseCacheOffTheCommandLine))}
    assert set(args.gaudi_flags()) == {f.name for f in fields(GaudiTrainingArgumentsMixin)} - removed
    with pytest.raises(GaudiArgumentError, match="pipelining_fwd_bwd"):
        GaudiMyArguments(output_dir=str(tmp_path), pipelining_fwd_bwd=True)


def test_user_arguments_without_the_mixin_are_refused_with_a_hint(tiny_gpt2, tmp_path):
    with pytest.raises(TypeError, match="GaudiLabelSmoothingTrainer needs GaudiTrainingArguments"):
        GaudiLabelSmoothingTrainer(model=tiny_gpt2(), args=MyArguments(output_dir=str(tmp_path)))


def test_gaudi_trainer_is_the_mixin_on_trainer():
    assert GaudiTrainer.__bases__ == (GaudiTrainerMixin, Trainer)
    assert GaudiTrainingArguments.__bases__ == (GaudiTrainingArgumentsMixin, TrainingArguments)


def test_every_trainer_method_the_mixin_overrides_is_a_checked_hook():
    after_mixin = super(GaudiTrainerMixin, GaudiTrainer)  # the shims of this release, then Trainer
    overridden = {name for name in vars(GaudiTrainerMixin) if callable(getattr(after_mixin, name, None))}
    assert overridden - {"__init__"} == set(TRAINER_HOOKS)


def test_a_missing_hook_fails_at_construction_in_one_line(tiny_gpt2, tmp_path, monkeypatch):
    class OldTrainer(Trainer):
        pass

    class GaudiOld(GaudiTrainerMixin, OldTrainer):
        pass

    # A release without Trainer._save (which saves the Gaudi config next to the model): no parent defines it.
    monkeypatch.delattr(Trainer, "_save")
    with pytest.raises(TrainerHookError, match=r"has no Trainer\._save, which the Gaudi features") as err:
        GaudiOld(model=tiny_gpt2(), args=GaudiTrainingArguments(output_dir=str(tmp_path)))
    assert "\n" not in str(err.value)


def test_fused_clip_goes_through_the_device_on_every_supported_release(tiny_gpt2, tiny_lm_data, tmp_path):
    """transformers >= 5.3 calls the _clip_grad_norm hook; older releases reach it through compat's shim."""
    args = GaudiTrainingArguments(output_dir=str(tmp_path), **COMMON)
    trainer = GaudiTrainer(
        tiny_gpt2(), args, train_dataset=tiny_lm_data, gaudi_config=GaudiConfig(use_fused_clip_norm=True)
    )
    calls = []
    clip = trainer.gaudi_device.clip_grad_norm_
    trainer.gaudi_device.clip_grad_norm_ = lambda params, max_norm: calls.append(max_norm) or clip(params, max_norm)
    assert len(losses(trainer)) == 5
    assert calls == [args.max_grad_norm] * 5  # once per optimizer step, with the arguments' max norm


@pytest.fixture
def fresh_accelerator_state():
    """A new accelerate state for each trainer built through it: accelerate keeps one mixed precision per
    process, and the first trainer's would otherwise stay."""

    def fresh():
        AcceleratorState._reset_state()

    fresh()
    yield fresh
    fresh()


def test_op_list_autocast_replaces_accelerates_mixed_precision_on_every_release(
    tiny_gpt2, tmp_path, fresh_accelerator_state
):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), bf16=True, **COMMON)
    with_lists = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["linear"], autocast_fp32_ops=["softmax"])
    assert GaudiTrainer(tiny_gpt2(), args, gaudi_config=with_lists).accelerator.mixed_precision == "no"
    fresh_accelerator_state()
    assert GaudiTrainer(tiny_gpt2(), args).accelerator.mixed_precision == "bf16"  # plain --bf16: accelerate's
