"""``--fp8_recipe``: the delayed-scaling recipe of a Gaudi's Transformer Engine, optimum-habana's by default.

Checked on every device, so a mistake is one line on the laptop that prepares a run, not on the Gaudi.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import UserError

# The delayed-scaling recipe optimum-habana trains with on a Gaudi (its GaudiTERecipeKwargs defaults): the
# scale from the most recent amax alone, recomputed every 16 steps, each card keeping its own amaxes.
GAUDI_RECIPE: dict[str, Any] = {
    "margin": 0,
    "interval": 16,
    "fp8_format": "HYBRID",
    "amax_history_len": 1,
    "amax_compute_algo": "most_recent",
    "reduce_amax": False,
}
_RECIPE_CHOICES = {"fp8_format": ("HYBRID", "E5M2"), "amax_compute_algo": ("most_recent", "max")}
_RECIPE_MINIMUM = {"margin": 0, "interval": 1, "amax_history_len": 1}


def parse_fp8_recipe(value: str | dict | None) -> dict[str, Any]:
    """The delayed-scaling recipe: optimum-habana's, with what ``--fp8_recipe`` (JSON text, a JSON file or a
    dict) changes. A mistake is one line, on every device, so it is caught before the run reaches a Gaudi."""
    if value is None or value == "":
        return dict(GAUDI_RECIPE)
    given = value
    if isinstance(value, str):
        text = value
        if not value.lstrip().startswith("{"):
            if not os.path.isfile(value):
                raise UserError(f"--fp8_recipe {value}: no such file; pass JSON text or a JSON file of recipe keys.")
            with open(value, encoding="utf-8") as f:
                text = f.read()
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--fp8_recipe is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).") from None
    if not isinstance(given, dict):
        raise UserError(f"--fp8_recipe must be a JSON object of recipe keys, got {type(given).__name__}.")
    unknown = sorted(set(given) - set(GAUDI_RECIPE))
    if unknown:
        raise UserError(f"--fp8_recipe: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(GAUDI_RECIPE)}.")
    recipe = {**GAUDI_RECIPE, **given}
    recipe["fp8_format"] = str(recipe["fp8_format"]).upper()
    for key, choices in _RECIPE_CHOICES.items():
        if recipe[key] not in choices:
            raise UserError(f"--fp8_recipe: {key} must be one of {', '.join(choices)}, got {recipe[key]!r}.")
    for key, minimum in _RECIPE_MINIMUM.items():
        if isinstance(recipe[key], bool) or not isinstance(recipe[key], int) or recipe[key] < minimum:
            raise UserError(f"--fp8_recipe: {key} must be an integer >= {minimum}, got {recipe[key]!r}.")
    if not isinstance(recipe["reduce_amax"], bool):
        raise UserError(f"--fp8_recipe: reduce_amax must be true or false, got {recipe['reduce_amax']!r}.")
    return recipe
