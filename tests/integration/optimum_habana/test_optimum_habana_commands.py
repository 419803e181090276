"""optimum-habana's README command lines for the tasks shipped here (language modeling, text classification,
summarization, TRL), run against our examples: every argument parses with optimum-habana's meaning, the launcher
in front of it (gaudi_spawn.py's flags) parses with ours, and a shrunk copy of each command trains on CPU, offline.

The commands are in tests/data/optimum_habana_commands.json, copied verbatim from the READMEs (the commit is
there). A shrunk run keeps every flag but these: the Hub model becomes a tiny local one of the same kind, Hub
datasets (--dataset_name, --dataset_config_name, --task_name) give way to the examples' embedded data,
--deepspeed is dropped (DeepSpeed is not installed in the test environment; with it installed it is tested by
tests/integration/distributed/test_deepspeed.py), sizes shrink (steps, batches, lengths, warm-up) and --output_dir is a temporary one.
A command with --fsdp runs on 2 and 4 simulated Gaudis through `optimum-gaudi launch` (in one launch with the
long-sequence command), with optimum-habana's fsdp_config.json (its settings are in tests/data); FSDP over gloo on
CPU processes with that file is tests/integration/distributed/test_fsdp_trainings.py's.
The environment variables in front of a command (PT_HPU_LAZY_MODE=1, ...) are set for its run; without a Gaudi
they change nothing.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import census
import pytest
import torch
from conftest import FAKES, use_torchao
from support import TESTS, load_example

from optimum_gaudi.errors import UserError

EXAMPLES = TESTS.parent / "examples"
DATA = json.loads((TESTS / "data" / "optimum_habana_commands.json").read_text(encoding="utf-8"))
SCRIPTS = {
    "run_clm.py": EXAMPLES / "language-modeling" / "run_clm.py",
    "run_mlm.py": EXAMPLES / "language-modeling" / "run_mlm.py",
    "run_lora_clm.py": EXAMPLES / "language-modeling" / "run_lora_clm.py",
    "run_glue.py": EXAMPLES / "text-classification" / "run_glue.py",
    "run_summarization.py": EXAMPLES / "summarization" / "run_summarization.py",
    "sft.py": EXAMPLES / "trl" / "sft.py",
    "dpo.py": EXAMPLES / "trl" / "dpo.py",
    "grpo.py": EXAMPLES / "trl" / "grpo.py",
}
TRL_SCRIPTS = {"sft.py", "dpo.py", "grpo.py"}
has_trl = importlib.util.find_spec("trl") is not None
has_peft = importlib.util.find_spec("peft") is not None
has_deepspeed = importlib.util.find_spec("deepspeed") is not None


@dataclass
class Command:
    id: str
    readme: str
    env: dict[str, str]
    launcher: list[str] | None  # gaudi_spawn.py's flags, None when the script runs alone
    script: str
    args: list[str]  # as the script receives them


def through_gaudi_spawn(args: list[str]) -> list[str]:
    """What the script receives from gaudi_spawn.py: it joins the arguments into one shell command (quoting those
    with a space that are not quoted yet) and runs it with bash, so '"3.0.0"' reaches the script as 3.0.0."""
    joined = " ".join(f'"{a}"' if " " in a and not (a.startswith('"') and a.endswith('"')) else a for a in args)
    return shlex.split(joined)


def read_command(entry: dict) -> Command:
    words = shlex.split(entry["command"].replace("\\\n", " "))
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words.pop(0) in ("python", "python3"), entry["id"]
    launcher = None
    if words[0].endswith("gaudi_spawn.py"):
        words.pop(0)
        at = next(i for i, word in enumerate(words) if word.endswith(".py"))
        launcher, words = words[:at], words[at:]
    script, args = Path(words[0]).name, words[1:]
    return Command(entry["id"], entry["readme"], env, launcher, script, through_gaudi_spawn(args) if launcher else args)


COMMANDS = {entry["id"]: read_command(entry) for entry in DATA["commands"] if not entry["skip"]}
SKIPPED = {entry["id"]: entry["skip"] for entry in DATA["commands"] if entry["skip"]}


def options(args: list[str]) -> list[tuple[str, list[str]]]:
    """(name, values) for each --flag of a command line, in order; --flag=value counts as --flag value."""
    found: list[tuple[str, list[str]]] = []
    for word in args:
        if word.startswith("--"):
            name, sep, value = word[2:].partition("=")
            found.append((name, [value] if sep else []))
        else:
            found[-1][1].append(word)
    return found


# ---- the data file ---------------------------------------------------------------------------------------------


def test_the_data_file_holds_the_readmes_commands_and_says_why_any_is_not_run():
    assert len(DATA["commit"]) == 40
    per_readme: dict[str, int] = {}
    for command in COMMANDS.values():
        per_readme[command.readme.split("/")[1]] = per_readme.get(command.readme.split("/")[1], 0) + 1
    assert per_readme == {"language-modeling": 18, "text-classification": 6, "summarization": 4, "trl": 7}
    assert {c.script for c in COMMANDS.values()} == set(SCRIPTS)
    assert len([c for c in COMMANDS.values() if c.script == "run_lora_clm.py"]) == 8
    assert len(SKIPPED) == 14 and all(why for why in SKIPPED.values())
    launched = {i: c.launcher for i, c in COMMANDS.items() if c.launcher is not None}
    assert len(launched) == 19 and all("--use_deepspeed" in f or "--use_mpi" in f for f in launched.values())


# ---- the launcher: gaudi_spawn.py's flags ----------------------------------------------------------------------


@pytest.mark.parametrize("command_id", sorted(i for i, c in COMMANDS.items() if c.launcher is not None))
def test_the_launcher_flags_parse_with_ours_and_pass_the_arguments_on(command_id, tmp_path, monkeypatch):
    from optimum_gaudi.launch import plan as launch_plan

    command = COMMANDS[command_id]
    monkeypatch.setattr(launch_plan, "_deepspeed_executable", lambda environ: "deepspeed")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for name in ("WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    flags = [tmp_path / "hosts" if word == "path_to_my_hostfile" else word for word in command.launcher]
    (tmp_path / "hosts").write_text("gaudi-a slots=8\ngaudi-b slots=8\n")
    parser = argparse.ArgumentParser()
    launch_plan.add_arguments(parser)
    launch_args = parser.parse_args([*map(str, flags), str(SCRIPTS[command.script]), *command.args])
    plan = launch_plan.resolve(launch_args, environ={"PATH": str(tmp_path / "bin")})
    assert plan.backend == ("deepspeed" if "--use_deepspeed" in flags else "mpi")
    world_size = flags[flags.index("--world_size") + 1] if "--world_size" in flags else "1"  # gaudi_spawn's default
    assert plan.nproc_per_node == int(world_size)
    assert plan.nnodes == (2 if "--hostfile" in flags else 1)
    assert list(plan.script_args) == command.args
    built = launch_plan.build_command(plan, python="python", environ={})
    assert built[-len(command.args) :] == command.args


def test_gaudi_spawns_second_reading_is_applied_and_our_launcher_warns_about_quotes_it_would_keep(capsys):
    from optimum_gaudi.cli import main

    command = COMMANDS["summarization-t5-multi-card-mpi"]
    raw = shlex.split(next(e["command"] for e in DATA["commands"] if e["id"] == command.id).replace("\\\n", " "))
    assert '"summarize: "' in raw and "summarize: " in command.args and "3.0.0" in command.args
    script = str(SCRIPTS["run_summarization.py"])
    assert main(["launch", "--dry_run", script, "--source_prefix", '"summarize: "']) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        'optimum-gaudi launch: warning: the script argument "summarize: " keeps its quotes: arguments are passed on '
        "as your shell gave them (gaudi_spawn.py had bash read them again); quote once to drop them."
    ]
    assert main(["launch", "--dry_run", script, "--source_prefix", "summarize: "]) == 0
    assert capsys.readouterr().err == ""


# ---- every argument parses, with optimum-habana's meaning ------------------------------------------------------


def example(script: str):
    """Import an example as a module, its folder on sys.path as when it runs."""
    return load_example(SCRIPTS[script], prefix="oh_example")


def parse_with_example(script: str, argv: list[str]) -> tuple:
    module = example(script)
    if script in TRL_SCRIPTS:
        import common

        if script == "sft.py":
            return common.parse(module.GaudiSFTConfig, argv)
        if script == "dpo.py":
            return common.parse(module.GaudiDPOConfig, argv)
        return common.parse(
            module.GaudiGRPOConfig, argv, module.RewardArguments, script_class=module.GRPOScriptArguments
        )
    import run_clm

    if script == "run_lora_clm.py":
        groups = (module.ModelArguments, module.DataArguments, module.GaudiTrainingArguments, module.FinetuneArguments)
        return run_clm.parse_args(argv, groups)
    groups = (module.ModelArguments, module.DataTrainingArguments)
    training = (
        module.GaudiSeq2SeqTrainingArguments if script == "run_summarization.py" else module.GaudiTrainingArguments
    )
    return run_clm.parse_args(argv, (*groups, training))


# Placeholders in the READMEs for files the user has: a file of the kind the script reads.
PLACEHOLDER_FILES = {
    "path_to_train_file": "train.txt",
    "path_to_validation_file": "validation.txt",
    "path_to_csv_or_jsonlines_file": "pairs.json",
}
# optimum-habana's arguments that are read under another name here, and how to find their value.
READ_AS = {
    "gaudi_config": "gaudi_config_name",  # argparse's prefix match, as in optimum-habana
    "dataset_config": "dataset_config_name",
    "max_seq_len": "max_seq_length",
    "warmup_ratio": "warmup_steps",  # transformers 5: a float below 1 is a ratio (removed_args.py)
}


# Flags optimum-habana's commands pass that one process refuses, in one line each (parsed here in one process).
REFUSED = {
    "context_parallel_size": r"^--context_parallel_size 4 splits each sequence over 4 processes and this run has 1"
}
# A shrunk command that splits its sequences runs launched, on this many processes, each sequence split over all of
# them (the tiny Llama's 2 key/value heads divide by 2, not by the README's 4).
SPLIT_OVER = 2
# FSDP: the README's fsdp_config.json is optimum-habana's file, whose settings tests/data holds; a shrunk FSDP
# command runs on simulated Gaudis through the launcher (a single process has nothing to shard).
HABANA_FSDP_CONFIG = TESTS / "data" / "optimum_habana_fsdp_config.json"
FSDP_COMMANDS = sorted(i for i, c in COMMANDS.items() if "--fsdp" in c.args)


def write_placeholder_files(tmp_path: Path) -> dict[str, str]:
    from optimum_gaudi.data.corpus import default_corpus_texts

    texts = default_corpus_texts()[:40]
    (tmp_path / "train.txt").write_text("\n\n".join(texts[:30]))
    (tmp_path / "validation.txt").write_text("\n\n".join(texts[30:]))
    pairs = [{"text": t.split("\n\n", 1)[-1], "summary": t.split("\n", 1)[0]} for t in texts]
    (tmp_path / "pairs.json").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return {word: str(tmp_path / name) for word, name in PLACEHOLDER_FILES.items()} | {
        "fsdp_config.json": str(HABANA_FSDP_CONFIG)
    }


def without(args: list[str], *names: str) -> list[str]:
    """`args` without the --flags in `names` and their values."""
    kept: list[str] = []
    for name, values in options(args):
        if name not in names:
            kept += [f"--{name}", *values]
    return kept


def replaced(args: list[str], values: dict[str, str | None]) -> list[str]:
    """`args` with the value of each --flag in `values` replaced (None: the flag dropped); flags not there added."""
    out: list[str] = []
    seen = set()
    for name, given in options(args):
        if name in values:
            seen.add(name)
            if values[name] is not None:
                out += [f"--{name}", values[name]]
        else:
            out += [f"--{name}", *given]
    for name, value in values.items():
        if name not in seen and value is not None:
            out += [f"--{name}", value]
    return out


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    return value


def means_the_same(parsed, given: list[str]) -> bool:
    """The parsed value is what optimum-habana's parser makes of `given` (HfArgumentParser's conventions)."""
    parsed = _plain(parsed)
    if isinstance(parsed, bool):
        return parsed == (not given or given[0].lower() in ("true", "1", "yes"))
    if isinstance(parsed, (list, tuple)):
        return [str(_plain(v)) for v in parsed] == given or (given == ["none"] and not parsed)
    (text,) = given
    if isinstance(parsed, float):
        return math.isclose(parsed, float(text))
    if isinstance(parsed, int):
        return parsed == int(text)
    return str(parsed) == text


def check_meanings(command: Command, argv: list[str], parsed: tuple) -> None:
    for name, given in options(argv):
        owner = next((group for group in parsed if hasattr(group, READ_AS.get(name, name))), None)
        assert owner is not None, f"{command.id}: --{name} was accepted but is nowhere in the parsed arguments"
        if name == "optim" and given == ["paged_adamw_32bit"] and importlib.util.find_spec("bitsandbytes") is None:
            assert _plain(owner.optim) == "adamw_torch"  # the same AdamW update, said in one line
        elif name == "torch_compile_backend" and given == ["hpu_backend"]:
            assert owner.torch_compile_backend == owner.gaudi_device.compile_backend  # the Gaudi's, or this device's
        elif name == "use_flash_attention":
            assert owner.use_flash_attention and parsed[1].attn_implementation == "gaudi_fused_sdpa"
        elif name == "fsdp":  # transformers 5 keeps the options in fsdp_config and --fsdp as a switch
            assert owner.fsdp is True and owner.fsdp_plugin_args["fsdp_version"] == 2
        elif name == "fsdp_config":  # FSDP1's keys, read as the FSDP2 settings they mean
            plugin = owner.fsdp_plugin_args
            assert plugin["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and plugin["reshard_after_forward"] is True
            assert plugin["transformer_cls_names_to_wrap"] == "GaudiLlamaDecoderLayer" and "cpu_offload" not in plugin
        elif name == "max_seq_length" and command.script == "sft.py":
            assert owner.max_seq_length == int(given[0])  # read as --max_length when the script runs
        else:
            value = getattr(owner, READ_AS.get(name, name))
            assert means_the_same(value, given), f"{command.id}: --{name} {given} parsed as {value!r}"


@pytest.fixture(autouse=True)
def _process_state(monkeypatch):
    """The arguments set process-wide switches (PT_HPU_LAZY_MODE, sdp_on_bf16's math-SDPA switch, a tensorboard
    variable): each test leaves them as it found them."""
    import os

    saved_env = dict(os.environ)
    math_sdp = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    yield
    os.environ.clear()
    os.environ.update(saved_env)
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(math_sdp)


def needs(command: Command) -> None:
    if "--fp8" in command.args:
        use_torchao()
    if command.script in TRL_SCRIPTS and not has_trl:
        pytest.skip("TRL is an optional extra: pip install '.[trl]'")
    if "--lora_target_modules" in command.args and not has_peft:
        pytest.skip("LoRA needs PEFT: pip install '.[peft]'")


@pytest.mark.parametrize("command_id", sorted(COMMANDS))
def test_every_argument_parses_with_optimum_habanas_meaning(command_id, tmp_path):
    command = COMMANDS[command_id]
    needs(command)
    files = write_placeholder_files(tmp_path)
    argv = [files.get(word, word) for word in command.args]
    argv = replaced(argv, {"output_dir": str(tmp_path / "out")})
    if "--deepspeed" in argv:  # the README's config is a placeholder or optimum-habana's: checked without it
        if not has_deepspeed:
            with pytest.raises(UserError, match=r"^--deepspeed needs DeepSpeed: pip install deepspeed"):
                parse_with_example(command.script, argv)
        argv = without(argv, "deepspeed")
    for flag, refusal in REFUSED.items():  # not supported here: one line, then the rest is checked without it
        if f"--{flag}" in argv:
            with pytest.raises(UserError, match=refusal):
                parse_with_example(command.script, argv)
            argv = without(argv, flag)
    parsed = parse_with_example(command.script, argv)
    check_meanings(command, argv, parsed)


# ---- a shrunk copy of each command trains on CPU, to the end --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Tiny local stand-ins for the Hub models of the commands, with the embedded tokenizers: GPT-2 (gpt2, GPT-J,
    GPT-NeoX, StarCoder), BERT (RoBERTa, BERT large), Llama without a padding token (Llama Guard, Qwen2, Mixtral,
    Llama 2 and 3), Llama with a chat template (Gemma's instruction model), Falcon and T5 (t5-small)."""
    import os

    from transformers import (
        BertConfig,
        BertForMaskedLM,
        FalconConfig,
        FalconForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    from optimum_gaudi.data.corpus import default_tokenizer
    from optimum_gaudi.data.tasks import default_mlm_tokenizer

    root = tmp_path_factory.mktemp("tiny_models")
    saved = os.environ.get("OPTIMUM_GAUDI_CACHE")
    os.environ["OPTIMUM_GAUDI_CACHE"] = str(root / "cache")  # the embedded corpus and tokenizers, built once here
    tokenizer, mlm_tokenizer = default_tokenizer(), default_mlm_tokenizer()
    vocab = len(tokenizer)
    torch.manual_seed(0)
    models = {
        "gpt2": (GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_layer=1, n_embd=32, n_head=2, n_positions=128,
                                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)), tokenizer),
        "bert": (
            BertForMaskedLM(
                BertConfig(vocab_size=len(mlm_tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64, pad_token_id=mlm_tokenizer.pad_token_id)
            ),
            mlm_tokenizer,
        ),
        "llama": (
            LlamaForCausalLM(
                LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
            ),
            tokenizer,
        ),
        "t5": (
            T5ForConditionalGeneration(
                T5Config(vocab_size=vocab, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         decoder_start_token_id=tokenizer.pad_token_id)
            ),
            tokenizer,
        ),
    }  # fmt: skip
    paths = {}
    for name, (model, model_tokenizer) in models.items():
        paths[name] = root / name
        model.save_pretrained(paths[name])
        model_tokenizer.save_pretrained(paths[name])
    torch.manual_seed(0)  # Falcon (query_key_value, dense, dense_h_to_4h, dense_4h_to_h: the LoRA targets there)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))  # fmt: skip
    paths["falcon"] = root / "falcon"
    falcon.save_pretrained(paths["falcon"])
    tokenizer.save_pretrained(paths["falcon"])
    paths["llama-chat"] = root / "llama-chat"  # an instruction model: the tokenizer has a chat template
    models["llama"][0].save_pretrained(paths["llama-chat"])
    tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<assistant>"
    tokenizer.save_pretrained(paths["llama-chat"])
    tokenizer.chat_template = None
    torch.manual_seed(0)  # Llama 3.1's grouped heads split over 4 cards: 8 query over 4 key/value heads
    paths["llama-8-heads"] = root / "llama-8-heads"
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                     ).save_pretrained(paths["llama-8-heads"])  # fmt: skip
    tokenizer.save_pretrained(paths["llama-8-heads"])
    llama_tokenizer = json.loads((paths["llama"] / "tokenizer_config.json").read_text())
    llama_tokenizer.pop("pad_token", None)  # as Llama's: --add_pad_token has something to do
    (paths["llama"] / "tokenizer_config.json").write_text(json.dumps(llama_tokenizer))
    yield paths
    if saved is None:
        os.environ.pop("OPTIMUM_GAUDI_CACHE", None)
    else:
        os.environ["OPTIMUM_GAUDI_CACHE"] = saved


