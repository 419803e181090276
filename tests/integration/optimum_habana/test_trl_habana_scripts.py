"""optimum-habana's TRL scripts (examples/trl/sft.py and dpo.py at commit 1d8504c) with only their imports
changed: stand-ins here make the same calls with the same keywords and command-line flags, on a tiny Llama and a
few rows, offline, and train a few steps. TRL < 1's keywords they pass each say their new place in one line."""

from __future__ import annotations

import json
import logging
import math
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from datasets import Dataset, load_dataset  # noqa: E402
from optimum_gaudi.trl import GaudiDPOConfig, GaudiDPOTrainer, GaudiSFTConfig, GaudiSFTTrainer  # noqa: E402
from optimum_gaudi.utils import set_seed  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, LlamaConfig, LlamaForCausalLM  # noqa: E402

from optimum_gaudi import GaudiConfig  # noqa: E402
from optimum_gaudi.data.corpus import default_corpus_texts, default_tokenizer  # noqa: E402
from optimum_gaudi.distributed import apply_zero3_leaf_promotion  # noqa: E402
from optimum_gaudi.errors import UserError  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 1-layer Llama saved with the embedded tokenizer, as a Hub model would be."""
    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def stack_exchange(tmp_path_factory):
    """lvwerra/stack-exchange-paired's columns in its folders (data/finetune, data/rl, data/evaluation)."""
    root = tmp_path_factory.mktemp("stack_exchange")
    rows = [
        {"question": text.split(".")[0][:60], "response_j": text[:100], "response_k": "No idea."}
        for text in default_corpus_texts()[:24]
    ]
    for folder in ("finetune", "rl", "evaluation"):
        (root / "data" / folder).mkdir(parents=True)
        (root / "data" / folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def said(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


# ---- sft.py ----------------------------------------------------------------------------------------------


@dataclass
class SFTScriptArguments:
    """The fields of sft.py's ScriptArguments the run below reads, with its defaults."""

    model_name_or_path: str | None = None
    dataset_name: str | None = None
    use_peft: bool | None = True
    subset: str | None = "data/finetune"
    split: str | None = "train"
    size_valid_set: int | None = 4000
    streaming: bool | None = True
    shuffle_buffer: int | None = 5000
    num_buckets: int | None = -1
    use_flash_attention: bool | None = False
    lora_alpha: float | None = 16
    lora_dropout: float | None = 0.05
    lora_r: int | None = 8
    lora_target_modules: list[str] = field(default_factory=lambda: None)
    token: str = None


def test_optimum_habanas_sft_script_trains_on_trl_1(tiny_llama, stack_exchange, tmp_path, caplog):
    out = tmp_path / "sft"
    # the README's Stack Exchange command (the bare --bf16, --max_seq_length, the paged optimizer), shrunk
    argv = [
        "--model_name_or_path", str(tiny_llama), "--dataset_name", str(stack_exchange), "--output_dir", str(out),
        "--do_train", "--do_eval", "--max_steps=2", "--logging_steps=1", "--per_device_train_batch_size=2",
        "--gradient_accumulation_steps=1", "--learning_rate=1e-4", "--lr_scheduler_type=cosine", "--warmup_ratio",
        "0.03", "--weight_decay=0.05", "--optim=paged_adamw_32bit", "--lora_target_modules", "q_proj", "v_proj",
        "--bf16", "--remove_unused_columns=False", "--max_seq_length", "48", "--run_name=sft_llama2",
        "--report_to=none", "--use_habana", "--use_lazy_mode", "--size_valid_set", "4", "--save_strategy", "no",
    ]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        script_args, training_args = HfArgumentParser((SFTScriptArguments, GaudiSFTConfig)).parse_args_into_dataclasses(
            argv
        )
        peft_config = LoraConfig(
            r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=script_args.lora_dropout,
            target_modules=script_args.lora_target_modules, bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip
        assert not (training_args.group_by_length and training_args.packing)
        set_seed(training_args.seed)

        def prepare_sample_text(example):
            return f"Question: {example['question']}\n\nAnswer: {example['response_j']}"

        dataset = load_dataset(
            script_args.dataset_name, data_dir=script_args.subset, split=script_args.split, token=script_args.token,
            num_proc=None, streaming=script_args.streaming,
        )  # fmt: skip
        valid_data = dataset.take(script_args.size_valid_set)
        train_data = dataset.skip(script_args.size_valid_set)
        train_data = train_data.shuffle(buffer_size=script_args.shuffle_buffer, seed=training_args.seed)

        base_model = AutoModelForCausalLM.from_pretrained(
            script_args.model_name_or_path, low_cpu_mem_usage=True, torch_dtype=torch.bfloat16, token=None
        )
        base_model.config.use_cache = False
        base_model.generation_config.use_flash_attention = script_args.use_flash_attention
        base_model.generation_config.flash_attention_recompute = training_args.flash_attention_recompute
        base_model.generation_config.flash_attention_causal_mask = training_args.flash_attention_causal_mask
        if training_args.use_zero3_leaf_promotion:
            apply_zero3_leaf_promotion(base_model)
        tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path, trust_remote_code=True)
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        assert isinstance(training_args.get_process_log_level(), int)

        gaudi_config = GaudiConfig()
        gaudi_config.use_fused_adam = True
        gaudi_config.use_fused_clip_norm = True
        trainer = GaudiSFTTrainer(
            model=base_model, gaudi_config=gaudi_config, train_dataset=train_data, eval_dataset=valid_data,
            peft_config=peft_config, tokenizer=tokenizer, args=training_args, formatting_func=prepare_sample_text,
            num_buckets=script_args.num_buckets,
        )  # fmt: skip
        train_result = trainer.train()
        trainer.save_model(training_args.output_dir)
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(list(valid_data))
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.save_metrics("eval", metrics)

    assert training_args.bf16 and training_args.max_length == 48 and trainer.processing_class is tokenizer
    assert trainer.state.global_step == 2 and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "eval_results.json").read_text())["eval_samples"] == 4
    lines = said(caplog)
    assert "--max_seq_length (TRL < 1) is read as --max_length 48; pass that instead." in lines
    assert (
        lines.count(
            "GaudiSFTTrainer(tokenizer=...) is TRL < 1's keyword, read as processing_class=; pass that instead."
        )
        == 1
    )
    assert not [line for line in lines if "num_buckets" in line]  # -1: no bucketing, as there


