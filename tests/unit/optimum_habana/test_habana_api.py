"""optimum-habana's API shapes: GaudiTrainer(model, gaudi_config, args, ...), the GaudiConfig methods its scripts
call, and `optimum_gaudi.utils` (set_seed, check_optimum_habana_min_version, adapt_transformers_to_gaudi).

`optimum_gaudi.utils` in a fresh process: tests/integration/optimum_habana/test_habana_api_in_a_fresh_process.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny import losses
from transformers import Seq2SeqTrainingArguments, Trainer, TrainingArguments

from optimum_gaudi import (
    GaudiConfig,
    GaudiConfigError,
    GaudiSeq2SeqTrainer,
    GaudiSeq2SeqTrainingArguments,
    GaudiTrainer,
    GaudiTrainingArguments,
)
from optimum_gaudi.precision.op_lists import BF16_LIST_ENV, FP32_LIST_ENV, resolve_op_lists


def _kwargs(tmp_path):
    return dict(output_dir=str(tmp_path), report_to=[], max_steps=3, per_device_train_batch_size=4, logging_steps=1)


# ---- GaudiTrainer(model, gaudi_config, args, ...) --------------------------------------------------------------


def test_optimum_habana_positional_order_trains_like_trainer(tiny_gpt2, tiny_lm_data, tmp_path):
    config = GaudiConfig()
    args = GaudiTrainingArguments(**_kwargs(tmp_path / "g"))
    gaudi = GaudiTrainer(tiny_gpt2(), config, args, None, tiny_lm_data)  # model, gaudi_config, args, collator, data
    assert gaudi.gaudi_config is config and gaudi.args is args and gaudi.train_dataset is tiny_lm_data
    gaudi_losses = losses(gaudi)
    reference = Trainer(tiny_gpt2(), TrainingArguments(**_kwargs(tmp_path / "t")), None, tiny_lm_data)
    assert gaudi_losses == pytest.approx(losses(reference), abs=1e-6)


def test_transformers_order_and_a_none_gaudi_config_slot_still_work(tiny_gpt2, tiny_lm_data, tmp_path):
    args = GaudiTrainingArguments(**_kwargs(tmp_path))
    plain = GaudiTrainer(tiny_gpt2(), args, None, tiny_lm_data)
    assert plain.args is args and plain.train_dataset is tiny_lm_data and plain.gaudi_config == GaudiConfig()
    habana_none = GaudiTrainer(tiny_gpt2(), None, args, None, tiny_lm_data)
    assert habana_none.args is args and habana_none.train_dataset is tiny_lm_data


def test_gaudi_config_given_twice_is_refused(tiny_gpt2, tmp_path):
    args = GaudiTrainingArguments(**_kwargs(tmp_path))
    with pytest.raises(TypeError, match="gaudi_config was given twice"):
        GaudiTrainer(tiny_gpt2(), GaudiConfig(), args, gaudi_config=GaudiConfig())


def test_seq2seq_trainer_takes_the_optimum_habana_order(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, decoder_start_token_id=0)
    )
    config = GaudiConfig(use_fused_adam=True)
    args = GaudiSeq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], predict_with_generate=True)
    trainer = GaudiSeq2SeqTrainer(model, config, args)
    assert trainer.gaudi_config is config and trainer.args is args
    assert isinstance(trainer.args, Seq2SeqTrainingArguments)


# ---- GaudiConfig methods -------------------------------------------------------------------------------------


def test_to_json_file_round_trips(tmp_path):
    config = GaudiConfig(use_fused_adam=True, use_torch_autocast=True, autocast_bf16_ops=["linear"])
    path = config.to_json_file(tmp_path / "my_config.json")
    assert GaudiConfig.from_json_file(path) == config
    assert json.loads(config.to_json_string()) == config.to_dict()


def test_write_bf16_fp32_ops_to_text_files_writes_the_lists_the_config_means(tmp_path):
    config = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["linear", "matmul"])  # fp32 list left out
    bf16_file, fp32_file = tmp_path / "lower.txt", tmp_path / "fp32.txt"
    config.write_bf16_fp32_ops_to_text_files(bf16_file, fp32_file)
    bf16, fp32 = resolve_op_lists(["linear", "matmul"], None)  # a list left out means Habana's default
    assert bf16_file.read_text().splitlines() == bf16 == ["linear", "matmul"]
    assert fp32_file.read_text().splitlines() == fp32 and fp32


def test_declare_autocast_ops_sets_the_bridge_variables(monkeypatch):
    monkeypatch.delenv(BF16_LIST_ENV, raising=False)
    monkeypatch.delenv(FP32_LIST_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "habana_frameworks.torch.core", raising=False)
    config = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["linear"], autocast_fp32_ops=["softmax"])
    declared = config.declare_autocast_bf16_fp32_ops()
    assert set(declared) == {BF16_LIST_ENV, FP32_LIST_ENV}
    assert Path(declared[BF16_LIST_ENV]).read_text().split() == ["linear"]
    assert Path(declared[FP32_LIST_ENV]).read_text().split() == ["softmax"]
    import os

    assert os.environ[BF16_LIST_ENV] == declared[BF16_LIST_ENV]


def test_declare_autocast_ops_after_the_bridge_loaded_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.core", object())
    with pytest.raises(GaudiConfigError, match=r"^declare_autocast_bf16_fp32_ops: habana_frameworks is already"):
        GaudiConfig(use_torch_autocast=True).declare_autocast_bf16_fp32_ops()


def test_push_to_hub_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(GaudiConfigError, match=r"push_to_hub\('me/cfg'\) needs the Hugging Face Hub.*HF_HUB_OFFLINE"):
        GaudiConfig().push_to_hub("me/cfg")


def test_push_to_hub_uploads_gaudi_config_json(monkeypatch):
    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            uploaded["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            uploaded["repo"] = (repo_id, private, exist_ok)

        def upload_file(self, path_or_fileobj, path_in_repo, repo_id, commit_message, revision):
            uploaded.update(content=path_or_fileobj, path=path_in_repo, message=commit_message)
            return "https://huggingface.co/me/cfg/commit/1"

    import huggingface_hub

    monkeypatch.setattr("optimum_gaudi.configuration.gaudi_config.require_hub", lambda what, hint: None)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    config = GaudiConfig(use_fused_adam=True)
    assert config.push_to_hub("me/cfg", token="t") == "https://huggingface.co/me/cfg/commit/1"
    assert uploaded["repo"] == ("me/cfg", None, True) and uploaded["path"] == "gaudi_config.json"
    assert json.loads(uploaded["content"]) == config.to_dict() and uploaded["token"] == "t"


def test_set_seed_seeds_torch_as_transformers_does():
    from optimum_gaudi.utils import set_seed
    from transformers import set_seed as hf_set_seed

    set_seed(7)
    ours = torch.rand(3)
    hf_set_seed(7)
    assert torch.equal(ours, torch.rand(3))


def test_set_seed_seeds_the_gaudi_generator_on_the_simulator(bridge):
    from optimum_gaudi.utils import set_seed

    set_seed(11)
    assert [c.args for c in bridge().calls_named("hpu.random.manual_seed")][-1] == (11,)


def test_check_optimum_habana_min_version_is_accepted():
    from optimum_gaudi.utils import check_optimum_habana_min_version

    assert check_optimum_habana_min_version("1.19.0.dev0") is None


def test_adapt_transformers_to_gaudi_registers_gaudi_fused_sdpa_and_swaps_no_class(tiny_gpt2):
    from optimum_gaudi.utils import adapt_transformers_to_gaudi
    from transformers import AttentionInterface, GPT2LMHeadModel

    adapt_transformers_to_gaudi()
    assert "gaudi_fused_sdpa" in AttentionInterface._global_mapping
    import transformers.models.gpt2.modeling_gpt2 as gpt2_module

    assert gpt2_module.GPT2LMHeadModel is GPT2LMHeadModel  # no model class replaced
    model = tiny_gpt2()
    model.set_attn_implementation("gaudi_fused_sdpa")
    model(torch.zeros(1, 4, dtype=torch.long))
