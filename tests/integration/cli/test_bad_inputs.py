"""A catalogue of bad inputs to run_clm.py and the launcher, each ending in one actionable line.

What each case asserts:
- exit status 2 (optimum_gaudi.errors.EXIT_USER_ERROR), never a traceback (an unexpected exception fails the test);
- one actionable line: the last non-empty line of stderr starts with ``error: `` and holds the expected words
  (what is wrong, or what to type instead); it is the only ``error:`` line; no ``Traceback`` anywhere;
- no partial output: ``--output_dir`` is exactly as it was before the run (absent stays absent).

Cases run in-process (run_clm.main through optimum_gaudi.errors.call_main, one interpreter for all of them);
a few run as real processes, where the whole stderr is what a user sees.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import REPO

from optimum_gaudi import cli
from optimum_gaudi.errors import EXIT_USER_ERROR, call_main

RUN_CLM = REPO / "examples" / "language-modeling" / "run_clm.py"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
TINY = "n_layer=1,n_embd=16,n_head=2,n_positions=64"


def _load_run_clm():
    spec = importlib.util.spec_from_file_location("run_clm_under_test", RUN_CLM)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


run_clm = _load_run_clm()


# The tiny model without its 64 positions: from scratch they grow to --block_size.
LONG_POSITIONS = ["--config_overrides", "n_layer=1,n_embd=16,n_head=2"]


def corpus(lines: int = 120) -> str:
    return "\n".join(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(24)) for i in range(lines))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A small text corpus, a tokenizer trained on it, and a finished run with two checkpoints."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("assets")
    train = root / "train.txt"
    train.write_text(corpus())
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(corpus().splitlines(), trainers.BpeTrainer(vocab_size=64, special_tokens=["<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<unk>", pad_token="<unk>")
    fast.save_pretrained(root / "tokenizer")
    run = root / "run"
    argv = [
        *base_argv(root / "tokenizer", train, run),
        "--max_steps",
        "2",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
    ]
    assert call_main(run_clm.main, argv) == 0
    return root


def base_argv(tokenizer: Path, train: Path, out: Path) -> list[str]:
    return [
        "--model_type", "gpt2", "--config_overrides", TINY, "--tokenizer_name", str(tokenizer),
        "--train_file", str(train), "--do_train", "--max_steps", "1", "--report_to", "none", "--block_size", "32",
        "--per_device_train_batch_size", "2", "--output_dir", str(out), "--save_strategy", "no",
    ]  # fmt: skip


@dataclass
class Workspace:
    """Where one case runs: ``out`` is its --output_dir, ``write`` makes input files."""

    root: Path
    assets: Path

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def base(self) -> list[str]:
        return base_argv(self.assets / "tokenizer", self.assets / "train.txt", self.out)

    def write(self, name: str, content: str | bytes) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def checkpoint(self, name: str = "ckpt", step: int = 2) -> Path:
        """A copy of a complete checkpoint of the tiny model, to damage."""
        target = self.root / name
        shutil.copytree(self.assets / "run" / f"checkpoint-{step}", target)
        return target

    def gaudi_config(self, **config) -> str:
        return self.write("gaudi_config.json", json.dumps(config))


@pytest.fixture
def ws(tmp_path, assets):
    return Workspace(tmp_path, assets)


@pytest.fixture(autouse=True)
def restore_logging():
    """run_clm configures logging to the current stdout; do not keep a handler on a closed capture stream."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def snapshot(path: Path) -> dict[str, int] | None:
    if not path.exists():
        return None
    if path.is_file():
        return {"": path.stat().st_size}
    return {str(p.relative_to(path)): p.stat().st_size if p.is_file() else -1 for p in path.rglob("*")}


def assert_one_line(code: int, err: str, words: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_USER_ERROR, err[-3000:]
    assert lines and lines[-1].startswith("error: "), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1, err[-3000:]
    assert "Traceback" not in err
    assert words in lines[-1], lines[-1]
    return lines[-1]


def ckpt_with(ws: Workspace, name: str, content: bytes | str | None, manifest: bool = True) -> str:
    """A checkpoint whose file ``name`` is replaced by ``content`` (None: deleted); without ``manifest``, as
    transformers.Trainer writes them (then only the files themselves tell)."""
    ckpt = ws.checkpoint()
    if not manifest:
        (ckpt / "checkpoint_manifest.json").unlink()
    (ckpt / name).unlink()
    if content is not None:
        (ckpt / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(ckpt)


def truncated(ws: Workspace, name: str) -> str:
    ckpt = ws.checkpoint()
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])
    return str(ckpt)


