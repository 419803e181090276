"""run_lora_clm.py: instruction tuning as optimum-habana's run_lora_clm.py does it, on a tiny Llama, offline.

Prompts (Alpaca, SQL, chat), the loss on answers only, packing, padding that changes no loss, every PEFT
type optimum-habana offers, AdaLoRA's rank budget, the last checkpoint, and one-line errors.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from support import REPO

from optimum_gaudi.errors import call_main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs the [peft] extra")

EXAMPLE_DIR = REPO / "examples" / "language-modeling"
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
CHAT_TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def load(name: str):
    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLE_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield load("run_lora_clm")


@pytest.fixture(scope="module")
def tokenizer(lora):
    from optimum_gaudi.data.corpus import default_tokenizer

    return default_tokenizer()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, lora):
    """A 2-layer Llama (grouped-query attention) with the embedded tokenizer and a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from optimum_gaudi.data.corpus import default_tokenizer

    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def args(model, out, *more):
    return ["--model_name_or_path", str(model), "--output_dir", str(out), "--max_seq_length", "96",
            "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4", "--max_eval_samples", "8",
            "--learning_rate", "0.01", *QUIET, *more]  # fmt: skip


def run(lora, argv) -> dict:
    metrics = {}

    def main(argv):
        metrics.update(lora.main(argv))

    assert call_main(main, argv) == 0
    return metrics


# ---- the rows -------------------------------------------------------------------------------------------


def rows(lora, tokenizer, *argv, **columns):
    from datasets import Dataset, DatasetDict

    data_args, finetune_args = lora.run_clm.parse_args(list(argv), (lora.DataArguments, lora.FinetuneArguments))
    data_args.max_seq_length = data_args.max_seq_length or lora.DEFAULT_MAX_SEQ_LENGTH  # as build() sets it
    raw = DatasetDict(train=Dataset.from_dict(columns))
    return lora.prepare_rows(raw, data_args, finetune_args, tokenizer)["train"]


def test_the_loss_is_on_the_answer_and_its_end_only_unless_train_on_inputs(lora, tokenizer):
    columns = {"instruction": ["Name a colour."], "input": [""], "output": [" Blue."]}
    masked = rows(lora, tokenizer, "--train_on_inputs", "false", **columns)[0]
    prompt = lora.instruction_data.ALPACA_WITHOUT_INPUT.format(instruction="Name a colour.")
    assert tokenizer.decode(masked["input_ids"]) == prompt + " Blue." + tokenizer.eos_token
    answer = [t for t, label in zip(masked["input_ids"], masked["labels"], strict=True) if label != -100]
    assert tokenizer.decode(answer) == " Blue." + tokenizer.eos_token  # the answer and the end-of-text token
    assert masked["labels"][: len(tokenizer(prompt)["input_ids"])] == [-100] * len(tokenizer(prompt)["input_ids"])

    whole = rows(lora, tokenizer, **columns)[0]  # optimum-habana's default: train on inputs
    assert whole["labels"] == whole["input_ids"] == masked["input_ids"]


def test_prompts_follow_the_layout_asked_for(lora, tokenizer):
    with_input = rows(lora, tokenizer, instruction=["Sum them."], input=["1 2"], output=["3"])[0]
    assert tokenizer.decode(with_input["input_ids"]).startswith(
        lora.instruction_data.ALPACA_WITH_INPUT.format(instruction="Sum them.", input="1 2")
    )
    sql = rows(lora, tokenizer, "--sql_prompt", "--instruction_column_name", "q", "--input_column_name", "schema",
               "--output_column_name", "a", q=["How many?"], schema=["CREATE TABLE t (x int)"],
               a=["[SQL] SELECT COUNT(*) FROM t [/SQL]"])[0]  # fmt: skip
    text = tokenizer.decode(sql["input_ids"])
    assert "### Question: \nHow many?\n\n### Context: \nCREATE TABLE t (x int)" in text
    assert text.endswith("[SQL] SELECT COUNT(*) FROM t [/SQL]" + tokenizer.eos_token)

    plain = rows(lora, tokenizer, text=["just some text"])[0]  # one column: plain text, no prompt
    assert tokenizer.decode(plain["input_ids"]) == "just some text" + tokenizer.eos_token


