"""TEST DOUBLE of ``habana_frameworks.torch.utils.experimental``: the card's generation, as DeepSpeed's HPU
accelerator asks for it (``deepspeed/accelerator/hpu_accelerator.py``: ``is_fp16_supported``, from ZeRO-3's
partitioning on).

Follows ``python_packages/habana_frameworks/torch/utils/experimental/__init__.py``: ``_get_device_type`` returns
the ``synDeviceType`` of the card (``csrc/bindings.cpp`` exposes Synapse's enum, whose numbers come from
Synapse's closed headers: here only the names are kept), and fp16 is supported on every generation but the first
Gaudi. The generation is the simulator's ``FAKE_HPU_DEVICE_NAME`` (see ``hpu.get_device_name``).
"""

import enum
import os

import habana_frameworks as _hf


class synDeviceType(enum.Enum):  # noqa: N801 (the bridge's name)
    synDeviceGaudi = enum.auto()
    synDeviceGaudi2 = enum.auto()
    synDeviceGaudi3 = enum.auto()


_BY_NAME = {
    "GAUDI": synDeviceType.synDeviceGaudi,
    "GAUDI2": synDeviceType.synDeviceGaudi2,
    "GAUDI3": synDeviceType.synDeviceGaudi3,
}


def _get_device_type() -> synDeviceType:
    _hf.record("utils.experimental._get_device_type")
    return _BY_NAME[os.environ.get("FAKE_HPU_DEVICE_NAME", "GAUDI2")]


def _is_fp16_supported() -> bool:
    return _get_device_type() != synDeviceType.synDeviceGaudi
