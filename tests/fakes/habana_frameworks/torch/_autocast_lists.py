"""TEST DOUBLE of the bridge's autocast op lists (C++ in the real bridge, no Python module).

Follows ``hpu_ops/autocast_helpers.h`` and ``hpu_ops/backend/autocast_helpers.cpp`` (release 1.19): when
the plugin loads, the bf16 ("lower precision") and fp32 lists are read once, each from the file named by
PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST / PT_HPU_AUTOCAST_FP32_OPS_LIST (one op per line, taken verbatim),
else the built-in default list; a file that cannot be opened also means the default list (with a
warning). An op in both lists runs in bf16 (the lower list is checked first). The simulator keeps its own
copy of the defaults so that it checks, not repeats, the project's.
"""

import logging
import os

logger = logging.getLogger(__name__)

DEFAULT_LOWER = frozenset(
    "addmm addbmm batch_norm baddbmm bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d "
    "conv_transpose3d dot dropout feature_dropout group_norm instance_norm layer_norm leaky_relu linear "
    "matmul mean mm mul mv softmax log_softmax scaled_dot_product_attention".split()
)
DEFAULT_FP32 = frozenset(
    "acos addcdiv asin atan2 bilinear binary_cross_entropy binary_cross_entropy_with_logits cdist cosh "
    "cosine_embedding_loss cosine_similarity cross_entropy_loss dist div divide embedding embedding_bag "
    "erfinv exp expm1 hinge_embedding_loss huber_loss kl_div l1_loss log log10 log1p log2 logsumexp "
    "margin_ranking_loss mse_loss multi_margin_loss multilabel_margin_loss nll_loss pdist poisson_nll_loss "
    "pow reciprocal renorm rsqrt sinh smooth_l1_loss soft_margin_loss softplus tan topk triplet_margin_loss "
    "truediv true_divide".split()
)


def _load(variable, default):
    path = os.environ.get(variable)
    if path is None:
        return default
    try:
        with open(path) as f:
            return frozenset(f.read().splitlines())
    except OSError:
        logger.warning("Failed to open file with ops to autocast: %s. Default list loaded.", path)
        return default


def load():
    """(bf16 ops, fp32 ops) as the loading plugin reads them."""
    return (
        _load("PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST", DEFAULT_LOWER),
        _load("PT_HPU_AUTOCAST_FP32_OPS_LIST", DEFAULT_FP32),
    )
