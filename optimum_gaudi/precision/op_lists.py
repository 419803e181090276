"""Autocast operator lists: one vocabulary (the bridge's aten op names) and one meaning on every device.

A Gaudi config names ops as Habana's bridge does (``linear``, ``cross_entropy_loss``, ...). A list left out
does not mean "no op": it means Habana's default list, which is what the bridge uses when its variable is
unset. So :func:`resolve_op_lists` fills a left-out list with Habana's default, minus the ops the config puts
in the other list (the config's word wins over a default), and the trainer hands the same two lists to
every device: the bridge on a Gaudi, the op-list autocast on CPU and CUDA.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import UserError

logger = logging.getLogger(__name__)

# Habana's default lists, as data: ``default_lower_ops`` and ``default_fp32_ops`` of
# HabanaAI/gaudi-pytorch-bridge ``hpu_ops/autocast_helpers.h`` (release 1.19.0).
HABANA_DEFAULT_BF16_OPS: tuple[str, ...] = tuple(
    "addmm addbmm batch_norm baddbmm bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d "
    "dot dropout feature_dropout group_norm instance_norm layer_norm leaky_relu linear matmul mean mm mul mv "
    "softmax log_softmax scaled_dot_product_attention".split()
)
HABANA_DEFAULT_FP32_OPS: tuple[str, ...] = tuple(
    "acos addcdiv asin atan2 bilinear binary_cross_entropy binary_cross_entropy_with_logits cdist cosh "
    "cosine_embedding_loss cosine_similarity cross_entropy_loss dist div divide embedding embedding_bag erfinv "
    "exp expm1 hinge_embedding_loss huber_loss kl_div l1_loss log log10 log1p log2 logsumexp margin_ranking_loss "
    "mse_loss multi_margin_loss multilabel_margin_loss nll_loss pdist poisson_nll_loss pow reciprocal renorm "
    "rsqrt sinh smooth_l1_loss soft_margin_loss softplus tan topk triplet_margin_loss truediv true_divide".split()
)

# What the bridge's code generator leaves out of the aten functions it registers for HPU autocast, besides in-place
# (``name_``), out= (``name_out``), CUDA / cuDNN and backward functions: HabanaAI/gaudi-pytorch-bridge
# ``scripts/gen_op.py``, ``generate_autocast_ops`` (release 1.19.0), its blocklist.
_GENERATOR_BLOCKLIST = frozenset(
    "_cummax_helper _cummin_helper fused_moving_avg_obs_fake_quant _fused_moving_avg_obs_fq_helper "
    "_native_batch_norm_legit sym_numel sym_storage_offset _scaled_dot_product_flash_attention "
    "_efficient_attention_forward _batch_norm_with_update _scaled_dot_product_fused_attention_overrideable".split()
)


def _generator_skips(name: str) -> bool:
    return (
        name.endswith(("_out", "_"))
        or any(part in name for part in ("cuda", "cudn", "backward"))
        or name in _GENERATOR_BLOCKLIST
    )


@functools.cache
def known_ops() -> frozenset[str] | None:
    """Every name an op list may use: the aten functions of the running torch that the bridge registers for
    autocast, and the names of Habana's default lists. The bridge's generator registers the functions of the
    torch it is built for, which is the torch it runs with (it asserts the version when it loads); CPU and CUDA
    cast any aten op of this torch. None when this torch cannot list its ops (then no name is questioned).

    Computed on first use: the launcher checks op lists without importing torch."""
    import torch

    list_ops = getattr(torch._C, "_dispatch_get_all_op_names", None)
    if list_ops is None:
        return None
    functions = {op.split("::", 1)[1].split(".", 1)[0] for op in list_ops() if op.startswith("aten::")}
    registered = {name for name in functions if not _generator_skips(name)}
    return frozenset(registered | set(HABANA_DEFAULT_BF16_OPS) | set(HABANA_DEFAULT_FP32_OPS))


def __getattr__(name: str):
    if name == "KNOWN_OPS":  # the vocabulary, as a constant for readers; built from torch on first access
        return known_ops() or frozenset()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_warned: set[str] = set()


def closest_op(name: str) -> str | None:
    """The known op name nearest to `name` (for "did you mean"), or None when nothing is close."""
    close = difflib.get_close_matches(name, known_ops() or (), n=1, cutoff=0.6)
    return close[0] if close else None


def _warn_unknown(ops: Sequence[str]) -> None:
    unchecked = [name for name in ops if name not in _warned]
    if not unchecked:
        return
    known = known_ops()
    if known is None:
        return
    for name in unchecked:
        if name in known:
            continue
        _warned.add(name)
        close = closest_op(name)
        hint = f"did you mean '{close}'?" if close else "see optimum_gaudi.precision.op_lists.known_ops()"
        logger.warning(
            "Autocast op '%s' is neither an aten op of this torch nor in Habana's default lists, so it casts nothing "
            "on any device; %s",
            name,
            hint,
        )


def resolve_op_lists(
    bf16_ops: Sequence[str] | None, fp32_ops: Sequence[str] | None, check_names: bool = True
) -> tuple[list[str], list[str]]:
    """The (bf16, fp32) lists a config means: a list left out (None) is Habana's default list without the
    ops of the other list. Unknown names are kept (they are harmless) and, with ``check_names``, warned about
    once per process (checking imports torch)."""
    if check_names:
        _warn_unknown([*(bf16_ops or ()), *(fp32_ops or ())])
    bf16 = list(bf16_ops) if bf16_ops is not None else None
    fp32 = list(fp32_ops) if fp32_ops is not None else None
    if bf16 is None:
        bf16 = [op for op in HABANA_DEFAULT_BF16_OPS if op not in set(fp32 or ())]
    if fp32 is None:
        fp32 = [op for op in HABANA_DEFAULT_FP32_OPS if op not in set(bf16)]
    return bf16, fp32


# ---- reaching the bridge -------------------------------------------------------------------------------------

BF16_LIST_ENV = "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"
FP32_LIST_ENV = "PT_HPU_AUTOCAST_FP32_OPS_LIST"


def op_list_dir() -> Path:
    """This user's directory for op-list files, which the bridge reads as its autocast lists: only this user
    may write it. A shared name in the temp directory could be created first by another user, who would then
    choose what this user's runs autocast; such a directory is refused in one line."""
    path = Path(tempfile.gettempdir()) / f"optimum-gaudi-op-lists-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if path.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise UserError(
            f"{path} (the op-list files the Habana bridge reads) is not a directory only you can write; "
            "remove it, or set TMPDIR to a private directory."
        )
    return path


def _list_file(ops: Sequence[str]) -> str:
    """A file with one op per line, as the bridge reads it; named by content so runs reuse it, and rewritten
    when what is there is not that content."""
    text = "".join(f"{op}\n" for op in ops)
    path = op_list_dir() / f"{hashlib.sha1(text.encode()).hexdigest()[:16]}.txt"
    try:
        current = path.read_text()
    except OSError:
        current = None
    if current != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path)


def op_list_environment(bf16_ops: Sequence[str], fp32_ops: Sequence[str]) -> dict[str, str]:
    """The bridge's two op-list variables naming files that hold these (resolved) lists."""
    return {BF16_LIST_ENV: _list_file(bf16_ops), FP32_LIST_ENV: _list_file(fp32_ops)}


# The op-list files' contents by path, for ranks on other nodes, whose /tmp lacks them (the MPI worker writes them)
LIST_FILES_ENV = "OPTIMUM_GAUDI_OP_LIST_FILES"


def config_uses_op_lists(config) -> bool:
    """Whether a GaudiConfig's autocast runs on op lists (then both lists must reach the bridge)."""
    return bool(
        config.use_torch_autocast or config.autocast_bf16_ops is not None or config.autocast_fp32_ops is not None
    )
