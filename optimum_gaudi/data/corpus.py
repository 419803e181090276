"""A default corpus and tokenizer that need no download, plus the tokenize-and-group step of causal LM training.

The examples must run on an offline machine out of the box, so the default corpus is English text that
ships with every Python: the docstrings of the CPython standard library. That text is the Python Software
Foundation's, distributed with Python under the PSF License Agreement, which allows redistribution and
derived works. The tokenizer is a byte-level BPE trained locally on it in a few seconds. Both are cached
under ``$OPTIMUM_GAUDI_CACHE`` (default ``~/.cache/optimum_gaudi``) so later runs start at once.
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Callable, Collection
from itertools import chain, islice
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerFast

from ..errors import UserError

logger = logging.getLogger(__name__)

CACHE_ENV = "OPTIMUM_GAUDI_CACHE"
END_OF_TEXT = "<|endoftext|>"
# Bump when the extraction or the tokenizer recipe changes, so stale caches are not reused.
_FORMAT_VERSION = 1
_MIN_DOC_CHARS = 40
# Directories of the standard library that are not prose about the library: tests, an IDE, a dead tool.
_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
GROUP_BATCH_TEXTS = 1000  # texts per batch when cutting blocks: a block never spans two batches


class DataError(UserError, ValueError):
    """Training or evaluation data that cannot be used as given; the message says what to change."""


def cache_dir() -> Path:
    """Where the corpus and tokenizer are cached: ``$OPTIMUM_GAUDI_CACHE`` or ``~/.cache/optimum_gaudi``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "optimum_gaudi").expanduser()


