"""Run optimum-habana's own example scripts, ported with docs/optimum-habana.md's import table, on tiny local models.

usage: PYTHONPATH=$PWD python tests/scripts/try_optimum_habana_scripts.py [--edit-accuracy] MIRROR SCRATCH [ID ...]

MIRROR is a git clone of optimum-habana (its HEAD is read, nothing is copied into this repository), SCRATCH an
empty folder. Each command line is a README one from tests/data/optimum_habana_commands.json, shrunk as
tests/integration/optimum_habana/test_optimum_habana_commands.py shrinks ours: the Hub model becomes a tiny local one, Hub data a few local
rows (a folder named as the Hub dataset where the script hard-codes the name), 2 steps; every other flag is kept.
Launchers (gaudi_spawn.py) and --deepspeed are left out. The scripts run with this interpreter, one at a time; the
last line is one row per command: "runs to the end" (trained and saved) or the script's last error line.
--edit-accuracy also makes the doc's one-line edit to `evaluate.load("accuracy")`, which needs the Hub.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# the test files whose command lines and import port it reuses
sys.path[:0] = [str(TESTS / "integration" / "optimum_habana"), str(TESTS / "unit" / "optimum_habana")]
sys.path.insert(0, str(TESTS))

from test_optimum_habana_commands import COMMANDS, options, replaced, without, write_placeholder_files  # noqa: E402
from test_optimum_habana_imports import port  # noqa: E402

SCRIPT_PATHS = {
    "run_glue.py": "examples/text-classification/run_glue.py",
    "run_clm.py": "examples/language-modeling/run_clm.py",
    "run_lora_clm.py": "examples/language-modeling/run_lora_clm.py",
    "sft.py": "examples/trl/sft.py",
    "dpo.py": "examples/trl/dpo.py",
    "grpo.py": "examples/trl/grpo.py",
}
DEFAULT_IDS = [
    "glue-bert-large-single", "clm-gpt2-own-files", "clm-gpt2-config-overrides", "lora-llama1-7b-single",
    "lora-starcoder-own-files", "sft-llama2-7b-mpi", "dpo-llama2-70b-deepspeed", "grpo-qwen2-single",
]  # fmt: skip
# The one-line edit docs/optimum-habana.md gives for `evaluate.load("accuracy")`, which fetches from the Hub.
ACCURACY = re.compile(r'evaluate\.load\("accuracy".*\)')
OFFLINE_ACCURACY = (
    'type("Accuracy", (), {"compute": lambda self, predictions, references: '
    '{"accuracy": float((predictions == references).mean())}})()'
)
MODELS = {
    "bert-large-uncased-whole-word-masking": "bert", "gpt2": "gpt2", "bigcode/starcoder": "gpt2",
    "Qwen/Qwen2-0.5B-Instruct": "llama-chat",
}  # fmt: skip
SIZES = {  # sizes only, as in the tests
    "run_glue.py": {"max_seq_length": "32", "max_train_samples": "8", "max_eval_samples": "8"},
    "run_clm.py": {"block_size": "32", "max_train_samples": "8", "max_eval_samples": "4"},
    "run_lora_clm.py": {"max_seq_length": "64", "max_train_samples": "8", "max_eval_samples": "4"},
    "sft.py": {"max_seq_length": "64", "size_valid_set": "2"},
    "dpo.py": {"max_length": "512", "max_prompt_length": "16"},
    "grpo.py": {
        "max_prompt_length": "16",
        "max_completion_length": "4",
        "num_generations": "2",
        "gradient_accumulation_steps": "1",
    },
}


def tiny_models(root: Path) -> dict[str, str]:
    """A 1-layer GPT-2, Llama (also with a chat template) and BERT with the package's embedded tokenizers, saved
    with this transformers."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from optimum_gaudi.data.corpus import default_tokenizer
    from optimum_gaudi.data.tasks import default_mlm_tokenizer

    tok, mlm_tok = default_tokenizer(), default_mlm_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    models = {
        "gpt2": (GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_layer=1, n_embd=32, n_head=2, n_positions=128, **ids)), tok),
        "llama": (LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, **ids)), tok),
        "bert": (BertForMaskedLM(BertConfig(vocab_size=len(mlm_tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=64, pad_token_id=mlm_tok.pad_token_id)), mlm_tok),
    }  # fmt: skip
    for name, (model, tokenizer) in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    models["llama"][0].save_pretrained(root / "llama-chat")  # an instruction model
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    tok.save_pretrained(root / "llama-chat")
    # No token_type_ids, as GPT-2's, Llama's and Qwen's tokenizers (transformers 4 gives a plain fast tokenizer
    # them, and generate() then refuses them).
    for name in ("gpt2", "llama", "llama-chat"):
        config = root / name / "tokenizer_config.json"
        config.write_text(
            json.dumps(json.loads(config.read_text()) | {"model_input_names": ["input_ids", "attention_mask"]})
        )
    return {name: str(root / name) for name in [*models, "llama-chat"]}


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def local_data(root: Path) -> dict[str, str]:
    """Files for --train_file, and folders named as the Hub datasets the commands (or scripts) name."""
    texts = [f"the cat number {i} sat on the mat and looked at the dog number {i + 1}" for i in range(100)]
    glue = [{"sentence1": t, "sentence2": t[::-1], "label": i % 2} for i, t in enumerate(texts[:24])]
    write_rows(root / "glue_train.json", glue)
    write_rows(root / "glue_validation.json", glue[:8])
    write_rows(root / "tatsu-lab/alpaca/train.json", [{"instruction": t, "input": "", "output": t} for t in texts])
    pairs = [{"question": t[:20], "response_j": t[20:40], "response_k": t[40:]} for t in texts[:24]]
    math = [{"problem": f"{i} + {i}?", "solution": f"${2 * i}$", "messages": []} for i in range(40)]
    for split in ("train", "test"):
        write_rows(root / f"AI-MO/NuminaMath-TIR/{split}.json", math)
    for subset in ("data/finetune", "data/rl", "data/evaluation"):
        write_rows(root / "lvwerra/stack-exchange-paired" / subset / "train.json", pairs)
    return {"train_file": str(root / "glue_train.json"), "validation_file": str(root / "glue_validation.json")}


