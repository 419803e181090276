"""TRL's SFT, DPO and GRPO trainers made Gaudi trainers by composition: a tiny causal LM, a few CPU steps."""

import logging
import math
import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl")

from conftest import FALLBACK_DEVICE  # noqa: E402
from datasets import Dataset  # noqa: E402
from optimum_gaudi.trl import (  # noqa: E402
    GaudiDPOConfig,
    GaudiDPOTrainer,
    GaudiGRPOConfig,
    GaudiGRPOTrainer,
    GaudiSFTConfig,
    GaudiSFTTrainer,
)
from tiny import losses  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from optimum_gaudi import GaudiConfig, GaudiTrainerMixin, GaudiTrainingArgumentsMixin  # noqa: E402
from optimum_gaudi.data.corpus import default_corpus_texts, default_tokenizer  # noqa: E402
from optimum_gaudi.trainers.training_args import GaudiArgumentError  # noqa: E402

COMMON = dict(
    max_steps=3, per_device_train_batch_size=4, logging_steps=1, report_to=[], seed=0, save_strategy="no",
    bf16=False, gradient_checkpointing=False, learning_rate=1e-3, dataloader_num_workers=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()  # trained on the embedded corpus once, then cached


@pytest.fixture
def tiny_lm(tokenizer):
    def make():
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=len(tokenizer), n_layer=1, n_embd=32, n_head=2, n_positions=128,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        return GPT2LMHeadModel(config)

    return make


def test_trl_classes_are_the_mixins_on_the_installed_trl():
    for gaudi, base in ((GaudiSFTTrainer, SFTTrainer), (GaudiDPOTrainer, DPOTrainer), (GaudiGRPOTrainer, GRPOTrainer)):
        assert gaudi.__bases__ == (GaudiTrainerMixin, base)
    for gaudi, base in ((GaudiSFTConfig, SFTConfig), (GaudiDPOConfig, DPOConfig), (GaudiGRPOConfig, GRPOConfig)):
        assert gaudi.__bases__ == (GaudiTrainingArgumentsMixin, base)


def test_sft_on_the_embedded_corpus_matches_trl(tiny_lm, tokenizer, tmp_path):
    data = Dataset.from_dict({"text": default_corpus_texts()[:24]})
    kwargs = dict(**COMMON, max_length=64)

    def build(trainer_cls, config_cls, out, **extra):
        config = config_cls(output_dir=str(tmp_path / out), **kwargs)
        return trainer_cls(model=tiny_lm(), args=config, train_dataset=data, processing_class=tokenizer, **extra)

    ref = losses(build(SFTTrainer, SFTConfig, "a"))
    got_trainer = build(GaudiSFTTrainer, GaudiSFTConfig, "b")
    got = losses(got_trainer)
    assert len(got) == 3 and got == ref
    assert got[-1] < got[0]  # it learns
    fused = losses(build(GaudiSFTTrainer, GaudiSFTConfig, "c", gaudi_config=GaudiConfig(use_fused_adam=True)))
    assert fused == pytest.approx(ref, rel=1e-4)  # the Gaudi hooks run inside TRL's loop: same update rule


def preference_data():
    """Prompts about the standard library, a preferred answer quoting its docs and a rejected one."""
    texts = default_corpus_texts()
    rows = []
    for i in range(12):
        words = texts[i].split()
        rows.append(
            {
                "prompt": f"Describe {words[0]}",
                "chosen": " " + " ".join(words[1:9]),
                "rejected": " no idea " * (1 + i % 3),
            }
        )
    return Dataset.from_list(rows)


def test_dpo_on_a_small_preference_set_matches_trl(tiny_lm, tokenizer, tmp_path):
    data = preference_data()
    kwargs = dict(**COMMON, max_length=48, beta=0.1)

    def build(trainer_cls, config_cls, out):
        config = config_cls(output_dir=str(tmp_path / out), **kwargs)
        # ref_model before args, positionally: the mixin finds args by DPOTrainer's own signature
        return trainer_cls(tiny_lm(), tiny_lm(), config, train_dataset=data, processing_class=tokenizer)

    ref = losses(build(DPOTrainer, DPOConfig, "a"))
    got = losses(build(GaudiDPOTrainer, GaudiDPOConfig, "b"))
    assert len(got) == 3 and got == ref
    assert got[0] == pytest.approx(math.log(2), abs=1e-3)  # DPO starts at log 2: policy == reference


def vowel_reward(completions, **kwargs):
    """A small reward: the share of characters in each completion that are vowels."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def test_grpo_with_a_small_reward_matches_trl(tiny_lm, tokenizer, tmp_path):
    data = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(8)]})
    kwargs = dict(**COMMON, num_generations=2, max_completion_length=4, per_device_eval_batch_size=4)
    kwargs.update(max_steps=2, temperature=1.0)

    def build(trainer_cls, config_cls, out):
        config = config_cls(output_dir=str(tmp_path / out), **kwargs)
        return trainer_cls(tiny_lm(), vowel_reward, args=config, train_dataset=data, processing_class=tokenizer)

    def logged(trainer, key):
        return [h[key] for h in trainer.state.log_history if key in h]

    ref_trainer = build(GRPOTrainer, GRPOConfig, "a")
    ref = losses(ref_trainer)
    trainer = build(GaudiGRPOTrainer, GaudiGRPOConfig, "b")
    got = losses(trainer)
    # One policy update per generation: the loss is ~0 by construction (ratio 1, group-centred advantages);
    # the gradient, the sampled completions' rewards and the updated weights carry the comparison.
    assert len(got) == 2 and got == ref
    assert logged(trainer, "reward") == logged(ref_trainer, "reward") and any(logged(trainer, "reward_std"))
    assert logged(trainer, "grad_norm") == logged(ref_trainer, "grad_norm") and all(logged(trainer, "grad_norm"))
    for p, q in zip(ref_trainer.model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert trainer.args.cache_implementation is None  # CPU: TRL's own generation


def test_grpo_config_keeps_generation_shapes_static_on_a_lazy_gaudi(bridge, tmp_path):
    hpu = dict(output_dir=str(tmp_path), use_habana=True, use_lazy_mode=True, bf16=False)  # no bf16 on the simulator
    lazy = GaudiGRPOConfig(**hpu)
    assert lazy.gaudi_device.type == "hpu" and lazy.cache_implementation == "static"
    chosen = GaudiGRPOConfig(**hpu, cache_implementation="dynamic")
    assert chosen.cache_implementation == "dynamic"


def test_importing_without_trl_names_the_extra():
    code = "import sys; sys.modules['trl'] = None; import optimum_gaudi.trl"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: optimum_gaudi.trl needs TRL: pip install optimum-gaudi[trl]"
    )


def test_trl_configs_parse_gaudi_and_trl_flags_from_the_command_line(tmp_path):
    from transformers import HfArgumentParser

    argv = ["--output_dir", str(tmp_path), "--max_length", "32", "--throughput_warmup_steps", "2", "--use_habana"]
    (config,) = HfArgumentParser(GaudiSFTConfig).parse_args_into_dataclasses(argv + ["--bf16", "false"])
    assert config.max_length == 32 and config.throughput_warmup_steps == 2 and config.use_habana
    assert config.gaudi_device.type == FALLBACK_DEVICE  # no Gaudi here: falls back, as GaudiTrainingArguments does


# ---- TRL < 1's keywords and flags (optimum-habana's TRL scripts) ------------------------------------------


def said(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_sft_keywords_trl_1_moved_to_its_config_move_there_with_one_line(tiny_lm, tokenizer, tmp_path, caplog):
    data = Dataset.from_dict({"body": default_corpus_texts()[:8]})
    config = GaudiSFTConfig(output_dir=str(tmp_path), **COMMON)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        trainer = GaudiSFTTrainer(
            tiny_lm(), config, train_dataset=data, tokenizer=tokenizer, dataset_text_field="body",
            max_seq_length=24, dataset_num_proc=1, num_buckets=4,
        )  # fmt: skip
    assert trainer.processing_class is tokenizer
    assert (config.dataset_text_field, config.max_length, config.dataset_num_proc) == ("body", 24, 1)
    lines = said(caplog)
    for old, new in (
        ("tokenizer", "processing_class="),
        ("dataset_text_field", "GaudiSFTConfig(dataset_text_field='body')"),
        ("max_seq_length", "GaudiSFTConfig(max_length=24)"),
        ("dataset_num_proc", "GaudiSFTConfig(dataset_num_proc=1)"),
    ):
        assert lines.count(f"GaudiSFTTrainer({old}=...) is TRL < 1's keyword, read as {new}; pass that instead.") == 1
    assert len([line for line in lines if line.startswith("GaudiSFTTrainer(num_buckets=4)")]) == 1


def test_a_keyword_trl_never_took_is_still_refused(tiny_lm, tokenizer, tmp_path):
    data = Dataset.from_dict({"text": default_corpus_texts()[:8]})
    config = GaudiSFTConfig(output_dir=str(tmp_path), **COMMON)
    with pytest.raises(TypeError, match="not both"):
        GaudiSFTTrainer(tiny_lm(), config, train_dataset=data, tokenizer=tokenizer, processing_class=tokenizer)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_sequence_length'"):
        GaudiSFTTrainer(tiny_lm(), config, train_dataset=data, processing_class=tokenizer, max_sequence_length=8)


def test_dpo_max_prompt_length_keeps_a_prompts_last_tokens_before_trl_drops_long_prompts(tiny_lm, tokenizer, tmp_path):
    long_prompt = " ".join(default_corpus_texts()[0].split()[:40])
    data = Dataset.from_list([{"prompt": long_prompt, "chosen": " yes", "rejected": " no"}] * 4)
    full = tokenizer(long_prompt)["input_ids"]

    def prompts(**kwargs):
        config = GaudiDPOConfig(output_dir=str(tmp_path), **{**COMMON, "max_length": 16, **kwargs})
        trainer = GaudiDPOTrainer(tiny_lm(), tiny_lm(), config, train_dataset=data, processing_class=tokenizer)
        return trainer.train_dataset["prompt_ids"]

    assert len(full) > 16 and all(ids == full for ids in prompts())  # TRL 1 alone: whole (1.16 drops the rows)
    assert prompts(max_prompt_length=5) == [full[-5:]] * 4  # TRL < 1: cut to its last tokens first, then kept


def test_grpo_max_prompt_length_keeps_a_prompts_last_tokens_and_tokenizer_is_read(tiny_lm, tokenizer, tmp_path, caplog):
    data = Dataset.from_dict({"prompt": ["Count to three:"] * 4})
    kwargs = dict(**COMMON, num_generations=2, max_completion_length=4, max_prompt_length=3)
    config = GaudiGRPOConfig(output_dir=str(tmp_path), **kwargs)
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        trainer = GaudiGRPOTrainer(tiny_lm(), vowel_reward, args=config, train_dataset=data, tokenizer=tokenizer)
    line = "GaudiGRPOTrainer(tokenizer=...) is TRL < 1's keyword, read as processing_class=; pass that instead."
    assert trainer.processing_class is tokenizer and said(caplog).count(line) == 1
    text = "Return the number of seconds since the epoch"
    prompt_ids, images, _ = trainer._tokenize_prompts([text, "Hi"])
    assert prompt_ids == [tokenizer(text)["input_ids"][-3:], tokenizer("Hi")["input_ids"][-3:]] and images is None


@pytest.mark.parametrize("config_class", [GaudiSFTConfig, GaudiDPOConfig, GaudiGRPOConfig])
def test_trl_configs_take_trl_0s_bare_switches_and_leave_trls_own_classes_alone(config_class, tmp_path):
    from transformers import HfArgumentParser

    (config,) = HfArgumentParser(config_class).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--bf16"])
    assert config.bf16 is True
    trl_class = config_class.__bases__[1]  # (GaudiTrainingArgumentsMixin, TRL's config)
    assert "nargs" not in trl_class.__dataclass_fields__["bf16"].metadata  # TRL's own config: as TRL declares it


def test_trl_0s_length_flags_parse_with_their_meaning_and_refuse_nonsense(tmp_path, caplog):
    from transformers import HfArgumentParser

    argv = ["--output_dir", str(tmp_path), "--max_seq_length", "48"]
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        (sft,) = HfArgumentParser(GaudiSFTConfig).parse_args_into_dataclasses(argv)
    assert sft.max_length == 48 and said(caplog) == ["--max_seq_length (TRL < 1) is read as --max_length 48; pass that instead."]  # fmt: skip
    grpo_argv = ["--output_dir", str(tmp_path), "--max_prompt_length", "512", "--chat_template", "{{ messages }}"]
    (grpo,) = HfArgumentParser(GaudiGRPOConfig).parse_args_into_dataclasses(grpo_argv)
    assert (grpo.max_prompt_length, grpo.chat_template) == (512, "{{ messages }}")
    with pytest.raises(GaudiArgumentError, match=r"^--max_prompt_length must be >= 1, got 0\.$"):
        GaudiDPOConfig(output_dir=str(tmp_path), max_prompt_length=0)
