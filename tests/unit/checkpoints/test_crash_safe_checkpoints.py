"""Crash-safe checkpoints, in process: what complete means, which checkpoint a resume picks, a checkpoint of another
model refused. Killed at random moments during saves, a full disk, DDP:
tests/integration/checkpoints/test_checkpoints_killed_or_on_a_full_disk.py. Resumed trainings:
tests/integration/checkpoints/test_resumed_trainings.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import tiny
import torch
import transformers
from support import checkpointing_trainer as make_trainer

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import (
    MANIFEST_NAME,
    CheckpointError,
    check_weights_fit,
    checkpoint_problem,
    list_checkpoints,
    resolve_resume,
    rotate_checkpoints,
)
from optimum_gaudi.errors import UserError

# ---- what complete means, what resume picks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    make_trainer(out, max_steps=3).train()
    return out


def test_a_checkpoint_is_published_with_a_manifest_and_no_staging_left(finished_run):
    assert [p.name for p in list_checkpoints(finished_run)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert not list(finished_run.glob(".staging-*"))
    manifest = json.loads((finished_run / "checkpoint-3" / MANIFEST_NAME).read_text())["files"]
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state.pth"} <= set(manifest)
    assert all((finished_run / "checkpoint-3" / name).stat().st_size == size for name, size in manifest.items())


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_resume_latest_skips_incomplete_checkpoints_with_one_warning(finished_run, tmp_path, caplog):
    run = _copy_run(finished_run, tmp_path / "run")
    (run / "checkpoint-3" / "optimizer.pt").write_bytes(b"")  # as a kill in a non-atomic save leaves it
    (run / "checkpoint-4").mkdir()
    (run / "checkpoint-4" / "config.json").write_text("{}")
    (run / ".staging-checkpoint-5" / "checkpoint-5").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi.checkpoints"):
        assert resolve_resume(True, run) == str(run / "checkpoint-2")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "checkpoint-4 (has no trainer_state.json)" in warnings[0] and "checkpoint-3 (optimizer.pt" in warnings[0]
    assert "resuming from checkpoint-2" in warnings[0]


def test_training_resumes_from_the_newest_complete_checkpoint_and_cleans_staging(finished_run, tmp_path):
    run = _copy_run(finished_run, tmp_path / "run")
    (run / "checkpoint-3" / "trainer_state.json").unlink()
    (run / ".staging-checkpoint-9" / "checkpoint-9").mkdir(parents=True)
    (run / ".staging-notes").mkdir()  # the user's: not a name we give
    trainer = make_trainer(run, max_steps=4)
    trainer.train(resume_from_checkpoint=True)
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]  # 1, 2 from checkpoint-2
    assert [p.name for p in run.glob(".staging-*")] == [".staging-notes"]
    assert checkpoint_problem(run / "checkpoint-3") is None  # written again, complete this time
    assert checkpoint_problem(run / "checkpoint-4") is None


def _killed_after_a_publish(finished_run: Path, run: Path) -> Path:
    """What SIGKILL between a publish and its rotation leaves: three checkpoints under --save_total_limit 2 and
    the empty staging directory; beside them a directory of the user's whose name starts like ours."""
    _copy_run(finished_run, run)
    (run / ".staging-checkpoint-3").mkdir()
    (run / ".staging-notes").mkdir()
    return run


def test_a_resumed_run_first_tidies_what_a_kill_after_a_publish_left(finished_run, tmp_path):
    run = _killed_after_a_publish(finished_run, tmp_path / "run")
    make_trainer(run, max_steps=3, save_strategy="no", save_total_limit=2).train(resume_from_checkpoint=True)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]
    assert sorted(p.name for p in run.glob(".staging-*")) == [".staging-notes"]