def test_concatenation_packs_rows_into_full_blocks(lora, tokenizer):
    texts = [f"answer number {i}." for i in range(60)]  # short rows: none is cut at 32 tokens
    packed = rows(lora, tokenizer, "--dataset_concatenation", "--max_seq_length", "32", text=texts)
    unpacked = [t for r in rows(lora, tokenizer, "--max_seq_length", "32", text=texts) for t in r["input_ids"]]
    assert len(packed) == len(unpacked) // 32 > 1 and {len(r["input_ids"]) for r in packed} == {32}
    assert [t for r in packed for t in r["input_ids"]] == unpacked[: len(packed) * 32]
    assert [t for r in packed for t in r["labels"]] == unpacked[: len(packed) * 32]  # plain text trains on all


def test_wrong_columns_and_a_chat_prompt_without_a_template_are_one_line(lora, tokenizer):
    with pytest.raises(lora.UsageError, match=r"no column 'instruction' for the instruction \(its columns: q, a\); "
                       r"name it with --instruction_column_name"):  # fmt: skip
        rows(lora, tokenizer, q=["x"], a=["y"])
    with pytest.raises(lora.UsageError, match="--chat_prompt needs a tokenizer with a chat template"):
        rows(lora, tokenizer, "--chat_prompt", instruction=["x"], output=["y"])


# ---- training ---------------------------------------------------------------------------------------------


def test_padding_to_max_length_changes_no_loss(lora, tokenizer, tiny_llama, tmp_path):
    """Static shapes (what a Gaudi in lazy mode gets) against dynamic padding: the same evaluation loss."""
    common = ["--do_eval", "--train_on_inputs", "false"]
    dynamic = run(lora, args(tiny_llama, tmp_path / "a", *common))
    static = run(lora, args(tiny_llama, tmp_path / "b", *common, "--pad_to_max_length"))
    assert dynamic["eval_loss"] == pytest.approx(static["eval_loss"], rel=1e-5)

    batch = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]}]
    padded = lora.instruction_data.collator(tokenizer, 96)(batch)  # what --pad_to_max_length batches look like
    assert padded["input_ids"].shape == (1, 96) and padded["attention_mask"].sum() == 3
    assert padded["labels"][0, 3:].eq(-100).all()
    assert lora.instruction_data.collator(tokenizer, None)(batch)["input_ids"].shape == (1, 8)  # a multiple of 8


@pytest.mark.parametrize(
    "peft_type, extra, adapter_key",
    [
        ("lora", ["--lora_target_modules", "q_proj", "v_proj"], "lora_B"),
        ("ia3", ["--ia3_target_modules", "k_proj", "down_proj", "--feedforward_modules", "down_proj"], "ia3_l"),
        ("llama-adapter", ["--adapter_layers", "2", "--adapter_len", "4"], "adaption_prompt"),
        ("vera", ["--vera_target_modules", "q_proj", "o_proj"], "vera_lambda_b"),
        ("ln_tuning", ["--ln_target_modules", "post_attention_layernorm"], "post_attention_layernorm"),
    ],
)
def test_every_peft_type_trains_its_adapters_on_a_llama(lora, tiny_llama, tmp_path, peft_type, extra, adapter_key):
    out = tmp_path / peft_type
    metrics = run(lora, args(tiny_llama, out, "--do_train", "--do_eval", "--max_steps", "3", "--peft_type",
                             peft_type, *extra))  # fmt: skip
    assert metrics["train_loss"] > 0 and metrics["eval_loss"] > 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == peft_type.upper().replace("-", "_").replace("LLAMA_ADAPTER", "ADAPTION_PROMPT")
    adapter = load_file(out / "adapter_model.safetensors")
    assert any(adapter_key in key for key in adapter), sorted(adapter)
    assert (out / "checkpoint-3" / "adapter_model.safetensors").is_file()  # --save_last_ckpt, on by default
    assert not (out / "model.safetensors").exists()  # the base model is not saved again


