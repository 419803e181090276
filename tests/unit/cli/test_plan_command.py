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
