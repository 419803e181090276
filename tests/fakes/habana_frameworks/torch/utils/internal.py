"""TEST DOUBLE of ``habana_frameworks.torch.utils.internal``: ``is_lazy`` and ``lazy_only``.

Follows ``python_packages/habana_frameworks/torch/utils/internal.py``: ``is_lazy()`` reads
PT_HPU_LAZY_MODE on its first call and caches the answer for the life of the process, so changing the
variable afterwards changes nothing. The default is the generation's (lazy up to 1.20, eager from 1.21).
``lazy_only(f)`` decides when the decorated function is defined (module import): in eager mode it
returns a function that does nothing, after one warning.
"""

import logging
import os

import habana_frameworks as _hf

logger = logging.getLogger(__name__)


def is_lazy() -> bool:
    if is_lazy._is_lazy is None:
        if _hf.lazy_by_default():
            is_lazy._is_lazy = os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"
        else:
            is_lazy._is_lazy = os.environ.get("PT_HPU_LAZY_MODE", "0") == "1"
    return is_lazy._is_lazy


is_lazy._is_lazy = None


def lazy_only(func):
    if is_lazy():
        return func

    def no_op(*args, **kwargs):
        _hf.record(f"{func.__module__.removeprefix('habana_frameworks.torch.')}.{func.__name__}.noop")

    logger.warning("Calling %s function does not have any effect. It's lazy mode only functionality.", func.__name__)
    return no_op