# The tiny model standing in for each Hub model of the commands.
STAND_INS = {
    "gpt2": "gpt2", "EleutherAI/gpt-j-6b": "gpt2", "EleutherAI/gpt-neox-20b": "gpt2", "roberta-base": "bert",
    "bert-large-uncased-whole-word-masking": "bert", "meta-llama/LlamaGuard-7b": "llama", "t5-small": "t5",
    "Qwen/Qwen2-0.5B-Instruct": "llama", "Qwen/Qwen2-7B": "llama", "mistralai/Mixtral-8x7B-Instruct-v0.1": "llama",
    "meta-llama/Llama-2-70b-hf": "llama", "meta-llama/Llama-2-7b-hf": "llama", "sft/final_merged_checkpoint": "llama",
    "huggyllama/llama-7b": "llama", "meta-llama/Meta-Llama-3.1-8B": "llama", "meta-llama/Llama-3.1-8B": "llama",
    "google/gemma-2b-it": "llama-chat", "tiiuae/falcon-40b": "falcon", "bigcode/starcoder": "gpt2",
}  # fmt: skip
MODEL_FLAGS = ("model_name_or_path", "config_name", "tokenizer_name", "tokenizer_name_or_path")
HUB_DATA = ("dataset_name", "dataset_config_name", "dataset_config", "task_name")
QUIET = {"report_to": "none", "disable_tqdm": "true"}
SMALL = {  # sizes only; every other flag of the command is kept
    "run_clm.py": {"block_size": "32", "max_train_samples": "8", "max_eval_samples": "4"},
    "run_mlm.py": {"max_seq_length": "32", "max_train_samples": "8", "max_eval_samples": "4"},
    "run_lora_clm.py": {"max_seq_length": "64", "max_train_samples": "8", "max_eval_samples": "4"},
    "run_glue.py": {"max_seq_length": "32", "max_train_samples": "8", "max_eval_samples": "8"},
    "run_summarization.py": {
        "max_source_length": "64", "max_target_length": "8", "max_train_samples": "8", "max_eval_samples": "4"
    },
    "sft.py": {"max_seq_length": "64", "max_train_samples": "16"},
    "dpo.py": {"max_length": "64", "max_prompt_length": "16", "max_train_samples": "16"},
    "grpo.py": {"max_prompt_length": "16", "max_completion_length": "4", "num_generations": "2", "max_train_samples": "16"},
}  # fmt: skip
SMALL_MODEL = {"config_overrides": "n_embd=32,n_head=2,n_layer=1,n_positions=64"}  # --model_type gpt2 from scratch