def torch_weights(ws: Workspace, content: bytes) -> str:
    """A model directory whose weights are a pytorch_model.bin holding ``content``."""
    ckpt = ws.checkpoint()
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(content)
    return str(ckpt)


def without(argv: list[str], *flags: str) -> list[str]:
    """argv with each flag in ``flags`` and its value removed."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags:
            skip = item not in ("--do_train", "--do_eval")
        else:
            out.append(item)
    return out


P = pytest.param
CASES = [
    # ---- flags and configs --------------------------------------------------------------------------------
    P(lambda w: [*w.base, "--model_type", "gtp2"], "did you mean 'gpt2'", id="model-type-typo"),
    P(lambda w: [*w.base, "--no_such_flag", "1"], "--no_such_flag", id="unknown-flag"),
    P(lambda w: [*w.base, "--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be", id="batch-0"),
    P(lambda w: [*w.base, "--per_device_train_batch_size", "-3"], "--per_device_train_batch_size must", id="batch-neg"),
    P(lambda w: [*w.base, "--per_device_train_batch_size", "two"], "invalid int value: 'two'", id="batch-text"),
    P(lambda w: [*w.base, "--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size must", id="eval-batch-0"),
    P(lambda w: [*w.base, "--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must", id="accum-0"),
    P(lambda w: [*w.base, "--learning_rate", "fast"], "invalid float value: 'fast'", id="lr-text"),
    P(lambda w: [*w.base, "--max_steps", "many"], "invalid int value", id="max-steps-text"),
    P(lambda w: [*w.base, "--report_to", "nosuch"], "not an integration transformers knows", id="report-to-unknown"),
    P(lambda w: [*w.base, "--lr_scheduler_type", "zigzag"], "invalid choice: 'zigzag'", id="scheduler-choice"),
    P(lambda w: [*w.base, "--save_strategy", "sometimes"], "invalid choice: 'sometimes'", id="save-strategy"),
    P(lambda w: [*w.base, "--torch_dtype", "float8"], "invalid choice: 'float8'", id="torch-dtype"),
    P(lambda w: [*w.base, "--distribution_strategy", "fastest"], "invalid choice: 'fastest'", id="strategy"),
    P(lambda w: [*w.base, "--config_overrides", "n_layr=2"], "did you mean 'n_layer'", id="override-typo"),
    P(lambda w: [*w.base, "--config_overrides", "n_layer=abc"], "n_layer must be of type int", id="override-type"),
    P(lambda w: [*w.base, "--config_overrides", "n_layer"], "is not key=value", id="override-syntax"),
    P(
        lambda w: [*without(w.base, "--model_type"), "--model_name_or_path", str(w.assets / "run")],
        "applies when training from scratch",
        id="override-with-pretrained",
    ),  # fmt: skip
    P(lambda w: without(w.base, "--do_train"), "nothing to do", id="nothing-to-do"),
    P(lambda w: [*w.base, "--block_size", "0"], "--block_size must be >= 1", id="block-size-0"),
    P(
        lambda w: [*w.base, "--block_size", "128"],
        "longer than the model's max_position_embeddings=64",
        id="block-too-long",
    ),
    P(lambda w: [*w.base, "--validation_split_percentage", "100"], "must be in [0, 100)", id="split-100"),
    P(lambda w: [*w.base, "--throughput_warmup_steps", "-1"], "--throughput_warmup_steps must be", id="warmup-neg"),
    P(lambda w: [*w.base, "--max_hpu_graphs", "0"], "--max_hpu_graphs must be >= 1", id="max-graphs-0"),
    P(lambda w: [*w.base, "--pipelining_fwd_bwd"], "add --use_lazy_mode", id="pipelining-no-lazy"),
    P(lambda w: [*w.base, "--torch_compile", "--use_lazy_mode"], "needs eager mode", id="compile-lazy"),
    P(lambda w: [*w.base, "--torch_compile_backend", "BOGUS"], "not a torch.compile backend", id="compile-backend"),
    P(lambda w: [*w.base, "--torch_compile_mode", "fastest"], "not a torch.compile mode", id="compile-mode"),
    P(
        lambda w: [*w.base, "--distribution_strategy", "fast_ddp", "--fsdp", "full_shard"],
        "cannot be combined",
        id="fast-ddp-fsdp",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--gaudi_config_name", "nope.json"], "does not exist", id="gaudi-config-missing"),
    P(lambda w: [*w.base, "--gaudi_config_name", w.write("g.json", "{oops")], "Malformed JSON", id="gaudi-json"),
    P(
        lambda w: [*w.base, "--gaudi_config_name", w.gaudi_config(use_fused_adm=True)],
        "Did you mean 'use_fused_adam'",
        id="gaudi-key-typo",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--gaudi_config_name", w.gaudi_config(use_fused_adam="yes")],
        "must be true or false",
        id="gaudi-not-bool",
    ),  # fmt: skip
    P(
        lambda w: [
            *w.base,
            "--gaudi_config_name",
            w.gaudi_config(autocast_bf16_ops=w.write("ops.bin", b"\x00\xff\x00")),
        ],
        "'autocast_bf16_ops' names op-list file",
        id="op-list-binary",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--gaudi_config_name", w.gaudi_config(autocast_fp32_ops="nowhere.txt")],
        "'autocast_fp32_ops' names op-list file nowhere.txt, which does not exist",
        id="op-list-missing",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--gaudi_config_name", w.gaudi_config(autocast_bf16_ops=["mm"], autocast_fp32_ops=["mm"])],
        "in both autocast_bf16_ops and autocast_fp32_ops",
        id="op-in-both-lists",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--gaudi_config_name", str(w.root)], "has no gaudi_config.json", id="gaudi-config-dir"),
    P(
        lambda w: [*without(w.base, "--model_type", "--config_overrides"), "--model_name_or_path", "gpt2"],
        "needs the Hugging Face Hub",
        id="hub-model-offline",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--tokenizer_name", "someone/tokenizer"],
        "tokenizer 'someone/tokenizer' needs the Hugging",
        id="hub-tokenizer-offline",
    ),  # fmt: skip
    P(
        lambda w: [*without(w.base, "--train_file"), "--dataset_name", "wikitext"],
        "dataset 'wikitext' needs the Hug",
        id="hub-dataset-offline",
    ),  # fmt: skip
    P(
        lambda w: [
            *without(w.base, "--model_type", "--config_overrides"),
            "--model_name_or_path",
            str(Path(w.write("empty_model/README", "x")).parent),
        ],
        "cannot load config",
        id="model-dir-empty",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--deepspeed", "ds.json"], "DeepSpeed", id="deepspeed-missing"),
    P(
        lambda w: [
            *without(w.base, "--model_type", "--config_overrides"),
            "--model_name_or_path",
            truncated(w, "model.safetensors"),
        ],
        "cannot load model '",
        id="model-truncated-safetensors",
    ),  # fmt: skip
    P(
        lambda w: [
            *without(w.base, "--model_type", "--config_overrides"),
            "--model_name_or_path",
            ckpt_with(w, "model.safetensors", None, False),
        ],
        "cannot load model '",
        id="model-without-weights",
    ),  # fmt: skip
    P(
        lambda w: [
            *without(w.base, "--model_type", "--config_overrides"),
            "--model_name_or_path",
            torch_weights(w, b"PK\x03\x04 not a model"),
        ],
        "is damaged or truncated",
        id="model-garbage-bin",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--max_train_samples", "0"], "--max_train_samples must be >= 1", id="max-train-samples-0"),
    P(lambda w: [*w.base, "--do_eval", "--max_eval_samples", "-1"], "--max_eval_samples must be", id="max-eval-neg"),
    P(lambda w: [*w.base, "--learning_rate", "-1"], "--learning_rate must be >= 0", id="lr-negative"),
    P(lambda w: [*w.base, "--weight_decay", "-0.1"], "--weight_decay must be >= 0", id="weight-decay-negative"),
    P(lambda w: [*w.base, "--adam_beta1", "2"], "--adam_beta1 must be in [0, 1)", id="adam-beta1"),
    P(lambda w: [*w.base, "--adam_epsilon=-1e-8"], "--adam_epsilon must be >= 0", id="adam-epsilon"),
    P(lambda w: [*w.base, "--dataloader_num_workers", "-1"], "--dataloader_num_workers must be", id="workers-neg"),
    P(lambda w: [*w.base, "--max_steps", "-1", "--num_train_epochs", "0"], "nothing to train", id="zero-epochs"),
    P(lambda w: [*w.base, "--logging_steps", "0"], "requires non-zero --logging_steps", id="logging-steps-0"),
    P(lambda w: [*w.base, "--bf16", "--fp16"], "At most one of fp16 and bf16", id="bf16-and-fp16"),
    P(lambda w: [*w.base, "--optim", "adamx"], "invalid choice: 'adamx' (did you mean", id="optim-typo"),
    P(
        lambda w: [*w.base, "--config_name", w.write("cfg.json", "{garbage")],
        "is not a valid JSON file",
        id="config-garbage",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--tokenizer_name", str(Path(w.write("tok/README", "x")).parent)],
        "cannot load tokenizer",
        id="tokenizer-dir-empty",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--gaudi_config_name", w.write("list.json", "[1]")],
        "must hold a JSON object",
        id="gaudi-config-list",
    ),  # fmt: skip
    P(lambda w: [w.write("args.json", "{not json")], "is not JSON", id="args-file-not-json"),
    P(
        lambda w: [w.write("args.json", '{"output_dir": "x", "do_trian": true}')],
        "did you mean 'do_train'",
        id="args-file-unknown-key",
    ),  # fmt: skip
    P(lambda w: [w.write("args.json", "[1, 2]")], "must hold one JSON object", id="args-file-list"),
    # ---- data ---------------------------------------------------------------------------------------------
    P(lambda w: [*w.base, "--train_file", w.write("empty.txt", "")], "is empty", id="train-empty"),
    P(lambda w: [*w.base, "--train_file", w.write("blank.txt", "\n\n  \n")], "only blank lines", id="train-blank"),
    P(
        lambda w: [*w.base, "--train_file", w.write("bin.txt", bytes(range(256)) * 4)],
        "is a binary file",
        id="train-binary",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("latin.txt", "caf\xe9 cr\xe8me\n".encode("latin-1"))],
        "is not UTF-8 text",
        id="train-latin1",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.json", "this is not json\n")],
        "neither JSON nor JSON Lines",
        id="train-not-json",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.jsonl", '{"text": "a"}\n{"text": \n')],
        "neither JSON nor JSON Lines (line 2",
        id="jsonl-broken-line",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.jsonl", "[1, 2]\n[3]\n")],
        "is a JSON list, not an object",
        id="jsonl-lists",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.csv", "id,body\n1,hello there\n2,general\n")],
        "has no column 'text' (its columns: id, body); name the text column with --text_column_name",
        id="csv-no-text-column",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.jsonl", '{"content": "a b"}\n{"content": "c"}\n')],
        "(its columns: content)",
        id="jsonl-no-text-column",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.csv", "text\n" + corpus(20)), "--text_column_name", "body"],
        "has no column 'body' (its columns: text); pick another",
        id="text-column-name-wrong",
    ),  # fmt: skip
    P(
        lambda w: [
            *w.base,
            "--train_file",
            w.write("t.csv", "id,body\n1,hello\n2,there\n"),
            "--text_column_name",
            "id",
        ],
        "column 'id' holds int64 values, not text; pick another with --text_column_name (its columns: id, body)",
        id="text-column-of-ids",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.jsonl", '{"text": 5}\n{"text": 7}\n')],
        "column 'text' holds int64 values, not text",
        id="jsonl-numbers",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("t.jsonl", '{"text": 5}\n{"text": "hello there"}\n')],
        "column 'text' holds mixed values, not text",
        id="jsonl-mixed",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--train_file", w.write("t.csv", 'text\n"unterminated\n')], "cannot read", id="csv-broken"),
    P(lambda w: [*w.base, "--train_file", w.write("t.xml", "<a/>")], "unsupported extension", id="train-xml"),
    P(lambda w: [*w.base, "--train_file", w.write("h.csv", "text\n")], "cannot read", id="csv-header-only"),
    P(
        lambda w: [*w.base, "--train_file", str(Path(w.write("d.txt/x", "x")).parent)],
        "is a directory",
        id="train-is-dir",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--train_file", "missing.txt"], "missing.txt does not exist", id="train-missing"),
    P(lambda w: [*w.base, "--validation_file", w.write("v.csv", "text\nx\n")], "same kind of file", id="mixed-kinds"),
    P(lambda w: [*w.base, "--validation_file", w.write("v.txt", "")], "--validation_file", id="validation-empty"),
    P(
        lambda w: [*without(w.base, "--train_file"), "--validation_file", w.write("v.txt", "x")],
        "--validation_file needs --train_file",
        id="validation-without-train",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--dataset_name", "wikitext"], "not both", id="dataset-and-file"),
    P(
        lambda w: [*w.base, "--train_file", w.write("one.txt", "just one line of text"), "--do_eval"],
        "too few to hold out 5% for validation",
        id="too-small-to-split",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--train_file", w.write("short.txt", "short\ntext\n")],
        "fewer than --block_size=32",
        id="text-shorter-than-block",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--do_eval", "--validation_file", w.write("v.txt", "tiny")],
        "the validation text has 6 tokens at most, fewer than --block_size=32",
        id="validation-too-short",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, *LONG_POSITIONS, "--train_file", w.write("s.txt", "a b\n" * 2500), "--block_size", "7000"],
        "has 14,250 tokens at most, but a block never spans two batches of 1000 texts and the largest batch has 6,000",
        id="batches-too-short-in-bytes",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, *LONG_POSITIONS, "--train_file", w.write("l.txt", corpus(2500)), "--block_size", "30000"],
        "tokens, but a block never spans two batches of 1000 texts and the largest batch has",
        id="batches-too-short-in-tokens",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--do_eval", "--validation_split_percentage", "0"],
        "--do_eval needs validation data",
        id="eval-without-validation",
    ),  # fmt: skip
    # ---- output -------------------------------------------------------------------------------------------
    P(lambda w: [*w.base, "--output_dir", w.write("a_file", "x")], "is a file, not a directory", id="output-is-file"),
    P(
        lambda w: [*w.base, "--output_dir", w.write("f", "x") + "/sub"],
        "is a file, not a directory",
        id="output-under-file",
    ),  # fmt: skip
    # ---- resume -------------------------------------------------------------------------------------------
    P(lambda w: [*w.base, "--resume_from_checkpoint", str(w.root / "nothing")], "does not exist", id="resume-nothing"),
    P(lambda w: [*w.base, "--resume_from_checkpoint", w.write("f.bin", "x")], "is a file", id="resume-file"),
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", str(Path(w.write("e/.keep", "")).parent.with_name("e2"))],
        "does not exist",
        id="resume-missing-dir",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", str(Path(w.write("notes/readme.txt", "x")).parent)],
        "has no trainer_state.json",
        id="resume-not-a-checkpoint",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", str(w.checkpoint("run/checkpoint-2").parent)],
        "it holds checkpoint-2: pass ",
        id="resume-output-dir",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", str(w.assets / "run")],
        "is a saved model, not a checkpoint: it has no optimizer.pt or scheduler.pt (it holds checkpoint-1, checkpoint-2",
        id="resume-finished-output-dir",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", truncated(w, "model.safetensors")],
        "model.safetensors",
        id="resume-truncated-safetensors",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "trainer_state.json", "{garbage")],
        "trainer_state.json has 8 bytes where",
        id="resume-garbage-state",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "trainer_state.json", "{garbage", False)],
        "trainer_state.json is not a trainer state",
        id="resume-garbage-state-no-manifest",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "trainer_state.json", '{"foo": 1}', False)],
        "trainer_state.json is not a trainer state",
        id="resume-wrong-state",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "trainer_state.json", None)],
        "trainer_state.json is missing",
        id="resume-no-state",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "trainer_state.json", None, False)],
        "has no trainer_state.json",
        id="resume-no-state-no-manifest",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "model.safetensors", b"\x08" + bytes(7), False)],
        "model.safetensors is truncated",
        id="resume-bad-safetensors-no-manifest",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "optimizer.pt", b"", False)],
        "optimizer.pt is empty",
        id="resume-empty-optimizer-no-manifest",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "model.safetensors", None, False)],
        "holds no model weights",
        id="resume-no-weights-no-manifest",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "model.safetensors", None)],
        "model.safetensors is missing",
        id="resume-no-weights",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "optimizer.pt", b"")],
        "optimizer.pt",
        id="resume-empty-optimizer",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", truncated(w, "optimizer.pt")],
        "optimizer.pt",
        id="resume-truncated-optimizer",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "training_args.bin", b"")],
        "training_args.bin",
        id="resume-empty-training-args",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "checkpoint_manifest.json", "{")],
        "checkpoint_manifest.json is unreadable",
        id="resume-bad-manifest",
    ),  # fmt: skip
    P(
        lambda w: [*w.base, "--resume_from_checkpoint", str(Path(w.write("empty/x", "")).parent)],
        "has no trainer_state",
        id="resume-dir-of-empty-file",
    ),  # fmt: skip
    P(
        lambda w: [
            *w.base,
            "--config_overrides",
            "n_layer=1,n_embd=32,n_head=2,n_positions=64",
            "--resume_from_checkpoint",
            str(w.checkpoint()),
        ],
        "holds another model",
        id="resume-other-size",
    ),  # fmt: skip
    P(
        lambda w: [
            *w.base,
            "--config_overrides",
            "n_layer=2,n_embd=16,n_head=2,n_positions=64",
            "--resume_from_checkpoint",
            str(w.checkpoint()),
        ],
        "holds another model (model.safetensors): it lacks 12 weight(s) (transformer.h.1.",
        id="resume-other-depth",
    ),  # fmt: skip
    P(lambda w: [*w.base, "--resume_from_checkpoint", "true"], "holds no checkpoint", id="resume-true-nothing"),
]


@pytest.mark.parametrize("make_argv, words", CASES)
def test_bad_input_is_one_line_and_leaves_no_output(ws, capsys, make_argv, words):
    argv = make_argv(ws)
    before = snapshot(ws.out)
    code = call_main(run_clm.main, argv)
    assert_one_line(code, capsys.readouterr().err, words)
    assert snapshot(ws.out) == before


# Mistakes in the data, found before a model is built (and before any text is tokenized).
DATA_MISTAKES = {
    "csv-no-text-column",
    "jsonl-no-text-column",
    "text-column-name-wrong",
    "text-column-of-ids",
    "jsonl-mixed",
    "csv-broken",
    "too-small-to-split",
    "text-shorter-than-block",
    "validation-too-short",
    "batches-too-short-in-bytes",
    "eval-without-validation",
}


@pytest.mark.parametrize("make_argv, words", [case for case in CASES if case.id in DATA_MISTAKES])
def test_data_mistakes_come_before_the_model_is_built(ws, capsys, monkeypatch, make_argv, words):
    monkeypatch.setattr(run_clm, "load_model", lambda *a, **k: pytest.fail("the model was built first"))
    assert_one_line(call_main(run_clm.main, make_argv(ws)), capsys.readouterr().err, words)


def test_resume_from_an_empty_directory(ws, capsys):
    (ws.root / "empty").mkdir()
    code = call_main(run_clm.main, [*ws.base, "--resume_from_checkpoint", str(ws.root / "empty")])
    assert_one_line(code, capsys.readouterr().err, "is an empty directory")
    assert not ws.out.exists()


def test_resume_true_with_only_incomplete_checkpoints(ws, capsys):
    ws.out.mkdir()
    (ws.out / "checkpoint-4").mkdir()
    (ws.out / "checkpoint-4" / "config.json").write_text("{}")
    before = snapshot(ws.out)
    code = call_main(run_clm.main, [*ws.base, "--resume_from_checkpoint", "true"])
    assert_one_line(code, capsys.readouterr().err, "holds only incomplete checkpoints (checkpoint-4)")
    assert snapshot(ws.out) == before


def test_rerun_into_a_directory_with_checkpoints_is_refused(ws, capsys):
    shutil.copytree(ws.assets / "run", ws.out)
    before = snapshot(ws.out)
    line = assert_one_line(call_main(run_clm.main, ws.base), capsys.readouterr().err, "already holds checkpoints")
    assert "--resume_from_checkpoint true" in line and "--overwrite_output_dir" in line
    assert snapshot(ws.out) == before


def test_rerun_into_a_directory_with_a_trained_model_is_refused(ws, capsys):
    """A run with --save_strategy no leaves its model and no checkpoint-N: a rerun would overwrite the model."""
    shutil.copytree(ws.assets / "run", ws.out, ignore=shutil.ignore_patterns("checkpoint-*"))
    before = snapshot(ws.out)
    line = assert_one_line(call_main(run_clm.main, ws.base), capsys.readouterr().err, "already holds a trained model")
    assert "(trainer_state.json, model.safetensors)" in line and "--overwrite_output_dir" in line
    assert snapshot(ws.out) == before
    assert call_main(run_clm.main, [*ws.base, "--overwrite_output_dir"]) == 0
    assert call_main(run_clm.main, [*without(ws.base, "--do_train"), "--do_eval"]) == 0  # evaluating writes no model


def test_overwrite_output_dir_starts_over_without_the_old_checkpoints(ws):
    shutil.copytree(ws.assets / "run", ws.out)
    assert call_main(run_clm.main, [*ws.base, "--overwrite_output_dir"]) == 0
    assert not list(ws.out.glob("checkpoint-*"))


def test_overwrite_output_dir_with_a_bad_input_deletes_nothing(ws, capsys):
    shutil.copytree(ws.assets / "run", ws.out)
    before = snapshot(ws.out)
    code = call_main(run_clm.main, [*ws.base, "--overwrite_output_dir", "--train_file", ws.write("e.txt", "")])
    assert_one_line(code, capsys.readouterr().err, "is empty")
    assert snapshot(ws.out) == before


@pytest.mark.parametrize("integration", ["tensorboard", "wandb", "mlflow"])
def test_report_to_a_missing_integration_names_the_pip_line(ws, capsys, monkeypatch, integration):
    from transformers.integrations import get_available_reporting_integrations

    if integration in get_available_reporting_integrations():
        pytest.skip(f"{integration} is installed here")
    monkeypatch.setattr(run_clm, "load_tokenizer", lambda *a, **k: pytest.fail("work began before the check"))
    code = call_main(run_clm.main, [*ws.base, "--report_to", integration])
    line = assert_one_line(code, capsys.readouterr().err, f"--report_to {integration} needs {integration}")
    assert "pip install" in line
    if integration == "tensorboard":
        assert "optimum-gaudi[tensorboard]" in line
    assert not ws.out.exists()


def test_read_only_output_dir(ws, capsys, monkeypatch):
    ws.out.mkdir()
    real_mkstemp = run_clm_checkpoints().output_dir.tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if Path(dir) == ws.out:
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    if os.geteuid() != 0:  # a real read-only directory where permissions apply
        ws.out.chmod(0o555)
    else:  # root writes anywhere: the file system's answer is simulated
        monkeypatch.setattr(run_clm_checkpoints().output_dir.tempfile, "mkstemp", read_only)
    try:
        code = call_main(run_clm.main, ws.base)
        assert_one_line(code, capsys.readouterr().err, "is not writable")
        assert os.listdir(ws.out) == []
    finally:
        ws.out.chmod(0o755)


def test_output_dir_on_a_full_disk(ws, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    code = call_main(run_clm.main, ws.base)
    assert_one_line(code, capsys.readouterr().err, "the disk is full (4 KiB free)")
    assert not ws.out.exists()


def test_output_dir_too_small_for_one_checkpoint_is_refused_before_step_1(ws, capsys, monkeypatch):
    """2 MiB free (more than the full-disk check's 1 MiB) for a model whose checkpoint takes 4.7 MiB."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 2 * 2**20))
    monkeypatch.setattr(run_clm.GaudiTrainer, "training_step", lambda *a, **k: pytest.fail("a training step ran"))
    wide = "n_layer=2,n_embd=128,n_head=2,n_positions=64"
    argv = [*ws.base, "--config_overrides", wide, "--save_strategy", "steps"]
    line = assert_one_line(call_main(run_clm.main, argv), capsys.readouterr().err, "one checkpoint needs at least")
    assert "only 2.0 MiB is free" in line
    assert not ws.out.exists()


def test_disk_full_while_saving_a_checkpoint_leaves_no_half_checkpoint(ws, capsys, monkeypatch):
    """The second save fails half-way through the optimizer file with ENOSPC, as a full disk does."""
    import torch

    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            calls.append(f)
            if len(calls) == 2:
                Path(f).write_bytes(b"PK\x03\x04 half")
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    argv = [*ws.base, "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1"]
    line = assert_one_line(call_main(run_clm.main, argv), capsys.readouterr().err, "no space left")
    assert "checkpoint-2" in line and "--resume_from_checkpoint true" in line
    assert sorted(p.name for p in ws.out.iterdir() if p.name.startswith(("checkpoint-", ".staging"))) == [
        "checkpoint-1"
    ]
    assert run_clm_checkpoints().checkpoint_problem(ws.out / "checkpoint-1") is None


@pytest.mark.parametrize("existed", [False, True])
def test_disk_full_at_the_first_save_leaves_the_output_dir_as_it_was(ws, capsys, monkeypatch, existed):
    """The first checkpoint's optimizer file fails with ENOSPC: nothing of the run is left to keep, so the
    --output_dir that training made goes again (an empty one that was there before stays)."""
    import torch

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            Path(f).write_bytes(b"PK\x03\x04 half")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    if existed:
        ws.out.mkdir()
    monkeypatch.setattr(torch, "save", save)
    argv = [*ws.base, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"]
    line = assert_one_line(call_main(run_clm.main, argv), capsys.readouterr().err, "no space left")
    assert "checkpoint-1" in line
    assert snapshot(ws.out) == ({} if existed else None)


def test_the_embedded_corpus_cannot_be_split_at_0_percent(ws, capsys):
    argv = [*without(ws.base, "--train_file", "--tokenizer_name"), "--validation_split_percentage", "0"]
    assert_one_line(call_main(run_clm.main, argv), capsys.readouterr().err, "needs --validation_split_percentage > 0")


def run_clm_checkpoints():
    from optimum_gaudi import checkpoints

    return checkpoints


# ---- launcher ---------------------------------------------------------------------------------------------


@pytest.fixture
def launcher_env(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


LAUNCH_CASES = [
    P(lambda w: ["--world_size", "0", str(RUN_CLM)], "--world_size must be >= 1", id="launch-world-0"),
    P(lambda w: ["--world_size", "two", str(RUN_CLM)], "--world_size must be a whole number", id="launch-world-text"),
    P(lambda w: [str(w.root / "missing.py")], "training script not found", id="launch-no-script"),
    P(lambda w: ["--nnodes", "2", str(RUN_CLM)], "need node 0's address", id="launch-no-master-addr"),
    P(
        lambda w: ["--node_rank", "3", "--nnodes", "2", "--master_addr", "h", str(RUN_CLM)],
        "node ranks go from 0 to 1",
        id="launch-node-rank",
    ),  # fmt: skip
    P(lambda w: ["--use_deepspeed", "--use_mpi", str(RUN_CLM)], "exclude each other", id="launch-two-launchers"),
    P(
        lambda w: ["--hostfile", w.write("hosts", "a slots=8\n"), str(RUN_CLM)],
        "--hostfile needs --use_deepspeed",
        id="launch-hostfile-torchrun",
    ),  # fmt: skip
    P(lambda w: ["--master_port", "70000", str(RUN_CLM)], "--master_port must be from 1 to 65535", id="launch-port"),
]


@pytest.mark.parametrize("make_argv, words", LAUNCH_CASES)
def test_launcher_bad_input_is_one_line(ws, capsys, launcher_env, make_argv, words):
    assert_one_line(cli.main(["launch", *make_argv(ws)]), capsys.readouterr().err, words)


def test_launcher_port_in_use_is_one_line_before_anything_starts(ws, capsys, launcher_env, monkeypatch):
    from optimum_gaudi.launch import launcher

    monkeypatch.setattr(launcher, "run", lambda *a, **k: pytest.fail("the job was started"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = cli.main(["launch", "--master_port", str(port), str(RUN_CLM)])
    assert_one_line(code, capsys.readouterr().err, f"port {port} is already in use")


def test_port_taken_after_the_check_is_named_from_the_job_output():
    from optimum_gaudi.launch import launcher
    from optimum_gaudi.launch import plan as launch_plan

    plan = launch_plan.LaunchPlan(backend="torchrun", script="x.py", master_port=29555)
    output = "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
    output += "address. port: 29555, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
    assert "port 29555 on 127.0.0.1 is already in use" in launcher.describe_failure(plan, output, 1)


# ---- as a user sees it: real processes --------------------------------------------------------------------


def _run(
    argv: list[str], env_extra: dict | None = None, script: list[str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    command = script or [sys.executable, str(RUN_CLM)]
    return subprocess.run([*command, *argv], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "make_argv, words",
    [
        P(lambda w: [*w.base, "--model_type", "gtp2"], "did you mean 'gpt2'", id="argparse"),
        P(lambda w: [*w.base, "--train_file", w.write("t.csv", "id,body\n1,x\n")], "--text_column_name", id="data"),
        P(
            lambda w: [*w.base, "--resume_from_checkpoint", ckpt_with(w, "trainer_state.json", "{", False)],
            "is not a trainer state",
            id="resume",
        ),  # fmt: skip
    ],
)
def test_in_a_real_process_stderr_is_one_line(ws, make_argv, words):
    result = _run(make_argv(ws))
    assert_one_line(result.returncode, result.stderr, words)
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr  # no page of usage, at most a warning
    assert not ws.out.exists()


def test_launcher_port_in_use_in_a_real_process(ws, launcher_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(
            ["launch", "--master_port", str(port), str(RUN_CLM), *ws.base],
            script=[sys.executable, "-m", "optimum_gaudi"],
        )
    assert_one_line(result.returncode, result.stderr, f"port {port} is already in use")
    assert not ws.out.exists()
