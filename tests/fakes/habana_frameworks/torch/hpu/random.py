"""TEST DOUBLE of ``habana_frameworks.torch.hpu.random``: the HPU's random generator.

Follows ``hpu/random.py`` of HabanaAI/gaudi-pytorch-bridge: one default generator (device 0 only);
``manual_seed`` takes ``int(seed)``; ``manual_seed_all`` is ``manual_seed``; ``get_rng_state`` /
``set_rng_state`` read and restore its state as a tensor, for the device they name (default "hpu": the current
device, 0), which must be device 0 (RuntimeError "hpu get_rng_state supports only device 0" for hpu:1 or 1, even
where that is the process's own module; ValueError for a device of another type: ``hpu/_utils.py``); ``get_rng_state_all`` is a list of that one state and
``set_rng_state_all`` takes exactly one (transformers' checkpoints of a multi-process run use them). Here the generator is a CPU ``torch.Generator`` (the
simulator's ops draw from torch's CPU generator, so tests also advance it with ``draw``); seeding and state
changes are recorded.

With the simulated device (FAKE_HPU_DEVICE=1) the generator is the device's own (``_device``): random ops on
hpu tensors draw from it and from nothing else, as on a Gaudi.
"""

import torch

import habana_frameworks as _hf
from habana_frameworks import _device

_generator = torch.Generator()


def manual_seed(seed) -> torch.Generator:
    seed = int(seed)
    _hf.record("hpu.random.manual_seed", seed)
    if _device.loaded():
        torch.ops.fake_hpu.manual_seed(seed)
    return _generator.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def initial_seed() -> int:
    return int(torch.ops.fake_hpu.initial_seed()) if _device.loaded() else _generator.initial_seed()


def _only_device_0(device, what: str) -> None:
    from ._utils import _get_device_index

    if _get_device_index(device, optional=True) != 0:
        raise RuntimeError(f"hpu {what} supports only device 0")


def get_rng_state(device="hpu") -> torch.Tensor:
    _only_device_0(device, "get_rng_state")
    _hf.record("hpu.random.get_rng_state")
    return torch.ops.fake_hpu.get_rng_state() if _device.loaded() else _generator.get_state()


def set_rng_state(new_state: torch.Tensor, device="hpu") -> None:
    _only_device_0(device, "set_rng_state")
    _hf.record("hpu.random.set_rng_state")
    if _device.loaded():
        torch.ops.fake_hpu.set_rng_state(new_state)
    else:
        _generator.set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(0)]


def set_rng_state_all(new_states) -> None:
    if len(new_states) != 1:
        raise RuntimeError("hpu set_rng_state_all supports only states len of 1")
    for state in new_states:
        set_rng_state(state, 0)


def draw() -> float:
    """Test helper (not the bridge's): one number from the HPU generator, as a dropout on the device would."""
    return float(torch.rand(1, generator=_generator))
