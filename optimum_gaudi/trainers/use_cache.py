"""transformers 5's ``use_cache`` training argument, kept off the command line so optimum-habana's scripts parse.

optimum-habana's run_clm.py, run_lora_clm.py, run_summarization.py (and five more) declare ``use_cache`` in their
own ModelArguments and put it in one ``HfArgumentParser`` with the training arguments. transformers 5 added a
``use_cache`` field to TrainingArguments, so argparse stops at the second ``--use_cache`` ("conflicting option
strings") before the script starts. HfArgumentParser makes options (and constructor keywords) of ``init`` fields
only, so here the field is declared again with ``init=False``: the script's ``--use_cache`` is the only one.

What transformers 5 users keep: ``GaudiTrainingArguments(use_cache=True)`` (the metaclass takes the keyword and sets
it before ``__post_init__``), ``to_dict()`` listing it, and the Trainer copying it into the model's config. What
they lose: ``--use_cache`` on a command line whose parser has no other dataclass declaring it, and
``dataclasses.replace`` keeps the default. On transformers 4 (no such field) nothing changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainingArguments

TRAINING_ARGUMENTS_HAVE_USE_CACHE = "use_cache" in TrainingArguments.__dataclass_fields__


def _held_back(cls: type) -> bool:
    """Whether ``use_cache`` is a field of ``cls`` kept out of its generated ``__init__`` (not redeclared since)."""
    declared = getattr(cls, "__dataclass_fields__", {}).get("use_cache")
    return declared is not None and not declared.init


class TakesUseCache(type):
    """Accepts ``use_cache=`` in the constructor of a class whose dataclass ``__init__`` leaves it out."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "use_cache" not in kwargs or not _held_back(cls):
            return super().__call__(*args, **kwargs)
        instance = cls.__new__(cls)
        # An init=False field with a plain default is a class attribute that __init__ never assigns, so the
        # value set here is the one __post_init__ (and everything after it) reads.
        instance.use_cache = kwargs.pop("use_cache")
        instance.__init__(*args, **kwargs)
        return instance


@dataclasses.dataclass
class UseCacheOffTheCommandLine(metaclass=TakesUseCache):
    """transformers 5's ``use_cache`` (same default and meaning), minus its ``--use_cache`` option."""

    if TRAINING_ARGUMENTS_HAVE_USE_CACHE:
        use_cache: bool = dataclasses.field(
            default=False,
            init=False,
            metadata={"help": "Copied into the model config by the Trainer; set it in code (not a command-line flag)."},
        )

    def to_dict(self) -> dict[str, Any]:
        """transformers' ``to_dict`` lists ``init`` fields only; ``use_cache`` belongs to the run's settings."""
        settings = super().to_dict()
        if _held_back(type(self)):
            settings["use_cache"] = self.use_cache
        return settings