def shrunk(command, scratch: Path, models: dict[str, str], glue: dict[str, str]) -> list[str]:
    files = write_placeholder_files(scratch)
    args = without([files.get(word, word) for word in command.args], "deepspeed", "task_name", "dataset_config_name")
    values = {"output_dir": str(scratch / f"out-{command.id}"), "max_steps": "2", "report_to": "none"}
    values |= {"per_device_train_batch_size": "2", "per_device_eval_batch_size": "2", "throughput_warmup_steps": "1"}
    given = dict(options(args))
    for flag in ("model_name_or_path", "config_name", "tokenizer_name", "tokenizer_name_or_path"):
        if flag in given:
            values[flag] = models[MODELS.get(given[flag][0], "llama")]
    if command.script == "run_glue.py":
        values |= glue
    if command.id == "clm-gpt2-config-overrides":
        values |= {"config_overrides": "n_embd=32,n_head=2,n_layer=1,n_positions=64", "dataset_name": None}
        values |= {"train_file": files["path_to_train_file"], "validation_file": files["path_to_validation_file"]}
    if command.script == "dpo.py":
        values = {k: v for k, v in values.items() if k in ("output_dir", "max_steps", "report_to")} | {
            "model_name_or_path": models["llama"], "tokenizer_name_or_path": models["llama"], "sanity_check": "True"
        }  # fmt: skip
    return replaced(args, values | SIZES[command.script])


def main(mirror: str, scratch: str, ids: list[str], edit_accuracy: bool = False) -> None:
    scratch_dir = Path(scratch).resolve()
    scratch_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OPTIMUM_GAUDI_CACHE", str(scratch_dir / "cache"))
    models, glue = tiny_models(scratch_dir / "models"), local_data(scratch_dir)
    results = []
    for command_id in ids or DEFAULT_IDS:
        command = COMMANDS[command_id]
        source = subprocess.run(
            ["git", "-C", mirror, "show", f"HEAD:{SCRIPT_PATHS[command.script]}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        script = scratch_dir / command.script
        ported = port(source)[0]
        script.write_text(ACCURACY.sub(OFFLINE_ACCURACY, ported) if edit_accuracy else ported)
        argv = [sys.executable, str(script), *shrunk(command, scratch_dir, models, glue)]
        print("$", " ".join(argv), flush=True)
        env = os.environ | command.env | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        run = subprocess.run(argv, cwd=scratch_dir, env=env, capture_output=True, text=True, timeout=900)
        (scratch_dir / f"{command_id}.log").write_text(run.stdout + run.stderr)
        saved = any((scratch_dir / f"out-{command_id}").rglob("*.safetensors"))  # a checkpoint, or save_model()
        last = [line for line in run.stderr.splitlines() if line.strip()][-1:] or [""]
        results.append(
            (command_id, "runs to the end" if run.returncode == 0 and saved else f"rc {run.returncode}: {last[0]}")
        )
        print(results[-1], flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    edit = "--edit-accuracy" in sys.argv
    arguments = [argument for argument in sys.argv[1:] if argument != "--edit-accuracy"]
    main(arguments[0], arguments[1], arguments[2:], edit)
