"""Inputs and independent references for collective tests.

Every rank can rebuild every other rank's input (:func:`make_input` is seeded
by rank, dtype and a salt), so each rank computes the expected result of a
collective on its own with plain torch arithmetic in float64/int64, never
through the backend under test.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

DTYPES: tuple[torch.dtype, ...] = (
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

FLOAT_OPS = ("SUM", "AVG", "PREMUL_SUM", "PRODUCT", "MIN", "MAX")
COMPLEX_OPS = ("SUM", "AVG", "PREMUL_SUM")
INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")

PREMUL_FACTOR = 0.25


def ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The reduce ops the "tpu" backend defines for ``dtype`` (the tested matrix)."""
    if dtype.is_complex:
        return COMPLEX_OPS
    if dtype.is_floating_point:
        return FLOAT_OPS
    return INT_OPS


def reduce_op(name: str) -> dist.ReduceOp:
    """The torch ReduceOp for a name; PREMUL_SUM carries :data:`PREMUL_FACTOR`."""
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name)


def make_input(
    rank: int, dtype: torch.dtype, shape: tuple[int, ...], salt: int = 0, small: bool = False
) -> torch.Tensor:
    """Rank ``rank``'s deterministic input. ``small`` keeps values near 1 (for PRODUCT).

    int64 values exceed 32 bits, so a backend that truncates to int32 fails.
    """
    seed = 7919 * salt + 131 * rank + DTYPES.index(dtype) + 1
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        values = torch.randn(shape, generator=gen, dtype=torch.complex128)
        return (values * (0.5 if small else 3.0)).to(dtype)
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=gen, dtype=torch.float64)
        if small:
            values = 1.0 + 0.25 * values
        return (values * (1.0 if small else 4.0)).to(dtype)
    if small:
        low, high = (1, 4) if dtype == torch.uint8 else (-3, 4)
        return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(dtype)
    info = torch.iinfo(dtype)
    if dtype == torch.int64:
        base = torch.randint(-(2**20), 2**20, shape, generator=gen, dtype=torch.int64)
        return base + (rank + 1) * (2**40 + 3)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def reference_reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of ``inputs`` (one per rank) by ``op``, in wide arithmetic."""
    dtype = inputs[0].dtype
    stacked = torch.stack(inputs)
    if dtype == torch.bool:
        if op in ("SUM", "MAX", "BOR"):
            return stacked.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stacked.all(0)
        return functools.reduce(torch.logical_xor, inputs)
    if op in ("BAND", "BOR", "BXOR"):
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        return functools.reduce(fn, inputs)
    if op in ("MIN", "MAX"):
        return stacked.amin(0) if op == "MIN" else stacked.amax(0)
    wide = torch.complex128 if dtype.is_complex else (
        torch.float64 if dtype.is_floating_point else torch.int64
    )
    x = stacked.to(wide)
    if op == "SUM":
        out = x.sum(0)
    elif op == "AVG":
        out = x.sum(0) / len(inputs)
    elif op == "PREMUL_SUM":
        out = (x * PREMUL_FACTOR).sum(0)
    elif op == "PRODUCT":
        out = x.prod(0)
    else:
        raise ValueError(f"no reference for {op}")
    return out.to(dtype)


def tolerance(dtype: torch.dtype, world_size: int) -> tuple[float, float]:
    """(rtol, atol) for a reduction of ``world_size`` inputs made by :func:`make_input`.

    Exact for integers and bool. Floats: the backend may sum in another order
    and, for 16-bit types, round each partial sum (bf16 has 8 mantissa bits).
    """
    if not (dtype.is_floating_point or dtype.is_complex):
        return (0.0, 0.0)
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return (2 * world_size * eps, 4 * world_size * eps * 4)
    eps = torch.finfo(torch.float32 if dtype in (torch.float32, torch.complex64) else torch.float64).eps
    return (16 * world_size * eps, 64 * world_size * eps)


def mismatch(name: str, got: torch.Tensor, want: torch.Tensor, world_size: int) -> str | None:
    """A description of how ``got`` differs from ``want``, or None when they agree."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    rtol, atol = tolerance(want.dtype, world_size)
    if rtol == 0.0:
        ok = torch.equal(got, want)
    else:
        wide = torch.complex128 if want.dtype.is_complex else torch.float64
        ok = torch.allclose(got.to(wide), want.to(wide), rtol=rtol, atol=atol)
    if ok:
        return None
    return f"{name}: got {got.flatten()[:6].tolist()}, want {want.flatten()[:6].tolist()}"


def all_reduce_from_threads(
    threads: list[list], rank: int, sizes: tuple[int, ...], iters: int
) -> list[int]:
    """Threads all-reduce at once: thread ``w`` ``iters`` times, call ``i`` on the group
    ``threads[w][i % len(threads[w])]`` (skipped where this rank is not a member), ``sizes[w]``
    elements, values that differ per thread, call and rank; returns the wrong results of each
    thread (a result is right when it is the sum over the group's ranks). A thread's error is
    raised."""
    wrong = [0] * len(threads)
    errors: list[BaseException] = []

    def loop(which: int) -> None:
        try:
            base = 1000.0 * (which + 1)
            for i in range(iters):
                group = threads[which][i % len(threads[which])]
                ranks = dist.get_process_group_ranks(group)
                if rank not in ranks:
                    continue
                x = torch.full((sizes[which],), base + i + rank)
                dist.all_reduce(x, group=group)
                expected = sum(base + i + r for r in ranks)
                if not torch.equal(x, torch.full_like(x, expected)):
                    wrong[which] += 1
        except BaseException as err:  # reported below
            errors.append(err)

    workers = [threading.Thread(target=loop, args=(w,)) for w in range(len(threads))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return wrong
