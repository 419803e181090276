"""TEST DOUBLE of ``habana_frameworks.torch.hpu.random``: the HPU's random generator.

Follows ``hpu/random.py`` of HabanaAI/gaudi-pytorch-bridge: one default generator (device 0 only);
``manual_seed`` takes ``int(seed)``; ``manual_seed_all`` is ``manual_seed``. Here the generator is a
CPU ``torch.Generator`` and each seeding is recorded.
"""

import torch

import habana_frameworks as _hf

_generator = torch.Generator()


def manual_seed(seed) -> torch.Generator:
    seed = int(seed)
    _hf.record("hpu.random.manual_seed", seed)
    return _generator.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def initial_seed() -> int:
    return _generator.initial_seed()
