"""ROUGE-1, ROUGE-2 and ROUGE-L F1 (Lin, 2004) for the summarization example, with no download.

`evaluate.load("rouge")` fetches its metric code from the Hub, which an offline machine cannot reach, so
the scores are computed here: lowercased alphanumeric word tokens, no stemming, the F1 of each summary
averaged over the set (x100, as the transformers examples report them).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"[a-z0-9]+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _f1(overlap: int, predicted: int, reference: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _ngram_f1(prediction: list[str], reference: list[str], n: int) -> float:
    predicted = Counter(zip(*(prediction[i:] for i in range(n)), strict=False))
    expected = Counter(zip(*(reference[i:] for i in range(n)), strict=False))
    overlap = sum((predicted & expected).values())
    return _f1(overlap, sum(predicted.values()), sum(expected.values()))


def _lcs_length(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 (0-100) of `predictions` against `references`, pair by pair."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references.")
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for prediction, reference in zip(predictions, references, strict=True):
        p, r = _tokens(prediction), _tokens(reference)
        totals["rouge1"] += _ngram_f1(p, r, 1)
        totals["rouge2"] += _ngram_f1(p, r, 2)
        totals["rougeL"] += _f1(_lcs_length(p, r), len(p), len(r))
    return {name: round(100 * total / max(1, len(predictions)), 4) for name, total in totals.items()}
