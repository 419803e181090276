"""examples/trl: SFT, DPO and GRPO end to end on CPU, offline, as optimum-habana users run their namesakes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import REPO

pytest.importorskip("trl")

EXAMPLES = REPO / "examples" / "trl"
TINY = ["--max_steps", "2", "--max_train_samples", "16", "--report_to", "none", "--per_device_train_batch_size", "2"]
GAUDI = ["--use_habana", "--attn_implementation", "gaudi_fused_sdpa", "--bf16", "true"]
OWN = {
    "sft": ["--max_length", "64"],
    "dpo": ["--max_length", "48"],
    "grpo": ["--num_generations", "2", "--max_completion_length", "4", "--reward", "brevity"],
}


def run(script: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    command = [sys.executable, str(EXAMPLES / f"{script}.py"), *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", sorted(OWN))
def test_each_trl_example_trains_a_small_llama_offline_and_saves_it(script, tmp_path):
    result = run(script, "--output_dir", str(tmp_path), *TINY, *GAUDI, *OWN[script])
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "gaudi" not in json.dumps(config).lower()
    metrics = json.loads((tmp_path / "train_results.json").read_text())
    assert metrics["train_throughput_steps"] == 2


@pytest.mark.parametrize("script", sorted(OWN))
def test_each_trl_example_has_help_and_one_line_errors(script, tmp_path):
    helped = run(script, "--help")
    assert helped.returncode == 0 and "--model_name_or_path" in helped.stdout and "--use_habana" in helped.stdout
    bad = run(script, "--output_dir", str(tmp_path), "--max_train_samples", "0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --max_train_samples must be >= 1 (or unset for all), got 0."
    ]