def test_tidying_keeps_the_checkpoint_resumed_from_and_the_newest(finished_run, tmp_path):
    run = _killed_after_a_publish(finished_run, tmp_path / "run")
    resumed = make_trainer(run, max_steps=1, save_strategy="no", save_total_limit=2)
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-1"))
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-1", "checkpoint-3"]
    fresh = _killed_after_a_publish(finished_run, tmp_path / "fresh")
    make_trainer(fresh, max_steps=1, save_strategy="no", save_total_limit=2, overwrite_output_dir=False).train()
    assert len(list_checkpoints(fresh)) == 3  # not resuming: another run's checkpoints are not this run's to rotate
    assert sorted(p.name for p in fresh.glob(".staging-*")) == [".staging-notes"]


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_finished_runs_output_dir_is_not_a_checkpoint(finished_run, tmp_path, checkpoints):
    """save_model and save_state leave weights and a trainer state at its top, but no optimizer or scheduler:
    transformers would resume from it with a fresh optimizer (with --save_strategy no there is no checkpoint-N)."""
    run = _copy_run(finished_run, tmp_path / "run")
    for name in ("model.safetensors", "config.json", "trainer_state.json", "training_args.bin"):
        shutil.copy(run / "checkpoint-3" / name, run / name)
    if not checkpoints:
        for checkpoint in list_checkpoints(run):
            shutil.rmtree(checkpoint)
    problem = checkpoint_problem(run)
    assert problem.startswith("is a saved model, not a checkpoint: it has no optimizer.pt or scheduler.pt"), problem
    assert ("it holds checkpoint-1, checkpoint-2, checkpoint-3: pass " in problem) == checkpoints
    with pytest.raises(CheckpointError, match="is a saved model, not a checkpoint"):
        make_trainer(tmp_path / "new", max_steps=4).train(resume_from_checkpoint=str(run))


def test_a_checkpoint_saved_with_save_only_model_needs_no_optimizer(tmp_path):
    make_trainer(tmp_path / "run", max_steps=1, save_only_model=True).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert not (checkpoint / "optimizer.pt").exists() and checkpoint_problem(checkpoint) is None
    (checkpoint / "training_args.bin").unlink()  # then nothing says the optimizer was left out on purpose
    (checkpoint / MANIFEST_NAME).unlink()
    assert checkpoint_problem(checkpoint).endswith("it has no optimizer.pt or scheduler.pt")


def test_save_total_limit_never_deletes_the_newest_complete_checkpoint(finished_run, tmp_path):
    run = _copy_run(finished_run, tmp_path / "run")
    for step in (7, 8):  # newer but incomplete, e.g. from an older version killed mid-save
        (run / f"checkpoint-{step}").mkdir()
        (run / f"checkpoint-{step}" / "config.json").write_text("{}")
    rotate_checkpoints(run, 2, keep=set())
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]
    rotate_checkpoints(run, 1, keep={str(run / "checkpoint-2")})
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]


def test_save_total_limit_during_training(tmp_path):
    make_trainer(tmp_path / "run", max_steps=4, save_total_limit=2).train()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-3", "checkpoint-4"]


def test_best_model_checkpoint_names_the_published_directory(tmp_path):
    trainer = make_trainer(
        tmp_path / "run", eval_dataset=tiny.lm_data()[:8], max_steps=3, eval_strategy="steps", eval_steps=1,
        metric_for_best_model="loss", load_best_model_at_end=True,
    )  # fmt: skip
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert best.parent == tmp_path / "run" and best.is_dir()
    saved = json.loads((best / "trainer_state.json").read_text())
    assert Path(saved["best_model_checkpoint"]) == best  # the published name, never the staging directory


def test_resume_true_without_a_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        make_trainer(tmp_path / "run", max_steps=1).train(resume_from_checkpoint=True)


def transformers_words(module_file: str, words: str) -> re.Pattern:
    """The f-string message of the installed transformers that contains ``words``, as a pattern (its fields
    match anything): read from its source, so a reworded transformers fails here rather than in a user's code."""
    source = (Path(transformers.__file__).parent / module_file).read_text(encoding="utf-8")
    literals = [m.group(1) for m in re.finditer(r'\bf"((?:[^"\\]|\\.)*)"', source) if words in m.group(1)]
    assert len(literals) == 1, f"transformers' {module_file} has {len(literals)} messages with {words!r}"
    parts = re.split(r"\{[^{}]*\}", literals[0])
    return re.compile(".+?".join(re.escape(part) for part in parts))


