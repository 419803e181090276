"""Every bundled Gaudi config trains the architecture it is named for, in bf16, as closely as fp32 does.

One tiny random model per config, of the architecture the config's name says (Llama with grouped-query
attention), trained a few steps by GaudiTrainer with ``use_habana=True`` (no Gaudi here: the CPU, after one
warning) and ``bf16=True``, the config given by name as a user gives it; then again in fp32 (same seed, same
config with its autocast off). On the simulated Gaudi (tests/fakes, a test double) the same architectures
train with the op lists the bridge loaded, on both software generations.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers
from conftest import GAUDI_SOFTWARE

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.configuration.gaudi_config import bundled_configs_dir
from optimum_gaudi.launch.environment import launch_environment
from optimum_gaudi.precision.autocast import OpListAutocast
from optimum_gaudi.precision.op_list_check import op_list_problem
from optimum_gaudi.precision.op_lists import config_uses_op_lists, resolve_op_lists

CONFIGS = sorted(p.stem for p in bundled_configs_dir().glob("*.json"))
VOCAB, LENGTH, ROWS, STEPS = 100, 16, 16, 4
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# Relative tolerance between the bf16 and the fp32 loss of each step. bf16 keeps 8 significant bits (a relative
# rounding of up to 2**-8 = 0.4% per value), but each loss is a mean over many tokens (or 4 images, 4 utterances)
# whose rounding errors are independent and largely cancel. Measured here: at most 0.036% (t5, whose config runs
# torch's own bf16 autocast), 0.007% for the op-list configs. 0.5% leaves room for other CPUs' bf16 kernels and
# still fails a config that crashes (mixed dtypes into one op) or trains another model than its name says.
RELATIVE_TOLERANCE = 5e-3


def _tokens(seed: int, rows: int = ROWS, length: int = LENGTH, low: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, VOCAB, (length,), generator=g).tolist() for _ in range(rows)]


def lm_data() -> list[dict]:
    return [{"input_ids": r, "labels": r} for r in _tokens(0)]


def seq2seq_data() -> list[dict]:
    return [{"input_ids": a, "labels": b} for a, b in zip(_tokens(0, low=1), _tokens(1, length=8, low=1), strict=True)]


def image_data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": i % 3} for i in range(ROWS)]


def audio_data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(ROWS):  # 400 samples = 39 frames after the two convolutions; 4 characters each
        labels = torch.randint(1, 12, (4,), generator=g).tolist()
        rows.append({"input_values": torch.randn(400, generator=g), "labels": labels})
    return rows


def _llama_family(config_class, **extra):
    return config_class(
        vocab_size=VOCAB, max_position_embeddings=64, num_key_value_heads=2, attention_dropout=0.0, **SMALL, **extra
    )


# config name -> (model class, its config, the data); built from transformers' classes at test time
ARCHITECTURES = {
    "gpt2": (
        "GPT2LMHeadModel",
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        ),
        lm_data,
    ),
    "bert-base-uncased": (
        "BertForMaskedLM",
        lambda: transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, **SMALL, **NO_DROPOUT),
        lm_data,
    ),
    "bert-large-uncased-whole-word-masking": (
        "BertForMaskedLM",
        lambda: transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, **SMALL, **NO_DROPOUT),
        lm_data,
    ),
    "roberta-base": (
        "RobertaForMaskedLM",
        lambda: transformers.RobertaConfig(
            vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=1, **SMALL, **NO_DROPOUT
        ),
        lm_data,
    ),
    "distilbert-base-uncased": (
        "DistilBertForMaskedLM",
        lambda: transformers.DistilBertConfig(
            vocab_size=VOCAB,
            max_position_embeddings=64,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
        ),
        lm_data,
    ),
    "t5": (
        "T5ForConditionalGeneration",
        lambda: transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
        seq2seq_data,
    ),
    "bart": (
        "BartForConditionalGeneration",
        lambda: transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        seq2seq_data,
    ),
    "vit": (
        "ViTForImageClassification",
        lambda: transformers.ViTConfig(image_size=16, patch_size=4, num_labels=3, **SMALL, **NO_DROPOUT),
        image_data,
    ),
    "wav2vec2": (
        "Wav2Vec2ForCTC",
        lambda: transformers.Wav2Vec2Config(
            vocab_size=12,
            conv_dim=(16, 16),
            conv_kernel=(10, 3),
            conv_stride=(5, 2),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            mask_time_prob=0.0,
            layerdrop=0.0,
            hidden_dropout=0.0,
            activation_dropout=0.0,
            attention_dropout=0.0,
            feat_proj_dropout=0.0,
            final_dropout=0.0,
            **SMALL,
        ),
        audio_data,
    ),
    "llama": ("LlamaForCausalLM", lambda: _llama_family(transformers.LlamaConfig), lm_data),
    "mistral": ("MistralForCausalLM", lambda: _llama_family(transformers.MistralConfig, sliding_window=8), lm_data),
    "gpt-neox": (
        "GPTNeoXForCausalLM",
        lambda: transformers.GPTNeoXConfig(
            vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, **SMALL
        ),
        lm_data,
    ),
}


def build(name: str) -> torch.nn.Module:
    """The same freshly initialised tiny model of the config's architecture on every call."""
    class_name, config, _ = ARCHITECTURES[name]
    torch.manual_seed(0)
    return getattr(transformers, class_name)(config())


