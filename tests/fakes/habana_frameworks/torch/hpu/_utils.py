"""TEST DOUBLE of ``habana_frameworks.torch.hpu._utils``: device indices and the process's module.

Follows ``hpu/_utils.py``: ``_get_device_index`` takes an int as it is, a str or torch.device of type hpu by its
index (no index: the current device, when ``optional``), refuses other device types (ValueError; cpu only with
``allow_cpu``, as -1); the process's module is HLS_MODULE_ID (-1 when unset or empty); the machine's modules are
HABANA_VISIBLE_MODULES (default 0-7, at most 8).
"""

import os

import torch

HABANA_VISIBLE_MODULES_VAR = "HABANA_VISIBLE_MODULES"
HLS_MODULE_ID_VAR = "HLS_MODULE_ID"


def _get_device_index(device, optional: bool = False, allow_cpu: bool = False) -> int:
    if isinstance(device, str):
        device = torch.device(device)
    index = None
    if isinstance(device, torch.device):
        if allow_cpu:
            if device.type not in ("hpu", "cpu"):
                raise ValueError(f"Expected a hpu or cpu device, but got: {device}")
        elif device.type != "hpu":
            raise ValueError(f"Expected a hpu device, but got: {device}")
        index = -1 if device.type == "cpu" else device.index
    if isinstance(device, int):
        index = device
    if index is None:
        if not optional:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        from . import _current_device

        index = _current_device()  # hpu.current_device(), unrecorded: the log holds the project's own calls
    return index


def _get_module_id_from_environ() -> int:
    value = os.getenv(HLS_MODULE_ID_VAR, -1)
    return int(value) if value else -1


def _get_available_modules_from_environ() -> list[int]:
    text = os.getenv(HABANA_VISIBLE_MODULES_VAR, default="0,1,2,3,4,5,6,7")
    modules = [int(x) for x in text.split(",")]  # set but empty: int('') fails, as in the bridge
    assert 0 < len(modules) <= 8, f"{HABANA_VISIBLE_MODULES_VAR} does not have valid value."
    return modules