def test_resume_mistakes_start_with_transformers_words_and_are_value_errors(tmp_path):
    """Code and tests written for transformers.Trainer (its own test suite included) match these words and catch
    ValueError; GaudiTrainer refuses the same mistakes earlier, so its messages begin with them."""
    bogus = tmp_path / "run" / "checkpoint-1-bogus"
    with pytest.raises(ValueError) as missing:
        make_trainer(tmp_path / "run", max_steps=1).train(resume_from_checkpoint=str(bogus))
    assert transformers_words("trainer.py", "Can't find a valid checkpoint at").match(str(missing.value))
    assert f"--resume_from_checkpoint {bogus} does not exist" in str(missing.value)  # then ours
    with pytest.raises(ValueError) as nothing:
        make_trainer(tmp_path / "fresh", max_steps=1).train(resume_from_checkpoint=True)
    assert transformers_words("trainer.py", "No valid checkpoint found in output directory").match(str(nothing.value))
    assert str(tmp_path / "fresh") in str(nothing.value) and "holds no checkpoint" in str(nothing.value)
    assert isinstance(missing.value, UserError) and isinstance(nothing.value, UserError)  # one line, exit 2


def test_an_unknown_report_to_starts_with_transformers_words_and_is_a_value_error(tmp_path):
    with pytest.raises(ValueError) as unknown:
        args = GaudiTrainingArguments(output_dir=str(tmp_path / "run"), report_to="nosuch")
        GaudiTrainer(model=tiny.gpt2(), args=args, train_dataset=tiny.lm_data())
    assert isinstance(unknown.value, UserError)
    pattern = transformers_words("integrations/integration_utils.py", "is not supported, only")
    assert pattern.match(str(unknown.value)) and str(unknown.value).startswith("nosuch is not supported")


# ---- a checkpoint of another model -------------------------------------------------------------------------


