"""Adam optimizer states that move between a Gaudi and other devices.

torch's Adam/AdamW count steps per parameter (``state[i]["step"]``, a tensor); the Gaudi bridge's FusedAdamW
counts them per param group (``group["step"]``) and leaves each parameter's ``state["step"]`` at 0
(``hpex/optimizers/FusedAdamW.py``). Loaded as they are, a checkpoint from one into the other restarts the bias
correction at step 1 with warm moments: silently smaller updates for the next thousand steps or so. The
moments themselves mean the same in both, so converting the count is all a resume needs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _to_group_counts(state_dict: dict[str, Any]) -> bool:
    state, changed = state_dict["state"], False
    for group in state_dict["param_groups"]:
        steps = [float(state[i]["step"]) for i in group["params"] if "step" in state.get(i, {})]
        if "step" not in group and steps and max(steps) > 0:
            group["step"] = int(max(steps))
            changed = True
    return changed


def _to_parameter_counts(state_dict: dict[str, Any]) -> bool:
    state, changed = state_dict["state"], False
    for group in state_dict["param_groups"]:
        if "step" not in group:
            continue
        count = group.pop("step")
        for i in group["params"]:
            if i in state and "step" in state[i]:
                state[i]["step"] = torch.tensor(float(count), dtype=torch.float32)
        changed = True
    return changed


def keep_step_counts_on_load(optimizer: torch.optim.Optimizer, counts_per_group: bool) -> None:
    """Convert a loaded state dict's step counts to where ``optimizer`` keeps them (per group: the Gaudi's
    FusedAdamW; per parameter: torch's Adam and AdamW), so a checkpoint resumes on either."""

    def convert(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        converter = _to_group_counts if counts_per_group else _to_parameter_counts
        if converter(state_dict):
            logger.warning(
                "The optimizer state was saved by an AdamW that counts steps %s; its step count was moved to where "
                "%s keeps it. The two place eps differently, so updates differ slightly from the saving run's.",
                "per parameter" if counts_per_group else "per param group",
                type(opt).__name__,
            )
        return state_dict

    optimizer.register_load_state_dict_pre_hook(convert)