def _atomic_write(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so a concurrent or killed run never sees half a file.

    A cache that cannot be written (read-only home, full disk) only costs time, so it is logged, not raised.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp makes it private; a cache may be shared
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        logger.warning("Could not cache %s (%s); it will be rebuilt next time.", path, e)


def _clean(doc: str) -> str:
    lines = [line.rstrip() for line in doc.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one file, in source order (dedented by ast)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return []  # e.g. deliberately broken files; a corpus does not need every one
    found = [
        (getattr(node, "lineno", 0), ast.get_docstring(node)) for node in ast.walk(tree) if isinstance(node, _DOC_NODES)
    ]
    return [_clean(doc) for _, doc in sorted(found, key=lambda item: item[0]) if doc]


def _extract_stdlib_docstrings(stdlib: Path) -> list[str]:
    texts: list[str] = []
    seen: set[str] = set()
    for path in sorted(stdlib.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(stdlib).parts[:-1]):
            continue
        for doc in _docstrings(path):
            if len(doc) >= _MIN_DOC_CHARS and doc not in seen:  # duplicates would leak across the split
                seen.add(doc)
                texts.append(doc)
    return texts


def default_corpus_texts() -> list[str]:
    """The default corpus: docstrings of the CPython standard library, one text per docstring.

    About 1.5 MB of English technical prose (~6,000 texts on Python 3.11), the Python Software Foundation's
    documentation text, redistributable under the PSF License. Order is deterministic (sorted file paths,
    source order within a file). Built in a few seconds the first time, then read from the cache.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    version = f"{sys.implementation.name}{'.'.join(map(str, sys.version_info[:3]))}"
    key = hashlib.sha256(f"{_FORMAT_VERSION}:{version}:{stdlib}".encode()).hexdigest()[:12]
    path = cache_dir() / f"stdlib-docstrings-{version}-{key}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            logger.warning("Ignoring unreadable corpus cache %s.", path)
    texts = _extract_stdlib_docstrings(stdlib)
    if not texts:
        raise RuntimeError(f"No docstrings found under {stdlib}; pass --train_file or --dataset_name instead.")
    _atomic_write(path, json.dumps(texts, ensure_ascii=False))
    return texts


def _corpus_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:12]


def _train_bpe(texts: list[str], vocab_size: int) -> str:
    """Train a GPT-2-style byte-level BPE; return its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer.to_str()


def default_tokenizer(vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on :func:`default_corpus_texts`, usable with GPT-2 style models.

    ``<|endoftext|>`` (id 0) is the bos, eos, unk and pad token, as in GPT-2. Trained in a few seconds the
    first time, then loaded from the cache.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + {END_OF_TEXT}), got {vocab_size}.")
    from tokenizers import Tokenizer

    texts = default_corpus_texts()
    path = cache_dir() / f"bpe-{vocab_size}-v{_FORMAT_VERSION}-{_corpus_digest(texts)}.json"
    if path.is_file():
        try:
            return _wrap(Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises its own exception type for a corrupt file
            logger.warning("Ignoring unreadable tokenizer cache %s (%s).", path, e)
    serialized = _train_bpe(texts, vocab_size)
    _atomic_write(path, serialized)
    return _wrap(Tokenizer.from_str(serialized))


def _wrap(tokenizer: Any) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        model_max_length=1024,
    )


def split_texts(texts: list[str], validation_fraction: float = 0.05, seed: int = 42) -> DatasetDict:
    """A ``DatasetDict`` with ``train`` and ``validation`` splits of ``texts`` (column ``text``).

    The split is a seeded shuffle of whole texts, so it is the same on every machine and run.
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be between 0 and 1, got {validation_fraction}.")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(texts) * validation_fraction))
    val, train = sorted(order[:n_val]), sorted(order[n_val:])
    return DatasetDict(
        train=Dataset.from_dict({"text": [texts[i] for i in train]}),
        validation=Dataset.from_dict({"text": [texts[i] for i in val]}),
    )


def default_datasets(validation_fraction: float = 0.05, seed: int = 42) -> DatasetDict:
    """The default corpus as train/validation text splits; see :func:`default_corpus_texts`."""
    return split_texts(default_corpus_texts(), validation_fraction, seed)


def _tokenize_fn(tokenizer: PreTrainedTokenizerFast, text_column: str) -> Callable[[dict], dict]:
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        # verbose=False: texts longer than model_max_length are expected, blocks are cut afterwards.
        texts = [text or "" for text in batch[text_column]]  # empty cells of a csv/json file come as None
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        # End each document with eos, as GPT-2 was trained, so a block never reads across documents unmarked.
        return {"input_ids": [seq + [eos] for seq in ids] if eos is not None else ids}

    return tokenize


def _group_fn(block_size: int) -> Callable[[dict], dict]:
    def group(batch: dict[str, list]) -> dict[str, list]:
        stream = list(chain.from_iterable(batch["input_ids"]))
        usable = len(stream) - len(stream) % block_size  # the ragged tail of each map batch is dropped
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks], "labels": blocks}

    return group


def tokenize_and_group(
    raw: DatasetDict | Dataset,
    tokenizer: PreTrainedTokenizerFast,
    block_size: int,
    text_column: str | None = None,
    num_proc: int | None = None,
    load_from_cache_file: bool = True,
    required: Collection[str] = (),
) -> DatasetDict | Dataset:
    """Tokenize texts and cut the token stream into ``block_size`` blocks with ``labels = input_ids``.

    Causal LM training wants full, equal-length blocks: no padding, no wasted compute, static shapes (which
    Gaudi's graph caching needs). The model shifts the labels itself. Each split of a DatasetDict named in
    ``required`` must give at least one block, else DataError says why (its tokens, counted by batch).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    columns = list(next(iter(raw.values())).column_names if isinstance(raw, DatasetDict) else raw.column_names)
    text_column = find_text_column(raw, text_column)
    tokenized = raw.map(
        _tokenize_fn(tokenizer, text_column),
        batched=True,
        num_proc=num_proc,
        remove_columns=columns,
        load_from_cache_file=load_from_cache_file,
        desc="Tokenizing",
    )
    blocks = tokenized.map(
        _group_fn(block_size),
        batched=True,
        batch_size=GROUP_BATCH_TEXTS,
        num_proc=num_proc,
        load_from_cache_file=load_from_cache_file,
        desc=f"Grouping into blocks of {block_size}",
    )
    for split in required:
        if len(blocks[split]) == 0:
            sums = _batch_sums(tokenized[split], lambda batch: pc.list_value_length(batch["input_ids"]))
            raise DataError(_short_of_a_block(split, block_size, sums, "tokens"))
    return blocks


def check_text_fills_a_block(texts: Dataset, text_column: str, block_size: int, split: str) -> None:
    """Before tokenizing: raise DataError when ``texts`` cannot give one block of ``block_size`` tokens with any
    tokenizer. Every token covers at least one byte of text, except a prefix token per text (SentencePiece's) and
    the eos added per text, so a text of n bytes makes at most n + 2 tokens; a block never spans two batches."""
    sums = _batch_sums(texts, lambda batch: pc.add(pc.binary_length(batch[text_column]).fill_null(0), 2))
    problem = _short_of_a_block(split, block_size, sums, "tokens at most")
    if problem is not None:
        raise DataError(problem)


def _batch_sums(dataset: Dataset, lengths: Callable[[Any], Any]) -> list[int]:
    """The sum of ``lengths(batch)`` (an Arrow array per row) over each batch of rows that is cut into blocks; read
    batch by batch, so that a split of a large dataset is not copied whole."""
    batches = dataset.with_format("arrow").iter(batch_size=GROUP_BATCH_TEXTS)
    return [pc.sum(lengths(batch)).as_py() or 0 for batch in batches]


def _short_of_a_block(split: str, block_size: int, sums: list[int], unit: str) -> str | None:
    """Why no block of ``block_size`` comes from batches of these token counts (None: one does), in one line."""
    if max(sums, default=0) >= block_size:
        return None
    if sum(sums) < block_size:
        return f"the {split} text has {sum(sums):,} {unit}, fewer than --block_size={block_size}; lower --block_size."
    return (
        f"the {split} text has {sum(sums):,} {unit}, but a block never spans two batches of {GROUP_BATCH_TEXTS} texts "
        f"and the largest batch has {max(sums):,}, fewer than --block_size={block_size}; lower --block_size."
    )


# ---- checking user data ---------------------------------------------------------------------------------

_SNIFF_BYTES = 64 * 1024
_JSON_CHECK_MAX_BYTES = 64 * 1024 * 1024  # a whole JSON document is parsed up to this size
_JSON_LINES_CHECKED = 100  # JSON Lines: the first lines are checked; load_dataset reports the rest


def check_text_file(path: str | os.PathLike, flag: str) -> None:
    """Raise DataError for a data file that load_dataset would choke on with a traceback: an empty file, a
    binary one, one that is not UTF-8, and a .json/.jsonl file that is neither JSON nor JSON Lines."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot read it ({e.strerror or e}).") from None
    if not head.strip():
        raise DataError(f"{flag} {path} is empty{'' if size == 0 else ' (only blank lines)'}; give a file with text.")
    if b"\0" in head:
        raise DataError(f"{flag} {path} is a binary file, not text; give a .txt, .json, .jsonl or .csv text file.")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) == size)
    except UnicodeDecodeError as e:
        raise DataError(f"{flag} {path} is not UTF-8 text (byte {e.start}); convert it to UTF-8.") from None
    if path.suffix.lower() in (".json", ".jsonl"):
        _check_json(path, flag, size)


def _check_json(path: Path, flag: str, size: int) -> None:
    """One JSON document (a list of records, or columns) or JSON Lines (one object per line; first lines only)."""
    if size <= _JSON_CHECK_MAX_BYTES:
        text = path.read_text(encoding="utf-8", errors="replace")  # bytes past the sniffed head: load_dataset
        with contextlib.suppress(json.JSONDecodeError):
            if isinstance(json.loads(text), (list, dict)):
                return
        lines = text.splitlines()
    else:
        with path.open(encoding="utf-8", errors="replace") as f:
            lines = list(islice(f, _JSON_LINES_CHECKED))
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    for number, line in numbered[:_JSON_LINES_CHECKED]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{flag} {path} is neither JSON nor JSON Lines (line {number}: {e.msg}); "
                'give one JSON object per line, e.g. {"text": "..."}.'
            ) from None
        if not isinstance(record, dict):
            raise DataError(
                f"{flag} {path} line {number} is a JSON {type(record).__name__}, not an object; "
                'give one JSON object per line, e.g. {"text": "..."}.'
            )


def find_text_column(raw: DatasetDict | Dataset, name: str | None = None, source: str = "the dataset") -> str:
    """The column holding the text: ``name`` if given, else ``text``; raise DataError naming the columns there
    are (no silent guess: the first column of a CSV is often an id) when a split lacks it or holds no strings in
    it (the tokenizer would fail with a traceback)."""
    wanted = name or "text"
    hint = "pick another with --text_column_name" if name else "name the text column with --text_column_name"
    for split in raw.values() if isinstance(raw, DatasetDict) else [raw]:
        columns = ", ".join(split.column_names)
        if wanted not in split.column_names:
            raise DataError(f"{source} has no column '{wanted}' (its columns: {columns or 'none'}); {hint}.")
        feature = split.features[wanted]
        kind = getattr(feature, "dtype", None) or type(feature).__name__.lower().replace("json", "mixed")
        if kind not in ("string", "large_string"):
            raise DataError(
                f"{source}: column '{wanted}' holds {kind} values, not text; {hint} (its columns: {columns})."
            )
    return wanted