# ---- dpo.py ----------------------------------------------------------------------------------------------


def test_optimum_habanas_dpo_script_trains_on_trl_1(tiny_llama, stack_exchange, tmp_path, caplog):
    out = tmp_path / "dpo"
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        # the training arguments dpo.py builds in code (its defaults, shrunk)
        training_args = GaudiDPOConfig(
            per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=2, logging_steps=1,
            save_steps=100, gradient_accumulation_steps=1, gradient_checkpointing=False, learning_rate=5e-4,
            eval_strategy="steps", eval_steps=2, output_dir=str(out), report_to="none", lr_scheduler_type="cosine",
            warmup_steps=1, optim="paged_adamw_32bit", bf16=True, remove_unused_columns=False, run_name="dpo_llama2",
            gradient_checkpointing_kwargs={"use_reentrant": False}, use_habana=True, use_lazy_mode=True,
            use_hpu_graphs_for_training=True, use_hpu_graphs_for_inference=True, seed=0, deepspeed=None,
            overwrite_output_dir=True,
        )  # fmt: skip
        set_seed(training_args.seed)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, low_cpu_mem_usage=True, torch_dtype=torch.bfloat16)
        model.config.use_cache = False
        model.config.use_fused_rope = False
        model_ref = AutoModelForCausalLM.from_pretrained(tiny_llama, low_cpu_mem_usage=True, torch_dtype=torch.bfloat16)
        model_ref.config.use_cache = False
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        tokenizer.pad_token = tokenizer.eos_token

        def pairs(folder: str, rows: int) -> Dataset:
            data = load_dataset(str(stack_exchange), data_dir=f"data/{folder}", split="train").select(range(rows))
            return data.map(
                lambda batch: {
                    "prompt": ["Question: " + question + "\n\nAnswer: " for question in batch["question"]],
                    "chosen": batch["response_j"],
                    "rejected": batch["response_k"],
                },
                batched=True,
                remove_columns=data.column_names,
            ).filter(lambda x: len(x["prompt"]) + len(x["chosen"]) <= 1024)

        peft_config = LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], bias="none",
            task_type="CAUSAL_LM",
        )  # fmt: skip
        gaudi_config = GaudiConfig()
        gaudi_config.use_fused_adam = True
        gaudi_config.use_fused_clip_norm = True
        dpo_trainer = GaudiDPOTrainer(
            model, model_ref, gaudi_config=gaudi_config, args=training_args, beta=0.2,
            train_dataset=pairs("rl", 8), eval_dataset=pairs("evaluation", 2), tokenizer=tokenizer,
            peft_config=peft_config, max_prompt_length=4, max_length=64, force_use_ref_model=True,
        )  # fmt: skip
        train_result = dpo_trainer.train()
        dpo_trainer.save_model(str(out))
        dpo_trainer.save_metrics("train", train_result.metrics)

    assert (training_args.beta, training_args.max_length, training_args.max_prompt_length) == (0.2, 64, 4)
    assert dpo_trainer.ref_model is model_ref and dpo_trainer.processing_class is tokenizer
    assert max(len(ids) for ids in dpo_trainer.train_dataset["prompt_ids"]) == 4  # the prompts' last 4 tokens
    assert dpo_trainer.state.global_step == 2 and (out / "adapter_model.safetensors").is_file()
    assert math.isfinite(json.loads((out / "train_results.json").read_text())["train_loss"])
    lines = said(caplog)
    for keyword, config in (("beta", "beta=0.2"), ("max_prompt_length", "max_prompt_length=4"), ("max_length", "max_length=64")):  # fmt: skip
        assert f"GaudiDPOTrainer({keyword}=...) is TRL < 1's keyword, read as GaudiDPOConfig({config}); pass that instead." in lines  # fmt: skip
    assert "GaudiDPOTrainer(tokenizer=...) is TRL < 1's keyword, read as processing_class=; pass that instead." in lines
    assert (
        "GaudiDPOTrainer: force_use_ref_model=True (TRL < 1) is dropped: TRL 1 uses the ref_model you pass, with or "
        "without peft_config; drop the keyword." in lines
    )


