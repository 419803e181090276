"""TRL < 1's spellings, still in optimum-habana's TRL scripts, read with their meaning in the installed TRL.

TRL 1 took the data and loss settings out of its trainers' keywords (``SFTTrainer(max_seq_length=...)``,
``DPOTrainer(beta=..., tokenizer=...)``) into their configs, renamed ``max_seq_length`` to ``max_length`` and
dropped a few options. Each such keyword given to a Gaudi TRL trainer moves to its new place with one
deprecation line, as TRL 0.9-0.11 moved them itself; one without a new place is said so in one line.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import types
import typing
from collections.abc import Callable
from typing import Any

from .training_args import GaudiTrainingArguments

logger = logging.getLogger(__name__)

# A trainer keyword with a meaning of its own: handler(trainer class name, args, value, the trainer's keywords).
Handler = Callable[[str, Any, Any, dict[str, Any]], None]


def bare_switches(cls: type) -> type:
    """TRL 1 declares some switches ``bool | None`` (``--bf16``: None means "unless --fp16"), which
    HfArgumentParser makes take a value; TRL < 1, and so optimum-habana's command lines, give them bare
    (``--bf16``), meaning true. The copies of those fields in ``cls`` (never TRL's own) take a bare flag."""
    hints = typing.get_type_hints(cls)
    for name, spec in list(cls.__dataclass_fields__.items()):
        if hints.get(name) == bool | None and spec.default is None and "nargs" not in spec.metadata:
            spec = copy.copy(spec)
            spec.metadata = types.MappingProxyType({**spec.metadata, "nargs": "?", "const": True})
            cls.__dataclass_fields__[name] = spec
    return cls


@functools.cache
def _parameters(cls: type) -> frozenset[str]:
    """The keywords the TRL trainer that ``cls`` builds on takes (its first ``__init__`` naming them)."""
    for klass in cls.__mro__[1:]:
        if "__init__" in vars(klass) and klass.__module__.startswith("trl."):
            return frozenset(inspect.signature(klass.__init__).parameters)
    return frozenset()


def _say(trainer: str, old: str, new: str) -> None:
    logger.warning("%s(%s=...) is TRL < 1's keyword, read as %s; pass that instead.", trainer, old, new)


def _tokenizer(trainer: str, args: Any, value: Any, keywords: dict[str, Any]) -> None:
    """``tokenizer=`` became ``processing_class=`` (transformers 4.46, TRL 0.12)."""
    if keywords.get("processing_class") is not None:
        raise TypeError(f"{trainer}: pass processing_class= only (tokenizer= is its former name), not both.")
    keywords["processing_class"] = value
    _say(trainer, "tokenizer", "processing_class=")


def renamed(old: str, field: str) -> Handler:
    """TRL < 1's keyword ``old``, now the config field ``field``."""

    def move(trainer: str, args: Any, value: Any, keywords: dict[str, Any]) -> None:
        _to_config(trainer, old, args, field, value)

    return move


def _to_config(trainer: str, old: str, args: Any, field: str, value: Any) -> None:
    setattr(args, field, value)
    _say(trainer, old, f"{type(args).__name__}({field}={value!r})")


def dropped(reason: str) -> Handler:
    """A keyword with no place in TRL 1: one line, ``reason`` saying what the run does instead."""

    def drop(trainer: str, args: Any, value: Any, keywords: dict[str, Any]) -> None:
        logger.warning("%s: %s", trainer, reason.format(value=value))

    return drop


def move_keywords(trainer: Any, args: Any, keywords: dict[str, Any], special: dict[str, Handler]) -> None:
    """In place: each keyword of ``keywords`` the TRL trainer no longer takes moves to its new place (``special``
    first, then a field of the TRL config of the same name), with one line; any other keyword (one TRL never
    took) is left for TRL to refuse."""
    name = type(trainer).__name__
    taken = _parameters(type(trainer))
    config_fields = {spec.name for spec in dataclasses.fields(args)} - set(GaudiTrainingArguments.__dataclass_fields__)
    for keyword in [k for k in keywords if k not in taken]:
        if keyword == "tokenizer":
            _tokenizer(name, args, keywords.pop(keyword), keywords)
        elif keyword in special:
            special[keyword](name, args, keywords.pop(keyword), keywords)
        elif keyword in config_fields:
            _to_config(name, keyword, args, keyword, keywords.pop(keyword))