def test_adalora_prunes_its_ranks_during_training(lora, tiny_llama, tmp_path):
    out = tmp_path / "adalora"
    run(lora, args(tiny_llama, out, "--do_train", "--max_steps", "8", "--peft_type", "adalora",
                   "--lora_target_modules", "q_proj", "v_proj", "--adalora_init_r", "6", "--adalora_target_r", "2",
                   "--adalora_tinit", "2", "--adalora_tfinal", "2", "--adalora_delta_t", "1"))  # fmt: skip
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["total_step"] == 8  # the run's step count, set when training started
    ranks = [sum(mask) for mask in config["rank_pattern"].values()]  # budget allocated: ranks pruned from 6
    assert ranks and max(ranks) <= 6 and sum(ranks) < 6 * len(ranks)


def test_an_adalora_config_without_total_step_trains_on_the_runs_step_count(lora, tiny_llama, tmp_path):
    """optimum-habana's run_lora_clm.py builds AdaLoraConfig without total_step, which peft >= 0.18 refuses by
    itself: here it builds, and GaudiTrainer gives it the run's step count."""
    import peft
    from tiny import lm_data
    from transformers import AutoModelForCausalLM

    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

    config = peft.AdaLoraConfig(
        init_r=6, target_r=2, tinit=1, tfinal=1, deltaT=1, lora_alpha=16, lora_dropout=0.05,
        target_modules=["q_proj", "v_proj"], orth_reg_weight=0.5, bias="none", task_type=peft.TaskType.CAUSAL_LM,
    )  # fmt: skip
    assert config.total_step is None
    with pytest.raises(ValueError, match="total_step"):  # a count given is still peft's to check
        peft.AdaLoraConfig(tinit=1, tfinal=1, total_step=0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), config)
    run_args = GaudiTrainingArguments(str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[])
    GaudiTrainer(model=model, args=run_args, train_dataset=lm_data(8)).train()
    assert config.total_step == 4
    assert model.base_model.rankallocator.peft_config.total_step == 4


def test_adalora_with_too_few_steps_is_one_line(lora, tiny_llama, tmp_path, capsys):
    argv = args(tiny_llama, tmp_path / "short", "--do_train", "--max_steps", "3", "--peft_type", "adalora",
                "--lora_target_modules", "q_proj")  # fmt: skip
    assert call_main(lora.main, argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: AdaLoRA: the run has 3 optimizer steps, too few for tinit=50 warm-up and tfinal=100 final steps; "
        "lower them or train longer."
    )


def test_chat_prompts_and_the_embedded_instruction_set(lora, tiny_llama, tmp_path):
    out = tmp_path / "chat"
    metrics = run(lora, args(tiny_llama, out, "--do_train", "--max_steps", "2", "--chat_prompt",
                             "--max_train_samples", "8", "--save_last_ckpt", "false"))  # fmt: skip
    assert metrics["train_samples"] == 8 and not list(out.glob("checkpoint-*"))


def test_a_jsonl_file_of_instructions_trains_and_evaluates(lora, tiny_llama, tmp_path):
    data = tmp_path / "rows.jsonl"
    rows_ = [{"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)} for i in range(40)]
    data.write_text("\n".join(json.dumps(row) for row in rows_))
    metrics = run(lora, args(tiny_llama, tmp_path / "out", "--train_file", str(data), "--do_train", "--do_eval",
                             "--max_steps", "2", "--train_on_inputs", "false", "--validation_split_percentage", "10"))  # fmt: skip
    assert metrics["train_samples"] == 36 and metrics["eval_samples"] == 4
    assert metrics["eval_loss"] > 0 and metrics["perplexity"] > 1
