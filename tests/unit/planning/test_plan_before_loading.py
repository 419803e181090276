"""run_clm.py, run_lora_clm.py and TRL's sft.py check their memory plan from their arguments and the model's config
before they read any weight (issue 48): a run that cannot fit its card stops with one line and a non-zero status
(--ignore_plan trains anyway); a run that fits is not checked again by the trainer. This CPU has no card, so one is
stood in for (1 GB, less than a GPU's 2 GB reserve)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from support import EXAMPLES, load_example
from tiny import llama, llama_config

from optimum_gaudi.errors import EXIT_USER_ERROR, call_main
from optimum_gaudi.planning import Card, Setting, Workload, breakdown, load_model_shape
from optimum_gaudi.planning.check import TOLERANCE
from optimum_gaudi.trainers import plan_check

SMALL_CARD = Card("a 1 GB test card", 1.0, None, None, 0.0, "test", "cuda")
LARGE_CARD = Card("a 1000 GB test card", 1000.0, None, None, 0.0, "test", "cuda")


def _clm():
    return load_example(EXAMPLES / "language-modeling" / "run_clm.py")


def test_a_run_that_cannot_fit_stops_in_one_line_before_its_weights_load(tmp_path, monkeypatch, capsys):
    clm = _clm()
    model = tmp_path / "model"
    llama().save_pretrained(model)
    clm.default_tokenizer().save_pretrained(model)
    (model / "model.safetensors").write_bytes(b"not weights")  # reading it would fail with another message
    loaded = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(plan_check, "card_of", lambda device: SMALL_CARD)

    status = call_main(clm.main, ["--model_name_or_path", str(model), "--do_train", "--block_size", "16",
                                  "--output_dir", str(tmp_path / "out"), "--report_to", "none"])  # fmt: skip

    err = capsys.readouterr().err.strip().splitlines()
    assert status == EXIT_USER_ERROR != 0
    assert err[-1].startswith("error: the plan says this run needs ") and "--ignore_plan" in err[-1]
    assert not any("Traceback" in line for line in err)
    assert loaded == []  # from_pretrained never called: no weight read


def test_a_run_checked_before_loading_is_not_checked_again_by_the_trainer(tmp_path, monkeypatch):
    clm = _clm()
    checks = []
    real = plan_check.check_run
    monkeypatch.setattr(plan_check, "check_run", lambda *a, **k: checks.append(a) or real(*a, **k))
    monkeypatch.setattr(plan_check, "card_of", lambda device: LARGE_CARD)

    status = call_main(clm.main, ["--model_type", "gpt2", "--config_overrides", "n_layer=1,n_embd=32,n_head=2",
                                  "--do_train", "--max_steps", "1", "--output_dir", str(tmp_path / "out"),
                                  "--report_to", "none"])  # fmt: skip

    assert status == 0
    assert len(checks) == 1  # before loading only; train() found the same model and sequence checked


def _saved_model(path, tokenizer, weights: bool = True):
    """A tiny Llama over ``tokenizer``'s vocabulary, saved with the tokenizer; without ``weights`` its weights file
    is not one (reading it would fail with another message)."""
    llama(vocab_size=len(tokenizer), max_position_embeddings=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if not weights:
        (path / "model.safetensors").write_bytes(b"not weights")
    return path


def _refused_before_loading(main, argv, monkeypatch, capsys, card: Card = SMALL_CARD) -> str:
    loaded = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(plan_check, "card_of", lambda device: card)
    status = call_main(main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == EXIT_USER_ERROR != 0
    assert err[-1].startswith("error: the plan says this run needs ") and "--ignore_plan" in err[-1]
    assert not any("Traceback" in line for line in err)
    assert loaded == []  # from_pretrained never called: no weight read
    monkeypatch.undo()
    return err[-1]


def _trains_checked_once_and_not_with_ignore_plan(main, argv, monkeypatch) -> None:
    """On a card its plan fits the run trains, checked once (before loading); with --ignore_plan on a card too
    small it trains too, unchecked."""
    checks = []
    real = plan_check.check_run
    monkeypatch.setattr(plan_check, "check_run", lambda *a, **k: checks.append(k) or real(*a, **k))
    for card, more, expected in ((LARGE_CARD, [], 1), (SMALL_CARD, ["--ignore_plan", "--overwrite_output_dir"], 0)):
        monkeypatch.setattr(plan_check, "card_of", lambda device, card=card: card)
        checks.clear()
        assert call_main(main, [*argv, *more]) == 0
        assert len(checks) == expected
        assert expected == 0 or checks[0]["adapters"] is not None


def test_a_lora_run_checks_its_adapters_plan_before_its_weights_load(tmp_path, monkeypatch, capsys):
    """run_lora_clm.py: the plan of its LoRA adapters (rank, target modules, dropout, the frozen weights as loaded),
    at --max_seq_length, from the config alone."""
    pytest.importorskip("peft")
    lora = load_example(EXAMPLES / "language-modeling" / "run_lora_clm.py")
    tokenizer = lora.run_clm.default_tokenizer()
    common = ["--do_train", "--max_seq_length", "32", "--lora_rank", "4", "--per_device_train_batch_size", "2",
              "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    broken = _saved_model(tmp_path / "broken", tokenizer, weights=False)
    line = _refused_before_loading(
        lora.main, ["--model_name_or_path", str(broken), "--output_dir", str(tmp_path / "a"), *common],
        monkeypatch, capsys,
    )  # fmt: skip
    assert "(ddp 2x1, LoRA r4 q_proj+v_proj, sequence 32;" in line
    model = _saved_model(tmp_path / "model", tokenizer)
    argv = ["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "b"), "--max_steps", "1",
            "--max_train_samples", "8", "--save_last_ckpt", "false", *common]  # fmt: skip
    _trains_checked_once_and_not_with_ignore_plan(lora.main, argv, monkeypatch)


def test_trl_sft_checks_its_plan_before_its_weights_load(tmp_path, monkeypatch, capsys):
    """TRL's sft.py: the plan at --max_length (its rows' longest), with --use_peft of its LoRA adapters."""
    pytest.importorskip("peft")
    sft = load_example(EXAMPLES / "trl" / "sft.py")
    tokenizer = load_example(EXAMPLES / "language-modeling" / "run_clm.py").default_tokenizer()
    common = ["--max_length", "32", "--per_device_train_batch_size", "2", "--report_to", "none",
              "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    broken = str(_saved_model(tmp_path / "broken", tokenizer, weights=False))
    line = _refused_before_loading(
        sft.main, ["--model_name_or_path", broken, "--output_dir", str(tmp_path / "a"), *common], monkeypatch, capsys
    )
    assert "(ddp+ckpt 2x1, sequence 32;" in line  # TRL's SFTConfig checkpoints by default
    line = _refused_before_loading(sft.main, ["--model_name_or_path", broken, "--output_dir", str(tmp_path / "a"),
                                              "--use_peft", "--lora_r", "4", *common], monkeypatch, capsys)  # fmt: skip
    assert "(ddp+ckpt 2x1, LoRA r4 q_proj+v_proj, sequence 32;" in line
    model = str(_saved_model(tmp_path / "model", tokenizer))
    argv = ["--model_name_or_path", model, "--output_dir", str(tmp_path / "b"), "--use_peft", "--lora_r", "4",
            "--max_steps", "1", "--max_train_samples", "8", *common]  # fmt: skip
    _trains_checked_once_and_not_with_ignore_plan(sft.main, argv, monkeypatch)


def _bf16_checkpoint(path, tokenizer):
    """A tiny Llama saved as a bf16 checkpoint (its weights bf16, its config's dtype bfloat16), with the tokenizer."""
    model = llama(vocab_size=len(tokenizer), max_position_embeddings=64).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert transformers.AutoConfig.from_pretrained(path).dtype == torch.bfloat16
    return path


def _card_between_bf16_and_float32_weights(config, sequence: int, batch: int) -> Card:
    """A stand-in Gaudi (its reserve 5% of it) on which full fine-tuning of bf16 weights (bf16 gradients and AdamW
    moments) fits and the same run in float32 weights exceeds the card by more than the check's tolerance."""
    shape = load_model_shape(config)
    workload = Workload(cards=1, sequence=sequence, global_batch=batch, precision="fp32", weight_bytes=2)
    setting = Setting(micro_batch=batch)
    bf16 = breakdown(shape, workload, setting, Card("probe", 1.0, None, None, 0.0, "test", "hpu"))
    gb = bf16.training / 0.8 / 1e9  # the bf16 plan takes 85% of it, the reserve included
    card = Card(f"a {gb * 1e6:.0f} kB test card", gb, None, None, 0.0, "test", "hpu")
    float32 = breakdown(shape, dataclasses.replace(workload, weight_bytes=4), setting, card)
    assert float32.peak > gb * 1e9 * (1 + TOLERANCE)
    return card


def test_full_fine_tuning_of_a_bf16_checkpoint_is_planned_in_the_dtype_it_loads_in(tmp_path, monkeypatch, capsys):
    """run_clm.py on a bf16 checkpoint: transformers 5 loads it in bf16 by default (from_pretrained's dtype="auto"),
    and torch's AdamW keeps its moments in the weights' dtype, so weights, gradients and optimizer state are 2 bytes
    a parameter, not 4. On a card the bf16 plan fits and the float32 one does not, the run trains (checked once:
    the loaded weights are what was planned); with --torch_dtype float32, or on transformers 4 (float32 unless
    asked), it stops before loading; on a card too small even for bf16 it stops too."""
    clm = _clm()
    tokenizer = clm.default_tokenizer()
    model = _bf16_checkpoint(tmp_path / "model", tokenizer)
    card = _card_between_bf16_and_float32_weights(transformers.AutoConfig.from_pretrained(model), 16, 2)
    common = ["--model_name_or_path", str(model), "--do_train", "--block_size", "16", "--per_device_train_batch_size",
              "2", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    run = ["--max_steps", "1", "--max_train_samples", "8", "--output_dir", str(tmp_path / "run")]

    checks = []
    real = plan_check.check_run
    monkeypatch.setattr(plan_check, "check_run", lambda *a, **k: checks.append(k) or real(*a, **k))
    monkeypatch.setattr(plan_check, "card_of", lambda device: card)
    default = [] if plan_check.TRANSFORMERS_5 else ["--torch_dtype", "auto"]  # transformers 4: bf16 when asked
    assert call_main(clm.main, [*common, *run, *default]) == 0
    assert len(checks) == 1 and checks[0]["weight_bytes"] == 2  # before loading; step 1 found bf16 weights
    monkeypatch.undo()

    refused = ["--output_dir", str(tmp_path / "refused")]
    for transformers_5 in (True, False):  # float32 weights on either release: 16 bytes a parameter, over the card
        monkeypatch.setattr(plan_check, "TRANSFORMERS_5", transformers_5)
        _refused_before_loading(clm.main, [*common, *refused, "--torch_dtype", "float32"], monkeypatch, capsys, card)
    monkeypatch.setattr(plan_check, "TRANSFORMERS_5", False)  # transformers 4 loads float32 unless asked
    _refused_before_loading(clm.main, [*common, *refused], monkeypatch, capsys, card)
    too_small = dataclasses.replace(card, memory_gb=card.memory_gb / 4)  # bf16 weights do not fit it either
    line = _refused_before_loading(clm.main, [*common, *refused, "--torch_dtype", "auto"], monkeypatch, capsys,
                                   too_small)  # fmt: skip
    assert "(ddp 2x1, 16-bit weights, sequence 16;" in line


def test_the_weights_bytes_as_a_script_loads_them_on_each_transformers_release(monkeypatch):
    """``weight_bytes_as_loaded``: --torch_dtype where given ("auto": the checkpoint's); none given, the checkpoint's
    own dtype on transformers 5 (from_pretrained's default is dtype="auto") and float32 on transformers 4; a model
    built from its config takes the config's dtype on both (from_config's default), float32 where it names none."""
    bf16 = llama_config(dtype="bfloat16")
    for transformers_5, default in ((True, 2), (False, 4)):
        monkeypatch.setattr(plan_check, "TRANSFORMERS_5", transformers_5)
        assert plan_check.weight_bytes_as_loaded(bf16, None, pretrained=True) == default
        assert plan_check.weight_bytes_as_loaded(bf16, "auto", pretrained=True) == 2
        assert plan_check.weight_bytes_as_loaded(bf16, "float32", pretrained=True) == 4
        assert plan_check.weight_bytes_as_loaded(llama_config(), "bfloat16", pretrained=True) == 2
        assert plan_check.weight_bytes_as_loaded(llama_config(), None, pretrained=True) == 4
        assert plan_check.weight_bytes_as_loaded({"torch_dtype": "float16"}, "auto", pretrained=True) == 2
        assert plan_check.weight_bytes_as_loaded(bf16, None, pretrained=False) == 2
        assert plan_check.weight_bytes_as_loaded(llama_config(), None, pretrained=False) == 4