def shrunk(command: Command, tmp_path: Path, models: dict[str, Path]) -> list[str]:
    files = write_placeholder_files(tmp_path)
    argv = without([files.get(word, word) for word in command.args], *HUB_DATA, "deepspeed")
    given = dict(options(argv))
    values = {
        flag: str(models[STAND_INS[given[flag][0]]]) for flag in MODEL_FLAGS if flag in given
    }  # fmt: skip
    values |= {"output_dir": str(tmp_path / "out"), "max_steps": "2", "per_device_train_batch_size": "2"}
    values |= {"per_device_eval_batch_size": "2", "gradient_accumulation_steps": "1", **QUIET}
    if "throughput_warmup_steps" in given:
        values["throughput_warmup_steps"] = "1"
    if "config_overrides" in given:
        values |= SMALL_MODEL
    if "context_parallel_size" in given:
        values["context_parallel_size"] = str(SPLIT_OVER)
    return replaced(argv, values | SMALL[command.script])


def run_in_process(command: Command, argv: list[str]) -> dict | None:
    return example(command.script).main(argv)


def run_launched(command: Command, argv: list[str], processes: int) -> None:
    """The script on `processes` CPU processes through our launcher, as gaudi_spawn.py starts it on a Gaudi."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    launch = [sys.executable, "-m", "optimum_gaudi", "launch", "--world_size", str(processes)]
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([*launch, str(SCRIPTS[command.script]), *argv], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("command_id", sorted(set(COMMANDS) - set(FSDP_COMMANDS)))
def test_a_shrunk_copy_trains_on_cpu_to_the_end(command_id, tmp_path, tiny_models, monkeypatch):
    command = COMMANDS[command_id]
    needs(command)
    for name, value in command.env.items():
        monkeypatch.setenv(name, value)
    argv = shrunk(command, tmp_path, tiny_models)
    given = dict(options(argv))
    trains = command.script in TRL_SCRIPTS or "do_train" in given
    evaluates = "do_eval" in given and command.script != "grpo.py"  # GRPO evaluates only with --eval_strategy
    if "context_parallel_size" in given:
        run_launched(command, argv, int(given["context_parallel_size"][0]))
    else:
        run_in_process(command, argv)

    out = tmp_path / "out"
    if trains:
        metrics = json.loads((out / "train_results.json").read_text())
        assert math.isfinite(metrics["train_loss"]) and metrics["train_runtime"] > 0
        if "lora_target_modules" in given or given.get("use_peft") == ["True"] or command.script == "run_lora_clm.py":
            adapter = json.loads((out / "adapter_config.json").read_text())
            assert adapter["r"] == int(given.get("lora_r", given.get("lora_rank", ["8"]))[0])
            if "lora_target_modules" in given:
                assert set(adapter["target_modules"]) <= set(given["lora_target_modules"])
            assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
        else:
            assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        if command.script not in TRL_SCRIPTS:
            assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
        if given.get("save_strategy") == ["epoch"]:
            assert (out / "checkpoint-2").is_dir()  # max_steps ends the epoch early: its checkpoint is saved
    else:
        assert not (out / "model.safetensors").exists()
    if "gaudi_config_name" in given or "gaudi_config" in given:
        assert (out / "gaudi_config.json").is_file() == trains
    if evaluates:
        metrics = json.loads((out / "eval_results.json").read_text())
        assert math.isfinite(metrics["eval_loss"]) and metrics["eval_samples"] > 0
        if command.script in ("run_clm.py", "run_mlm.py", "sft.py"):
            assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
        if command.script == "run_glue.py":
            assert 0 <= metrics["eval_accuracy"] <= 1
        if command.script == "run_summarization.py":
            assert {"eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_gen_len"} <= set(metrics)
    if given.get("add_pad_token") == ["True"] and trains:
        config = json.loads((out / "config.json").read_text())
        assert config["pad_token_id"] == config["eos_token_id"]  # Llama's eos pads, as in optimum-habana


# ---- the FSDP and long-sequence commands on simulated Gaudis ---------------------------------------------------

LONG_SEQUENCE = "lora-llama3.1-8b-long-sequence"
RUN_EXAMPLES = TESTS / "scripts" / "run_examples.py"


def gaudi_runs(world: int, tmp_path: Path, models: dict[str, Path]) -> dict[str, list[str]]:
    """The shrunk FSDP command as written (eager, torch.compile through hpu_backend), without --torch_compile, and
    as DDP; the shrunk long-sequence command in eager mode (--use_lazy_mode False, so no --pipelining_fwd_bwd),
    its sequences split over all `world` cards, without and with --torch_compile, and as fast_ddp over the same rows
    (`world` rows a step: one a card under fast_ddp). LoRA dropout off in the long-sequence runs, whose splits
    would otherwise draw different masks."""
    (fsdp_id,) = FSDP_COMMANDS
    fsdp = shrunk(COMMANDS[fsdp_id], tmp_path, models)
    eager = without(fsdp, "torch_compile", "torch_compile_backend")
    long = without(shrunk(COMMANDS[LONG_SEQUENCE], tmp_path, models), "use_lazy_mode", "pipelining_fwd_bwd")
    long = replaced(long, {"use_lazy_mode": "False", "lora_dropout": "0", "context_parallel_size": str(world),
                           "per_device_train_batch_size": str(world), "model_name_or_path": str(models["llama-8-heads"])})  # fmt: skip
    compiled = ["--torch_compile", "--torch_compile_backend", "hpu_backend"]
    runs = {
        "fsdp_compile": fsdp,
        "fsdp_eager": eager,
        "ddp": without(eager, "fsdp", "fsdp_config"),
        "long_eager": long,  # after the FSDP runs in the same processes: no FSDP of theirs left over
        "long_compile": long + compiled,
        "long_fast_ddp": replaced(without(long, "context_parallel_size"),
                                  {"per_device_train_batch_size": "1", "distribution_strategy": "fast_ddp"}),
    }  # fmt: skip
    return {name: replaced(argv, {"output_dir": str(tmp_path / name)}) for name, argv in runs.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_and_long_sequence_commands_train_as_ddp_on_simulated_gaudis(world, tmp_path, tiny_models):
    """optimum-habana's FSDP and long-sequence commands on `world` simulated Gaudis (software 1.21, hccl), one after
    the other in the same processes as a user's session runs them, each in eager mode and with torch.compile: the
    gradient norms equal DDP's on the same rows (bf16 on Habana's op list: within 1%; the losses are bf16 and
    equal), compiled equal to eager, and every collective is one the bridge maps and docs/collectives.md lists."""
    import os
    import subprocess

    needs(COMMANDS[LONG_SEQUENCE])
    runs = gaudi_runs(world, tmp_path, tiny_models)
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps({name: {"script": "run_lora_clm.py", "argv": argv} for name, argv in runs.items()}))
    (tmp_path / "ops_bf16.txt").write_text((TESTS / "data" / "optimum_habana_ops_bf16.txt").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(COMMANDS[FSDP_COMMANDS[0]].env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", FAKE_HPU_DEVICE="1")
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [FAKES, env.get("PYTHONPATH")])), FAKE_HPU_SOFTWARE="1.21")
    env.update(FAKE_HPU_DEVICE_COUNT=str(world), FAKE_HPU_CALL_LOG=str(tmp_path / "simulator.json"))
    env["OPTIMUM_GAUDI_CACHE"] = str(tiny_models["llama"].parent / "cache")
    launch = [sys.executable, "-m", "optimum_gaudi", "launch", "--world_size", str(world)]
    result = subprocess.run([*launch, str(RUN_EXAMPLES), str(tmp_path / "out.json"), str(spec)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"^fsdp\s+on\s+FSDP2 fully_shard over hccl", result.stdout + result.stderr, re.M)  # the table
    written = tmp_path / "fsdp_compile"  # the FSDP command's outputs, as on a Gaudi
    assert json.loads((written / "trainer_state.json").read_text())["global_step"] == 2
    assert json.loads((written / "adapter_config.json").read_text())["r"] == 4
    assert (written / "adapter_model.safetensors").is_file()
    assert math.isfinite(json.loads((written / "eval_results.json").read_text())["eval_loss"])
    out = json.loads((tmp_path / "out.json.0").read_text())
    for run, reference in (("fsdp_compile", "ddp"), ("fsdp_eager", "ddp"), ("long_eager", "long_fast_ddp"),
                           ("long_compile", "long_fast_ddp"), ("fsdp_compile", "fsdp_eager"), ("long_compile", "long_eager")):  # fmt: skip
        assert len(out[run]["losses"]) == 2 and out[run]["losses"] == out[reference]["losses"], (run, reference)
        assert out[run]["grad_norms"] == pytest.approx(out[reference]["grad_norms"], rel=0.01), (run, reference)
    issued = {census.key(entry) for entry in census.check(tmp_path / "simulator.json", range(world))}
    assert ("FSDP2", "reduce_scatter_tensor", "SUM", "bfloat16") in issued  # summed: HCCL has no AVG
    assert ("a torch.compile graph", "alltoall_base", "-", "bfloat16") in issued  # the all-to-all compiled
    assert {"sequence parallelism", "fast_ddp"} <= {key[0] for key in issued}


# ---- the arguments the examples took from optimum-habana's scripts for these commands --------------------------


def _stack_exchange(tmp_path: Path) -> Path:
    """A local dataset shaped like lvwerra/stack-exchange-paired (its data/finetune folder) and NuminaMath's."""
    from optimum_gaudi.data.corpus import default_corpus_texts

    rows = [
        {"question": t.split("\n", 1)[0], "response_j": t[:200], "response_k": "no idea", "problem": t[:80]}
        for t in default_corpus_texts()[:24]
    ]
    folder = tmp_path / "stack" / "data" / "finetune"
    folder.mkdir(parents=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "stack"


TRL_TINY = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none", "--disable_tqdm", "true"]


@pytest.mark.skipif(not has_trl, reason="TRL is an optional extra: pip install '.[trl]'")
@pytest.mark.parametrize(
    ("script", "own"),
    [
        ("sft.py", ["--max_length", "64"]),
        ("dpo.py", ["--max_length", "64", "--max_prompt_length", "8"]),
        ("grpo.py", ["--num_generations", "2", "--max_completion_length", "4", "--max_prompt_length", "8"]),
    ],
)
def test_trl_examples_read_a_named_dataset_as_optimum_habanas_scripts(script, own, tmp_path, tiny_models):
    dataset = _stack_exchange(tmp_path)
    module = example(script)
    argv = ["--model_name_or_path", str(tiny_models["llama"]), "--dataset_name", str(dataset), "--subset"]
    argv += ["data/finetune", "--output_dir", str(tmp_path / "out"), *TRL_TINY, *own]
    module.main(argv)
    assert json.loads((tmp_path / "out" / "train_results.json").read_text())["train_loss"] is not None
    if script == "sft.py":  # the text optimum-habana's sft.py makes of a Stack Exchange row
        row = json.loads((dataset / "data" / "finetune" / "rows.jsonl").read_text().splitlines()[0])
        text = module.stack_exchange_text(row)["text"]
        assert text == f"Question: {row['question']}\n\nAnswer: {row['response_j']}"


@pytest.mark.skipif(not has_trl, reason="TRL is an optional extra: pip install '.[trl]'")
def test_a_named_dataset_without_the_columns_is_one_line(tmp_path, tiny_models, capsys):
    from optimum_gaudi.errors import call_main

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "rows.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    argv = ["--model_name_or_path", str(tiny_models["llama"]), "--dataset_name", str(folder)]
    argv += ["--output_dir", str(tmp_path / "out"), *TRL_TINY]
    assert call_main(example("dpo.py").main, argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --dataset_name {folder}: DPO needs the columns prompt/chosen/rejected or "
        "question/response_j/response_k; it has body."
    )


def test_ignore_pad_token_for_loss_false_makes_the_padding_a_target(tiny_models):
    from transformers import AutoTokenizer

    module = example("run_summarization.py")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["t5"])
    kept, ignored = (module.DataTrainingArguments(ignore_pad_token_for_loss=flag) for flag in (False, True))
    assert module.label_padding(tokenizer, kept) == tokenizer.pad_token_id
    assert module.label_padding(tokenizer, ignored) == -100