def _save_weights(model, directory: Path, kind: str) -> Path:
    """``model``'s weights as a checkpoint holds them: one safetensors file, shards with an index, or a torch file."""
    if kind == "bin":
        directory.mkdir(parents=True)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    else:
        model.save_pretrained(directory, max_shard_size="20KB" if kind == "sharded" else "5GB")
    return directory


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "bin"])
@pytest.mark.parametrize(
    "other, words",
    [
        ({"n_layer": 2}, "it has 12 weight(s) (transformer.h.1."),  # none differs in shape
        ({"n_embd": 64}, "is 100x64 there and 100x32 here"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_in_every_weight_format(tmp_path, kind, other, words):
    checkpoint = _save_weights(tiny.gpt2(**other), tmp_path / "ckpt", kind)
    if kind == "sharded":
        assert (checkpoint / "model.safetensors.index.json").is_file()
    with pytest.raises(CheckpointError, match="holds another model") as refused:
        check_weights_fit(tiny.gpt2(), checkpoint)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(CheckpointError, match="holds another model"):  # fewer layers than the model
        check_weights_fit(tiny.gpt2(**{**other, "n_layer": 3}), checkpoint)


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "bin"])
def test_a_checkpoint_of_the_same_model_fits_in_every_weight_format(tmp_path, kind):
    check_weights_fit(tiny.gpt2(), _save_weights(tiny.gpt2(seed=1), tmp_path / "ckpt", kind))  # lm_head is tied


def test_lora_adapters_of_another_rank_are_refused(tmp_path):
    peft = pytest.importorskip("peft")

    def lora(rank):
        return peft.get_peft_model(tiny.gpt2(), peft.LoraConfig(r=rank, target_modules=["c_attn"]))

    lora(4).save_pretrained(tmp_path / "ckpt")
    check_weights_fit(lora(4), tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="lora_A.weight is 4x32 there and 8x32 here"):
        check_weights_fit(lora(8), tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="holds another model"):  # adapters, and a model without any
        check_weights_fit(tiny.gpt2(), tmp_path / "ckpt")


# ---- resume judges the checkpoint by what it holds (issue 21, point 2) --------------------------------------


class _Observer(torch.nn.Module):
    """Grows a buffer while training (as torch.ao observers do) and resizes it when loading."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("data_order", torch.zeros(0, dtype=torch.long))
        self._register_load_state_dict_pre_hook(self._resize)

    def _resize(self, state_dict, prefix, *args) -> None:
        saved = state_dict.get(prefix + "data_order")
        if saved is not None:
            self.data_order = torch.empty_like(saved)

    def forward(self, x):
        if self.training:
            self.data_order = torch.cat([self.data_order, self.data_order.new_tensor([len(self.data_order)])])
        return x


def _observed_gpt2():
    model = tiny.gpt2()
    model.transformer.observer = _Observer()
    model.transformer.wte.register_forward_hook(lambda module, args, out: model.transformer.observer(out))
    return model


def _train_observed(trainer_cls, out: Path, max_steps: int, resume: str | None = None):
    from transformers import Trainer, TrainingArguments

    args_cls = TrainingArguments if trainer_cls is Trainer else GaudiTrainingArguments
    args = args_cls(
        output_dir=str(out), per_device_train_batch_size=4, report_to="none", disable_tqdm=True,
        max_steps=max_steps, save_strategy="steps", save_steps=3, seed=0,
    )  # fmt: skip
    trainer = trainer_cls(model=_observed_gpt2(), args=args, train_dataset=tiny.lm_data())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_buffer_that_changes_in_training_does_not_make_another_model(tmp_path):
    from transformers import Trainer

    for trainer_cls in (Trainer, GaudiTrainer):
        out = tmp_path / trainer_cls.__name__
        _train_observed(trainer_cls, out, 3)
        resumed = _train_observed(trainer_cls, out, 6, str(out / "checkpoint-3"))  # transformers resumes: so do we
        assert resumed.model.transformer.observer.data_order.tolist() == list(range(6)), trainer_cls
    other = _observed_gpt2()
    other.transformer.wpe = torch.nn.Embedding(8, 32)  # a parameter of another shape still decides
    with pytest.raises(CheckpointError, match="transformer.wpe.weight is 16x32 there and 8x32 here"):
        check_weights_fit(other, tmp_path / "GaudiTrainer" / "checkpoint-3")


@pytest.mark.parametrize("resave", ["sharded", "single-bf16"])
def test_a_checkpoint_whose_weights_were_saved_again_resumes_with_one_warning(finished_run, tmp_path, resave, caplog):
    from transformers import GPT2LMHeadModel

    run = _copy_run(finished_run, tmp_path / "run")
    checkpoint = run / "checkpoint-3"
    model = GPT2LMHeadModel.from_pretrained(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    if resave == "sharded":
        model.save_pretrained(checkpoint, max_shard_size="20KB")
        assert (checkpoint / "model.safetensors.index.json").is_file()
    else:
        model.to(torch.bfloat16).save_pretrained(checkpoint)  # same name, another size than the manifest's
    assert checkpoint_problem(checkpoint) is None
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi.checkpoints"):
        assert resolve_resume(True, run) == str(checkpoint)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "checkpoint-3" in warnings[0] and "saved again" in warnings[0], warnings
    make_trainer(run, max_steps=4).train(resume_from_checkpoint=True)

    # what is there still has to be complete, and the refusal says what to do
    shard = sorted(checkpoint.glob("model-*.safetensors")) or [checkpoint / "model.safetensors"]
    shard[0].write_bytes(shard[0].read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="is truncated .*; pass a complete checkpoint-N directory"):
        resolve_resume(str(checkpoint), run)
    if resave == "sharded":
        shard[0].unlink()
        with pytest.raises(CheckpointError, match="which is missing; pass a complete checkpoint-N directory"):
            resolve_resume(str(checkpoint), run)


def test_run_totals_are_saved_beside_the_state_and_older_checkpoints_still_carry_them(finished_run, tmp_path):
    from optimum_gaudi.trainers.checkpointing import RUN_TOTALS_FILE, RUN_TOTALS_KEY

    run = _copy_run(finished_run, tmp_path / "run")
    checkpoint = run / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert RUN_TOTALS_KEY not in state["stateful_callbacks"]
    # as older versions wrote it: the totals among the callback states (and no manifest)
    state["stateful_callbacks"][RUN_TOTALS_KEY] = json.loads((checkpoint / RUN_TOTALS_FILE).read_text())
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    for name in (RUN_TOTALS_FILE, MANIFEST_NAME):
        (checkpoint / name).unlink()
    shutil.rmtree(run / "checkpoint-3")
    output = make_trainer(run, max_steps=4, log_throughput_and_memory=True).train(resume_from_checkpoint=True)
    assert output.metrics["train_throughput_steps"] == 4  # steps 1 and 2 carried over
    resaved = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    assert RUN_TOTALS_KEY not in resaved["stateful_callbacks"] and (run / "checkpoint-4" / RUN_TOTALS_FILE).is_file()