# ---- apply_zero3_leaf_promotion --------------------------------------------------------------------------


@pytest.fixture
def deepspeed_calls(monkeypatch):
    """DeepSpeed's set_z3_leaf_modules, recorded (DeepSpeed is not installed with the test extra)."""
    calls = []
    utils = types.ModuleType("deepspeed.utils")
    utils.set_z3_leaf_modules = lambda model, classes: calls.append((model, classes))
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils)
    return calls


def test_zero3_leaf_promotion_makes_llamas_decoder_layers_leaves(tiny_llama, deepspeed_calls):
    from peft import get_peft_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    apply_zero3_leaf_promotion(model)
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), LoraConfig(target_modules=["q_proj"]))
    apply_zero3_leaf_promotion(wrapped)
    assert deepspeed_calls == [(model, [LlamaDecoderLayer]), (wrapped, [LlamaDecoderLayer])]


def test_zero3_leaf_promotion_leaves_other_models_and_needs_deepspeed(tiny_llama, deepspeed_calls, monkeypatch):
    from tiny import gpt2

    apply_zero3_leaf_promotion(gpt2())  # not among optimum-habana's promoted models: left as it is
    assert deepspeed_calls == []
    monkeypatch.setitem(sys.modules, "deepspeed.utils", None)
    with pytest.raises(UserError, match="needs DeepSpeed"):
        apply_zero3_leaf_promotion(AutoModelForCausalLM.from_pretrained(tiny_llama))
