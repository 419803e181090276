"""`optimum-gaudi plan`: the table, the recommendation as a command, and each mistake as one line."""

from __future__ import annotations

import json

import pytest

from optimum_gaudi.cli import main

LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)  # fmt: skip


@pytest.fixture
def llama_8b(tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return folder


def test_a_model_folder_on_eight_gaudi2_gets_a_table_and_a_command(llama_8b, capsys):
    assert main(["plan", str(llama_8b), "--card", "gaudi2", "--cards", "8", "--sequence", "4096", "--global_batch", "64"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "8.03B parameters" in out and "8 x Gaudi 2 (96 GB each)" in out
    assert "weights" in out and "logits" in out and "reserve" in out and "tokens/s" in out
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("optimum-gaudi launch"))
    assert (
        f"--model_name_or_path {llama_8b}" in command and "--use_habana" in command and "--block_size 4096" in command
    )
    assert "MFU 0.35" in out and "White Paper" in out  # the assumption and the fact, each with its source


def test_nothing_fitting_says_what_would_and_exits_1(llama_8b, capsys):
    assert main(["plan", str(llama_8b / "config.json"), "--card", "a100-40gb", "--cards", "1"]) == 1
    assert "nothing fits: the smallest" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--card", "tpu"], "unknown card 'tpu'; choose one of Gaudi 2"),
        (["--cards", "3", "--global_batch", "4"], "make the global batch a multiple of the number of cards"),
        (["--sequence", "0"], "the sequence must be at least 1"),
    ],
)
def test_a_mistake_is_one_line(llama_8b, capsys, args, message):
    assert main(["plan", str(llama_8b), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_model_it_cannot_read_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5"}))
    cases = {
        str(tmp_path / "t5.json"): "model_type 't5' is not one the planner knows",
        str(tmp_path / "missing.json"): "no such file or folder",
        "someone/some-model": "could not be fetched from the Hub",  # offline: a Hub id is one line, not a traceback
    }
    for model, message in cases.items():
        assert main(["plan", model]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_a_lora_plan_fits_where_full_fine_tuning_does_not_and_recommends_run_lora_clm(llama_8b, capsys):
    """One Gaudi 2 cannot hold an 8B model's float32 weights, gradients and AdamW state; LoRA adapters on its bf16
    weights fit, and the command is one run_lora_clm.py's own parser takes whole."""
    import transformers
    from support import EXAMPLES, load_example

    common = ["plan", str(llama_8b), "--card", "gaudi2", "--cards", "1", "--sequence", "2048"]
    assert main(common) == 1
    capsys.readouterr()
    assert main([*common, "--lora_rank", "8", "--lora_target_modules", "all-linear"]) == 0
    out = capsys.readouterr().out
    assert "trained: LoRA r8 down_proj+gate_proj+k_proj+o_proj+q_proj+up_proj+v_proj (21.0M parameters)" in out
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("optimum-gaudi launch"))
    words = command.split()
    script = words.index("examples/language-modeling/run_lora_clm.py")
    lora = load_example(EXAMPLES / "language-modeling" / "run_lora_clm.py")
    parser = transformers.HfArgumentParser((lora.ModelArguments, lora.DataArguments, lora.GaudiTrainingArguments,
                                            lora.FinetuneArguments))  # fmt: skip
    namespace, unknown = parser.parse_known_args(words[script + 1 :])
    assert unknown == []
    assert namespace.peft_type == "lora" and namespace.lora_rank == 8 and len(namespace.lora_target_modules) == 7
    assert namespace.max_seq_length == 2048 and namespace.torch_dtype == "bfloat16" and namespace.dataset_concatenation


def test_lora_modules_the_planner_does_not_count_are_one_line(llama_8b, capsys):
    assert main(["plan", str(llama_8b), "--lora_rank", "8", "--lora_target_modules", "embed_tokens"]) == 2
    err = capsys.readouterr().err
    assert "LoRA on embed_tokens is not something the planner counts" in err and err.count("\n") == 1
