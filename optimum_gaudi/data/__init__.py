"""Offline data for the examples: an embedded text corpus and tokenizer, labelled tasks and ROUGE. Not used by
the library itself; may import errors only."""

from .._legacy_paths import forward_moved_names

__getattr__ = forward_moved_names(__name__, "optimum_gaudi.data.corpus")  # the 0.1 module's names
