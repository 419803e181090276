"""FSDP2 on 2 CPU processes (gloo): save_model writes a plain transformers checkpoint, streamed, and
FULL_STATE_DICT checkpoints save and resume (tests/scripts/fsdp_save.py; one torchrun per state-dict type)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support import SCRIPTS, TESTS, free_port

SCRIPT = str(SCRIPTS / "fsdp_save.py")

# Loads every saved folder where nothing of optimum_gaudi is imported and torch.distributed is not initialised,
# and compares it with the trained weights rank 0 wrote (expected_*.pt): one JSON line of findings.
LOADER = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[2])
import tiny
out, report = sys.argv[1], {}
for name, expected in [("llama", "llama"), ("llama_split", "llama"), ("resumed", "resumed"),
                       ("run/checkpoint-2", None), ("gpt2", "gpt2"), ("gpt2_split", "gpt2")]:
    if not Path(f"{out}/{name}/config.json").is_file():  # the other run's folders
        continue
    model = AutoModelForCausalLM.from_pretrained(f"{out}/{name}")
    state = model.state_dict()
    entry = {"tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight}
    if expected is not None:
        want = torch.load(f"{out}/expected_{expected}.pt")
        entry["equal"] = sorted(want) == sorted(state) and all(torch.equal(want[k], state[k]) for k in want)
    report[name] = entry
if Path(f"{out}/lora").is_dir():
    from peft import PeftModel
    model = PeftModel.from_pretrained(tiny.gpt2(**tiny.NO_DROPOUT), f"{out}/lora")
    want, state = torch.load(f"{out}/expected_lora.pt"), model.state_dict()
    lora = [k for k in want if "lora_" in k]
    report["lora"] = {"equal": bool(lora) and all(torch.equal(want[k], state[k]) for k in lora)}
report["optimum_gaudi_imported"] = any(m.startswith("optimum_gaudi") for m in sys.modules)
report["distributed"] = torch.distributed.is_initialized()
print(json.dumps(report))
"""


def train_and_save(out: Path, state_dict_type: str) -> tuple[dict, dict]:
    """One torchrun of the script, then the loader in a plain process: (losses, loader's findings)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd = [*torchrun, "--master_port", str(free_port()), SCRIPT, str(out), state_dict_type]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # the loader imports transformers and peft only
    loader = [sys.executable, "-c", LOADER, str(out), str(TESTS)]
    loaded = subprocess.run(loader, env=plain, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    report = json.loads(loaded.stdout.splitlines()[-1])
    assert report.pop("optimum_gaudi_imported") is False and report.pop("distributed") is False
    return json.loads((out / "result.json").read_text()), report


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A tiny Llama with tied embeddings under FULL_STATE_DICT, checkpointed at step 2 and resumed from there."""
    out = tmp_path_factory.mktemp("full")
    return (out, *train_and_save(out, "FULL_STATE_DICT"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny GPT-2 (tied lm_head), then a LoRA GPT-2, under SHARDED_STATE_DICT."""
    out = tmp_path_factory.mktemp("sharded")
    return (out, *train_and_save(out, "SHARDED_STATE_DICT"))


def weight_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def check_plain_checkpoints(out: Path, report: dict, trained: str, split: str) -> None:
    """``trained`` is what save_model wrote, ``split`` the same model in several files: both load in plain
    transformers with the trained weights and tied embeddings (saved once, as transformers saves them), and no
    weight file of the untrained model saved there before in the other layout is left."""
    for name in (trained, split):
        assert report[name] == {"tied": True, "equal": True}, name
        assert weight_names(out / name) and not any(n.startswith("lm_head") for n in weight_names(out / name))
        config = json.loads((out / name / "config.json").read_text())
        assert config["architectures"][0] in ("LlamaForCausalLM", "GPT2LMHeadModel")  # not fully_shard's class
    written = {p.name for p in (out / trained).iterdir()}
    assert {"model.safetensors", "generation_config.json", "training_args.bin", "gaudi_config.json"} <= written
    assert not any(n.startswith("model-") or n.endswith(".index.json") for n in written)  # the stale split save's
    index = json.loads((out / split / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and files == {p.name for p in (out / split).glob("model*.safetensors")}  # stale one gone
    assert set(index["weight_map"]) == weight_names(out / split)


def test_full_state_dict_saves_a_plain_checkpoint_and_resumes_from_its_checkpoints(full):
    out, losses, report = full
    check_plain_checkpoints(out, report, "llama", "llama_split")
    assert report["run/checkpoint-2"]["tied"] is True  # the checkpoint's model.safetensors loads in plain transformers
    assert losses["resumed"][2:] == pytest.approx(losses["whole"][2:], abs=1e-6)  # steps 3-4 after the resume
    assert losses["whole"][-1] != losses["whole"][0]
    whole, resumed = torch.load(out / "expected_llama.pt"), torch.load(out / "expected_resumed.pt")
    assert all(torch.allclose(whole[k], resumed[k], atol=1e-6) for k in whole)
    assert report["resumed"] == {"tied": True, "equal": True}


def test_a_model_whose_weights_are_converted_on_save_is_refused_when_the_trainer_is_built(full):
    """transformers 5 saves a Mixtral's experts in another layout than it trains them: the FSDP save cannot, and
    says so before the run, not after it."""
    pytest.importorskip("transformers.core_model_loading", reason="transformers 4 saves every weight as it trains it")
    _, losses, _ = full
    message = losses["mixtral"]
    assert message.startswith("--fsdp cannot save a MixtralForCausalLM: ") and "\n" not in message
    assert message.endswith("train it without --fsdp, or train LoRA adapters of it.")


def test_sharded_state_dict_saves_a_plain_checkpoint_and_lora_adapters(sharded):
    out, _, report = sharded
    check_plain_checkpoints(out, report, "gpt2", "gpt2_split")
    checkpoint = out / "run" / "checkpoint-2"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and not (checkpoint / "model.safetensors").exists()
    assert report["lora"] == {"equal": True}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (out / "lora").iterdir()}
    assert not (out / "lora" / "model.safetensors").exists()
