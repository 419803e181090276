"""TRL's SFT, DPO and GRPO trainers made Gaudi trainers by composition: a tiny causal LM, a few CPU steps."""

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
