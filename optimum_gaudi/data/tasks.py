"""Labelled tasks that need no download, built from the same real text as the default corpus.

The examples beyond causal LM need labels: a class per text (run_glue.py), a summary per document
(run_summarization.py), a mask token (run_mlm.py). All come from the CPython standard library's docstrings
(see :mod:`optimum_gaudi.data`), so every example runs offline on real English prose:

- topic classification: a docstring, labelled by the area of the standard library it documents;
- summarization: a docstring's body, summarized by its own first line (the summary line PEP 257 asks for).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import sysconfig
from pathlib import Path

from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from transformers import PreTrainedTokenizerFast

from .corpus import (
    _FORMAT_VERSION,
    _MIN_DOC_CHARS,
    _SKIP_DIRS,
    _atomic_write,
    _docstrings,
    cache_dir,
    default_corpus_texts,
    default_tokenizer,
)

logger = logging.getLogger(__name__)

# Areas of the standard library (as its reference manual groups them) -> the top-level modules and packages
# whose docstrings are labelled with that area. Areas were chosen to have hundreds of docstrings each.
STDLIB_AREAS: dict[str, tuple[str, ...]] = {
    "concurrency": ("asyncio", "multiprocessing", "threading", "concurrent", "queue", "sched", "subprocess"),
    "email": ("email", "mailbox", "smtplib", "imaplib", "poplib", "nntplib", "mimetypes", "quopri"),
    "gui": ("tkinter", "turtle", "turtledemo"),
    "imports": ("importlib", "distutils", "pkgutil", "zipimport", "runpy", "modulefinder", "ensurepip", "venv"),
    "networking": ("http", "urllib", "wsgiref", "xmlrpc", "ftplib", "socketserver", "ssl", "socket", "webbrowser"),
    "testing": ("unittest", "doctest", "pdb", "bdb", "trace", "cProfile", "profile", "pstats", "timeit"),
    "xml": ("xml", "html", "plistlib"),
}
_MODULE_AREA = {module: area for area, modules in STDLIB_AREAS.items() for module in modules}


def _stdlib_docstrings_by_module() -> list[tuple[str, str]]:
    """(top-level module, docstring) for every docstring of the areas above, in a deterministic order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    version = f"{sys.implementation.name}{'.'.join(map(str, sys.version_info[:3]))}"
    key = hashlib.sha256(f"{_FORMAT_VERSION}:{version}:{stdlib}:{sorted(_MODULE_AREA)}".encode()).hexdigest()[:12]
    path = cache_dir() / f"stdlib-topics-{version}-{key}.json"
    if path.is_file():
        try:
            return [tuple(pair) for pair in json.loads(path.read_text(encoding="utf-8"))]
        except (OSError, ValueError):
            logger.warning("Ignoring unreadable task cache %s.", path)
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    for file in sorted(stdlib.rglob("*.py")):
        parts = file.relative_to(stdlib).parts
        module = parts[0].removesuffix(".py")
        if module not in _MODULE_AREA or _SKIP_DIRS.intersection(parts[:-1]):
            continue
        for doc in _docstrings(file):
            if len(doc) >= _MIN_DOC_CHARS and doc not in seen:  # a duplicate would leak across the split
                seen.add(doc)
                pairs.append((module, doc))
    if not pairs:
        raise RuntimeError(f"No docstrings found under {stdlib}; pass --train_file or --dataset_name instead.")
    _atomic_write(path, json.dumps(pairs, ensure_ascii=False))
    return pairs


def _seeded_split(n: int, validation_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be between 0 and 1, got {validation_fraction}.")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(n * validation_fraction))
    return order[n_val:], order[:n_val]  # shuffled: --max_eval_samples takes a fair sample of the areas


def stdlib_topic_datasets(validation_fraction: float = 0.15, seed: int = 42) -> DatasetDict:
    """Docstrings labelled by their area of the standard library (:data:`STDLIB_AREAS`): columns
    ``text`` and ``label`` (a ``ClassLabel`` naming the areas), split into train and validation by a
    seeded shuffle, the same on every machine with the same Python."""
    pairs = _stdlib_docstrings_by_module()
    names = sorted(STDLIB_AREAS)
    features = Features({"text": Value("string"), "label": ClassLabel(names=names)})
    train, val = _seeded_split(len(pairs), validation_fraction, seed)

    def subset(indices: list[int]) -> Dataset:
        rows = [pairs[i] for i in indices]
        return Dataset.from_dict(
            {"text": [doc for _, doc in rows], "label": [names.index(_MODULE_AREA[m]) for m, _ in rows]},
            features=features,
        )

    return DatasetDict(train=subset(train), validation=subset(val))


_MIN_SUMMARY_CHARS = 10
_MIN_BODY_CHARS = 80


def _summary_pair(doc: str) -> tuple[str, str] | None:
    """(body, first line) of a docstring written as PEP 257 asks: a summary line, a blank line, a body."""
    first, sep, body = doc.partition("\n\n")
    first, body = first.strip(), body.strip("\n").rstrip()
    if not sep or "\n" in first or len(first) < _MIN_SUMMARY_CHARS or len(body) < _MIN_BODY_CHARS:
        return None
    return body, first


def docstring_summary_datasets(validation_fraction: float = 0.05, seed: int = 42) -> DatasetDict:
    """Summarization pairs from the default corpus: ``document`` is a docstring's body and ``summary`` its
    one-line summary; only docstrings with a single summary line, a blank line and a body are used."""
    pairs = [pair for pair in map(_summary_pair, default_corpus_texts()) if pair is not None]
    train, val = _seeded_split(len(pairs), validation_fraction, seed)

    def subset(indices: list[int]) -> Dataset:
        return Dataset.from_dict(
            {"document": [pairs[i][0] for i in indices], "summary": [pairs[i][1] for i in indices]}
        )

    return DatasetDict(train=subset(train), validation=subset(val))


MASK_TOKEN = "<mask>"


def default_mlm_tokenizer(vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """The default byte-level BPE (:func:`optimum_gaudi.data.default_tokenizer`) plus a ``<mask>`` token, as
    RoBERTa's tokenizer has, for masked-LM pre-training from scratch."""
    tokenizer = default_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    return tokenizer


SUMMARIZE = "Summarize this documentation in one line."


def instruction_datasets(validation_fraction: float = 0.05, seed: int = 42) -> DatasetDict:
    """Instruction-tuning rows in the Alpaca layout (``instruction``, ``input``, ``output``) from the
    summarization pairs: the instruction asks for a docstring's one-line summary and the output is that line.
    Every other row carries the docstring in ``input``; the rest put it in the instruction and leave ``input``
    empty, so both of the Alpaca prompt's forms occur."""
    pairs = docstring_summary_datasets(validation_fraction, seed)

    def rows(split: Dataset) -> Dataset:
        columns: dict[str, list[str]] = {"instruction": [], "input": [], "output": []}
        for i, (body, summary) in enumerate(zip(split["document"], split["summary"], strict=True)):
            with_input = i % 2 == 0
            columns["instruction"].append(SUMMARIZE if with_input else f"{SUMMARIZE}\n\n{body}")
            columns["input"].append(body if with_input else "")
            columns["output"].append(summary)
        return Dataset.from_dict(columns)

    return DatasetDict({name: rows(split) for name, split in pairs.items()})
