"""run_clm.py end to end on CPU, as users call it, with the embedded corpus and tokenizer."""

import json
import os
import subprocess
import sys
import time

import pytest
from support import REPO

from optimum_gaudi import GaudiConfig

RUN_CLM = str(REPO / "examples" / "language-modeling" / "run_clm.py")
TINY = ["--model_type", "gpt2", "--config_overrides", "n_layer=1,n_embd=32,n_head=2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "OPTIMUM_GAUDI_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}


def run_clm(env, *argv, timeout=300):
    return subprocess.run([sys.executable, RUN_CLM, *argv], env=env, capture_output=True, text=True, timeout=timeout)


def test_gaudi_users_invocation_trains_and_saves_everything(env, tmp_path):
    out = tmp_path / "clm"
    result = run_clm(
        env, *TINY, "--do_train", "--do_eval", "--use_habana", "--use_lazy_mode",
        "--gaudi_config_name", "Habana/gpt2", "--throughput_warmup_steps", "3", "--bf16", "--max_steps", "8",
        "--max_eval_samples", "16", "--output_dir", str(out), "--report_to", "none",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "gaudi_config.json", "trainer_state.json"):
        assert (out / name).is_file(), name
    assert GaudiConfig.from_pretrained(out) == GaudiConfig.from_pretrained("gpt2")
    train = json.loads((out / "train_results.json").read_text())
    evaluation = json.loads((out / "eval_results.json").read_text())
    assert train["train_throughput_steps"] == 5 and train["train_tokens_per_second"] > 0
    assert evaluation["perplexity"] > 1 and evaluation["eval_samples"] == 16
    assert "no Gaudi is available" in result.stderr + result.stdout


def test_saved_model_fine_tunes_from_its_directory(env, tmp_path):
    first = tmp_path / "first"
    assert run_clm(env, *TINY, "--do_train", "--max_steps", "2", "--output_dir", str(first)).returncode == 0
    result = run_clm(
        env,
        "--model_name_or_path",
        str(first),
        "--do_eval",
        "--max_eval_samples",
        "8",
        "--output_dir",
        str(tmp_path / "second"),
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model_name_or_path", "gpt2", "--do_train"], "model 'gpt2' needs the Hugging Face Hub"),
        (["--dataset_name", "wikitext", *TINY, "--do_train"], "dataset 'wikitext' needs the Hugging Face Hub"),
        ([*TINY[:2], "--config_overrides", "n_layr=2", "--do_train"], "did you mean 'n_layer'"),
        ([*TINY[:2], "--config_overrides", "n_layer=abc", "--do_train"], "n_layer must be of type int"),
        ([*TINY, "--do_train", "--gaudi_config_name", "nope.json"], "does not exist"),
        ([*TINY, "--do_train", "--train_file", "missing.txt"], "missing.txt does not exist"),
        ([*TINY], "nothing to do"),
    ],
)
def test_user_errors_are_one_fast_line(env, tmp_path, argv, message):
    start = time.monotonic()
    result = run_clm(env, *argv, "--output_dir", str(tmp_path), timeout=180)
    assert result.returncode == 2  # optimum_gaudi.errors.EXIT_USER_ERROR
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    # no network retries: the offline failure is immediate (a generous bound: CI machines may be loaded)
    assert time.monotonic() - start < 120


def test_with_no_model_named_it_trains_a_small_llama_with_gaudi_attention(env, tmp_path):
    out = tmp_path / "llama"
    result = run_clm(
        env, "--do_train", "--use_habana", "--attn_implementation", "gaudi_fused_sdpa", "--bf16",
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--block_size", "64",
        "--output_dir", str(out), "--report_to", "none",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert "gaudi" not in json.dumps(config).lower()  # plain transformers (and vLLM) load it


def test_lora_on_the_small_llama_with_gaudi_attention(env, tmp_path):
    base, adapted = tmp_path / "base", tmp_path / "lora"
    common = ["--do_train", "--max_steps", "1", "--per_device_train_batch_size", "2", "--block_size", "64"]
    assert run_clm(env, *common, "--output_dir", str(base), "--report_to", "none").returncode == 0
    run_lora = RUN_CLM.replace("run_clm.py", "run_lora_clm.py")
    result = subprocess.run(
        [sys.executable, run_lora, "--model_name_or_path", str(base), "--do_train", "--max_steps", "1",
         "--per_device_train_batch_size", "2", "--max_seq_length", "64", "--use_habana", "--bf16",
         "--attn_implementation", "gaudi_fused_sdpa", "--output_dir", str(adapted), "--report_to", "none"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (adapted / "adapter_model.safetensors").is_file()
    assert json.loads((adapted / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
