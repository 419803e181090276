"""TEST DOUBLE: which reduce ops and dtypes the bridge's HCCL process group maps, as data, and its checks.

Follows ``backend/helpers/collective_utils.cpp`` (``hcclDataType``, ``hcclOp``, ``getHCCLReduceOp``,
``getHCCLDataType``) and ``distributed/hccl/process_group_hccl_base.cpp`` (which collective checks what, and which
reductions run on a float32 copy: ``is_valid_hccl_dtype``). Self-contained (torch only), so a test can load it by
path to check a census of collectives without loading the simulator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# collective_utils.cpp ``hcclDataType`` (bool travels as uint8); ``getHCCLDataType`` also passes fp8 e5m2 / e4m3fn
# as uint8 ("HCL doesn't have definition for fp8 types"). Any other dtype: "Input tensor data type is not supported
# for HCCL process group: <type>".
DTYPES = frozenset({
    torch.uint8, torch.int8, torch.float64, torch.float32, torch.float16, torch.int32, torch.int64, torch.bfloat16,
    torch.bool, torch.float8_e5m2, torch.float8_e4m3fn,
})  # fmt: skip
# collective_utils.cpp ``hcclOp``: anything else (AVG, PREMUL_SUM, BAND, BOR, BXOR) is "Unsupported ReduceOp for
# HCCL process group"; on bool SUM is MAX, PRODUCT is MIN and AVG "Cannot use ReduceOp.AVG with boolean inputs".
REDUCE_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX"})
# process_group_hccl_base.cpp ``is_valid_hccl_dtype``: all_reduce and reduce run on a float32 copy of any other
# dtype (an int64 sum is a float32 sum); _reduce_scatter_base and alltoall_base keep int32 / int64 too.
NATIVE_REDUCTION_DTYPES = frozenset({torch.bfloat16, torch.float32})
NATIVE_REDUCE_SCATTER_DTYPES = NATIVE_REDUCTION_DTYPES | {torch.int32, torch.int64}
# The collectives that read the tensors' dtype (getHCCLDataType) and those that take a reduce op. broadcast moves
# bytes (getCountDatatype: any dtype, as float32 / bf16 words).
DTYPE_CHECKED = frozenset({
    "allreduce", "allgather", "allgather_into_tensor", "reduce_scatter_tensor", "alltoall_base", "gather", "scatter",
})  # fmt: skip
REDUCING = frozenset({"allreduce", "reduce_scatter_tensor"})


def op_name(op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> str:
    """``SUM``, ``AVG``, ``PREMUL_SUM``, ... of a ReduceOp (a PREMUL_SUM carries its factor: its ``op`` names it)."""
    kind = getattr(op, "op", op)
    if isinstance(kind, dist.ReduceOp.RedOpType):
        return kind.name
    for name, member in dist.ReduceOp.RedOpType.__members__.items():
        if op == member:
            return name
    return str(op)


def check_dtype(dtype: torch.dtype) -> None:
    """``getHCCLDataType``."""
    if dtype not in DTYPES:
        name = str(dtype).removeprefix("torch.")
        raise RuntimeError(f"Input tensor data type is not supported for HCCL process group: {name}")


def check_reduce_op(op: str, dtype: torch.dtype) -> None:
    """``getHCCLReduceOp`` for the dtype the reduction runs in."""
    if dtype == torch.bool and op == "AVG":
        raise RuntimeError("Cannot use ReduceOp.AVG with boolean inputs")
    if op not in REDUCE_OPS:
        raise RuntimeError("Unsupported ReduceOp for HCCL process group")


def reduction_dtype(collective: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the bridge reduces ``dtype`` in: float32 for one it does not reduce natively."""
    native = NATIVE_REDUCE_SCATTER_DTYPES if collective == "reduce_scatter_tensor" else NATIVE_REDUCTION_DTYPES
    return dtype if dtype in native else torch.float32


def problem(collective: str, dtypes: list[str], op: str | None) -> str | None:
    """Why the bridge would refuse a recorded collective (dtype names without ``torch.``), or None."""
    try:
        for name in dtypes:
            dtype = getattr(torch, name)
            if collective in DTYPE_CHECKED:
                check_dtype(dtype)
            if collective in REDUCING and op is not None:
                check_reduce_op(op, reduction_dtype(collective, dtype))
    except RuntimeError as e:
        return str(e)
    return None
