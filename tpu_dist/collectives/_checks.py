"""Input validation for "tpu" collectives: every check runs before anything is sent.

Each function raises ``ValueError`` or ``TypeError`` naming the op, the values
given and what would be accepted; nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

_FLOAT_OPS = frozenset({"SUM", "AVG", "PREMUL_SUM", "PRODUCT", "MIN", "MAX"})
_COMPLEX_OPS = frozenset({"SUM", "AVG", "PREMUL_SUM"})
_INT_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"})


_OP_NAMES: dict[object, str] = {
    kind: name for name, kind in dist.ReduceOp.RedOpType.__members__.items()
}
"""Every reduce op type -> its name, built once (``str()`` of the enum costs ~3 us a call)."""


def reduce_op_name(op: dist.ReduceOp) -> str:
    """The name ("SUM", "AVG", ...) of a ReduceOp or its RedOpType."""
    kind = getattr(op, "op", op)
    name = _OP_NAMES.get(kind)
    return name if name is not None else str(kind).rsplit(".", 1)[-1]


def ops_for_dtype(dtype: torch.dtype) -> frozenset[str]:
    """The reduce ops the "tpu" backend defines for ``dtype``."""
    if dtype.is_complex:
        return _COMPLEX_OPS
    if dtype.is_floating_point:
        return _FLOAT_OPS
    return _INT_OPS


def check_reduce_op(op_name: str, reduce_op: str, dtype: torch.dtype) -> None:
    """Raise TypeError if ``reduce_op`` is not defined for ``dtype``."""
    allowed = ops_for_dtype(dtype)
    if reduce_op not in allowed:
        hint = ""
        if reduce_op == "AVG":
            hint = " For integer tensors, all_reduce with SUM and divide afterwards."
        elif reduce_op in ("BAND", "BOR", "BXOR"):
            hint = " Bitwise ops need an integer or bool tensor."
        raise TypeError(
            f"{op_name}: ReduceOp.{reduce_op} is not supported for dtype {dtype} on the "
            f"'tpu' backend; supported for this dtype: {', '.join(sorted(allowed))}.{hint}"
        )


def check_tensor(op_name: str, tensor: object, what: str = "tensor") -> torch.Tensor:
    """Check that ``tensor`` is a dense CPU tensor of a supported dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op_name}: {what} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.device.type != "cpu" and not _is_fake(tensor):
        raise ValueError(
            f"{op_name}: {what} is on device {tensor.device}, but the 'tpu' backend "
            "takes CPU tensors (it moves them to its JAX devices itself). Pass "
            "tensor.cpu()."
        )
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{op_name}: {what} has layout {tensor.layout}; the 'tpu' backend takes dense "
            "(strided) tensors. Use tensor.to_dense()."
        )
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"{op_name}: dtype {tensor.dtype} of {what} is not supported by the 'tpu' "
            f"backend; supported: {names}."
        )
    return tensor


def _is_fake(tensor: torch.Tensor) -> bool:
    """A fake tensor (shape and dtype, no data: compile-only mode's) may be on any device the
    group takes (its pipeline's ``tensor_device_types``, :mod:`._delegate`): nothing moves."""
    return isinstance(tensor, FakeTensor)


def shares_memory_within(tensor: torch.Tensor) -> bool:
    """True if elements of ``tensor`` share memory (a stride-0 dim, as ``expand`` makes)."""
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def check_output(op_name: str, tensor: torch.Tensor, what: str) -> None:
    """Check that ``tensor`` can hold an output: no two of its elements share memory.

    In-place ops (all_reduce, broadcast, reduce) take such a tensor, as gloo does: the
    elements that share memory hold the same value. An output that only receives
    (all_gather, scatter, ...) would need different values in one place.
    """
    if shares_memory_within(tensor):
        raise ValueError(
            f"{op_name}: {what} (shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}) "
            "has elements that share memory (a stride-0 dim, e.g. from expand()), so it "
            "cannot receive different values; pass a tensor of its own, e.g. "
            "torch.empty_like(t) or t.clone()."
        )


def check_single(op_name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Check that exactly one tensor is given (as c10d passes ``[tensor]``)."""
    if len(tensors) != 1:
        raise ValueError(
            f"{op_name}: the 'tpu' backend takes one tensor per call, got {len(tensors)}; "
            "call it once per tensor or use the *_coalesced variant."
        )
    return check_tensor(op_name, tensors[0])


def check_same(op_name: str, reference: torch.Tensor, other: torch.Tensor, what: str) -> None:
    """Check that ``other`` has the dtype of ``reference``."""
    if other.dtype != reference.dtype:
        raise TypeError(
            f"{op_name}: {what} has dtype {other.dtype}, expected {reference.dtype} "
            f"(the input's dtype); pass a {reference.dtype} tensor, e.g. t.to({reference.dtype})."
        )


def check_numel(op_name: str, tensor: torch.Tensor, expected: int, what: str) -> None:
    """Check that ``tensor`` holds ``expected`` elements."""
    if tensor.numel() != expected:
        raise ValueError(
            f"{op_name}: {what} has {tensor.numel()} elements (shape "
            f"{tuple(tensor.shape)}), expected {expected}; pass a tensor of {expected} elements."
        )


def check_list(op_name: str, tensors: Sequence[torch.Tensor], size: int, what: str) -> None:
    """Check that a per-rank tensor list has one entry per group rank."""
    if len(tensors) != size:
        raise ValueError(
            f"{op_name}: {what} has {len(tensors)} tensors, expected one per rank of "
            f"the group (group size {size}); pass a list of {size} tensors."
        )


def check_rank(op_name: str, rank: int, size: int, what: str) -> None:
    """Check that ``rank`` is a valid group rank."""
    if not 0 <= rank < size:
        raise ValueError(
            f"{op_name}: {what} {rank} is not a rank of this group (group ranks are "
            f"0..{size - 1}); pass a rank of the group (torch.distributed's functions take "
            "global ranks and translate them)."
        )


def check_timeout(op_name: str, timeout: object) -> timedelta:
    """Check that ``timeout`` is a positive ``datetime.timedelta``; returns it."""
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"{op_name}: timeout must be a datetime.timedelta, got "
            f"{type(timeout).__name__} ({timeout!r})"
        )
    if timeout <= timedelta(0):
        raise ValueError(f"{op_name}: timeout must be positive, got {timeout}")
    return timeout


def check_splits(
    op_name: str, splits: Sequence[int], size: int, rows: int, what: str
) -> list[int]:
    """Check all_to_all split sizes; empty means equal splits. Returns the splits."""
    if not splits:
        if rows % size:
            raise ValueError(
                f"{op_name}: {what} has {rows} rows in dim 0, which does not split "
                f"evenly over {size} ranks; pass explicit split sizes."
            )
        return [rows // size] * size
    splits = [int(s) for s in splits]
    if len(splits) != size:
        raise ValueError(
            f"{op_name}: {what} split sizes {splits} have {len(splits)} entries, "
            f"expected one per rank (group size {size}); pass {size} split sizes."
        )
    if any(s < 0 for s in splits):
        raise ValueError(
            f"{op_name}: {what} split sizes {splits} contain a negative size; every split "
            "size must be 0 or more."
        )
    if sum(splits) != rows:
        raise ValueError(
            f"{op_name}: {what} split sizes {splits} sum to {sum(splits)}, but dim 0 "
            f"of the tensor has {rows} rows; the split sizes must add up to {rows}."
        )
    return splits
