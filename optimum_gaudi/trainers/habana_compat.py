"""What optimum-habana scripts import from ``optimum.habana.utils`` and ``optimum.habana.transformers``,
with the same meanings, so a script ported by changing its imports runs. Public as ``optimum_gaudi.utils``
(see _legacy_paths.PUBLIC): a path optimum-habana users expect, with no module of its own at the top of the
package.
"""

from __future__ import annotations

import logging

from transformers import set_seed as _transformers_set_seed

from ..devices import detect_device
from ..features import attention

logger = logging.getLogger(__name__)

__all__ = ["adapt_transformers_to_gaudi", "check_optimum_habana_min_version", "set_seed"]


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed ``random``, NumPy and torch (transformers' ``set_seed``), and the Gaudi's own generator where the
    machine has one (asked of the device, as optimum-habana's ``set_seed`` seeds ``hpu.random``). Like
    optimum-habana's, it loads the Gaudi bridge: call it after building the training arguments."""
    _transformers_set_seed(seed, deterministic=deterministic)
    detect_device().manual_seed(seed)


def check_optimum_habana_min_version(min_version: str) -> None:
    """Accepted and does nothing: optimum-habana's examples call it to require a release of optimum-habana,
    which optimum-gaudi does not need (its own requirements are in setup.py)."""
    del min_version


def adapt_transformers_to_gaudi() -> None:
    """Make ``attn_implementation="gaudi_fused_sdpa"`` loadable by transformers (the attention registry).
    optimum-habana swaps in its own copies of model classes here; optimum-gaudi never does: the Gaudi kernels
    reach transformers' own models through the trainer and the registry, so calling this is optional."""
    attention.register()