def arguments(tmp_path, **kwargs) -> GaudiTrainingArguments:
    defaults = dict(output_dir=str(tmp_path), use_habana=True, max_steps=STEPS, per_device_train_batch_size=4)
    defaults.update(learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
    return GaudiTrainingArguments(**{**defaults, **kwargs})


def train(name: str, args: GaudiTrainingArguments, gaudi_config: GaudiConfig | None = None) -> GaudiTrainer:
    trainer = GaudiTrainer(
        model=build(name), args=args, train_dataset=ARCHITECTURES[name][2](), gaudi_config=gaudi_config
    )
    trainer.train()
    return trainer


def losses(trainer: GaudiTrainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def fp32_config(name: str) -> GaudiConfig:
    """The bundled config with its autocast off: every other feature (fused AdamW, clipping) the same."""
    config = GaudiConfig.from_pretrained(name)
    return dataclasses.replace(config, use_torch_autocast=False, autocast_bf16_ops=None, autocast_fp32_ops=None)


def named_for(name: str, model: torch.nn.Module) -> bool:
    """Whether the trained model is of the architecture the config is named for (bert-large-... is bert)."""
    return name.replace("-", "_").startswith(model.config.model_type)


def test_every_bundled_config_has_its_architecture_here():
    assert sorted(ARCHITECTURES) == CONFIGS


@pytest.mark.parametrize("name", CONFIGS)
def test_bundled_config_trains_its_architecture_in_bf16_as_in_fp32(name, tmp_path):
    bf16 = train(name, arguments(tmp_path / "bf16", bf16=True, gaudi_config_name=name))
    fp32 = train(name, arguments(tmp_path / "fp32"), gaudi_config=fp32_config(name))
    assert named_for(name, bf16.model) and type(bf16.model).__name__ == ARCHITECTURES[name][0]
    assert bf16.gaudi_config == GaudiConfig.from_pretrained(name)
    low, full = losses(bf16), losses(fp32)
    assert len(low) == len(full) == STEPS and all(math.isfinite(x) for x in low)
    assert low != full  # the bf16 run did run in bf16
    assert low == pytest.approx(full, rel=RELATIVE_TOLERANCE)


def test_llm_configs_keep_attention_in_bf16_and_ask_for_the_fused_kernels():
    """An explicit bf16 list without scaled_dot_product_attention left Llama's attention with float32 queries
    and bf16 values (issue 19); Habana's default list has it."""
    for name in ("llama", "mistral", "gpt-neox"):
        config = GaudiConfig.from_pretrained(name)
        bf16_ops, _ = resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops)
        assert "scaled_dot_product_attention" in bf16_ops, name
        assert (config.use_fused_rms_norm, config.use_fused_rope) == (
            (True, True) if name != "gpt-neox" else (False, False)
        )


# ---- the simulated Gaudi -------------------------------------------------------------------------------------

ON_THE_SIMULATOR = CONFIGS  # every config, both generations: a second each


@pytest.mark.parametrize("gaudi_software", GAUDI_SOFTWARE, indirect=True)
@pytest.mark.parametrize("name", ON_THE_SIMULATOR)
def test_bundled_config_trains_its_architecture_on_the_simulated_gaudi(
    name, gaudi_software, bridge, monkeypatch, tmp_path
):
    """1.19 lazy, 1.21 eager, with the environment `optimum-gaudi launch` exports; the bridge loads the config's
    lists, and those lists run the architecture's forward with one dtype per op (the simulator applies no casts,
    so the lists it loaded are applied here by the CPU's op-list autocast). No --bf16: the configs' own
    use_torch_autocast turns autocast on, and transformers accepts --bf16 only where torch.hpu is registered,
    which the simulator leaves out (tests/fakes/README.md)."""
    lazy = gaudi_software == "1.19"
    argv = ["--gaudi_config_name", name, *(["--use_lazy_mode"] if lazy else [])]
    for key, value in launch_environment(argv).items():
        monkeypatch.setenv(key, value)
    import habana_frameworks.autoload as autoload

    if autoload.is_autoload_enabled():
        import habana_frameworks.torch  # noqa: F401  (what torch's entry point does at `import torch`)
    trainer = train(name, arguments(tmp_path, gaudi_config_name=name, use_lazy_mode=lazy))
    assert named_for(name, trainer.model) and trainer.args.gaudi_device.type == "hpu"
    assert all(math.isfinite(x) for x in losses(trainer)) and len(losses(trainer)) == STEPS
    assert bridge().names().count("hpex.optimizers.FusedAdamW.step") == STEPS
    assert (bridge().names().count("core.mark_step") >= 2 * STEPS) is lazy
    config = GaudiConfig.from_pretrained(name)
    lower, fp32 = bridge().autocast_lists
    if config_uses_op_lists(config):
        assert [sorted(lower), sorted(fp32)] == [
            sorted(x) for x in resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops)
        ]
    on_cpu = OpListAutocast(sorted(lower), sorted(set(fp32) - set(lower)))  # an op in both lists runs in bf16
    assert op_list_problem(build(name), lambda: on_cpu) is None
