"""Reductions on the "tpu" backend: every reduce op x dtype, on 2, 3 and 4 ranks.

Each body runs on every rank; each rank rebuilds all ranks' inputs and checks
its own result against :func:`collective_cases.reference_reduce`, returning a
list of mismatches (empty when all is well) so one run reports every failure.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.collective_cases import (
    DTYPES,
    make_input,
    mismatch,
    ops_for,
    reduce_op,
    reference_reduce,
)
from tests.harness import World

SHAPE = (3, 5)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest) -> World:
    with World(request.param, backend="tpu") as w:
        yield w


def _inputs(world_size: int, dtype: torch.dtype, op: str, shape=SHAPE, salt=0) -> list[torch.Tensor]:
    small = op == "PRODUCT"
    return [make_input(r, dtype, shape, salt, small) for r in range(world_size)]


def _all_reduce_matrix(rank: int, world_size: int, async_op: bool) -> list[str]:
    problems = []
    for dtype in DTYPES:
        for op in ops_for(dtype):
            inputs = _inputs(world_size, dtype, op)
            tensor = inputs[rank].clone()
            work = dist.all_reduce(tensor, op=reduce_op(op), async_op=async_op)
            if async_op:
                work.wait()
            bad = mismatch(f"all_reduce {op} {dtype}", tensor, reference_reduce(inputs, op), world_size)
            if bad:
                problems.append(bad)
    return problems


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_reduce_every_op_and_dtype(world: World, async_op: bool) -> None:
    results = world.run(_all_reduce_matrix, async_op, timeout=300)
    assert results == [[]] * world.world_size, results


def _reduce_every_root(rank: int, world_size: int) -> list[str]:
    problems = []
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        for op in ("SUM", "MAX", "PRODUCT"):
            inputs = _inputs(world_size, dtype, op, salt=1)
            for root in range(world_size):
                tensor = inputs[rank].clone()
                dist.reduce(tensor, dst=root, op=reduce_op(op))
                if rank == root:
                    bad = mismatch(f"reduce {op} {dtype} root {root}", tensor,
                                   reference_reduce(inputs, op), world_size)
                elif not torch.equal(tensor, inputs[rank]):
                    bad = f"reduce {op} {dtype} root {root}: non-root input was modified"
                else:
                    bad = None
                if bad:
                    problems.append(bad)
    return problems


def test_reduce_to_every_root(world: World) -> None:
    assert world.run(_reduce_every_root, timeout=300) == [[]] * world.world_size


def _reduce_scatter_matrix(rank: int, world_size: int) -> list[str]:
    problems = []
    chunk = (2, 3)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8,
                  torch.bool, torch.complex64):
        for op in ops_for(dtype):
            full = [make_input(r, dtype, (world_size * chunk[0], chunk[1]), 2, op == "PRODUCT")
                    for r in range(world_size)]
            want = reference_reduce(full, op).chunk(world_size)[rank]
            # reduce_scatter_tensor (FSDP2's path)
            out = torch.empty(chunk, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[rank].clone(), op=reduce_op(op))
            problems.append(mismatch(f"reduce_scatter_tensor {op} {dtype}", out, want, world_size))
            # reduce_scatter with a list of inputs
            out = torch.empty(chunk, dtype=dtype)
            dist.reduce_scatter(out, list(full[rank].clone().chunk(world_size)), op=reduce_op(op))
            problems.append(mismatch(f"reduce_scatter {op} {dtype}", out, want, world_size))
    return [p for p in problems if p]


def test_reduce_scatter_every_op(world: World) -> None:
    assert world.run(_reduce_scatter_matrix, timeout=300) == [[]] * world.world_size


def _coalesced(rank: int, world_size: int) -> list[str]:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _get_default_group

    problems = []
    shapes = [(4,), (2, 3), (5,)]
    ins = [[make_input(r, torch.float32, s, salt=3 + i) for r in range(world_size)]
           for i, s in enumerate(shapes)]
    # all_reduce_coalesced (the c10d entry point)
    tensors = [inp[rank].clone() for inp in ins]
    dist.all_reduce_coalesced(tensors, op=dist.ReduceOp.SUM)
    for i, t in enumerate(tensors):
        problems.append(mismatch(f"all_reduce_coalesced[{i}]", t, reference_reduce(ins[i], "SUM"),
                                 world_size))
    # reduce_scatter_tensor_coalesced, as funcol and DTensor Partial->Shard call it
    full = [[make_input(r, torch.float32, (world_size * 2, 3), salt=9 + i) for r in range(world_size)]
            for i in range(2)]
    group = _get_default_group()
    outs = funcol.reduce_scatter_single_coalesced(
        [f[rank].clone() for f in full], "avg", [0, 0], group
    )
    for i, out in enumerate(outs):
        want = reference_reduce(full[i], "AVG").chunk(world_size)[rank]
        problems.append(mismatch(f"reduce_scatter_single_coalesced[{i}]",
                                 funcol.wait_tensor(out), want, world_size))
    return [p for p in problems if p]


def test_coalesced_reductions(world: World) -> None:
    assert world.run(_coalesced) == [[]] * world.world_size


def _x64_stays_off(rank: int, world_size: int) -> tuple[bool, list[int]]:
    import jax

    t = torch.tensor([2**62 // world_size - rank, -(2**41) * (rank + 1)], dtype=torch.int64)
    dist.all_reduce(t)
    return bool(jax.config.jax_enable_x64), t.tolist()


def test_int64_exact_without_global_x64(world: World) -> None:
    n = world.world_size
    want = [sum(2**62 // n - r for r in range(n)), sum(-(2**41) * (r + 1) for r in range(n))]
    assert world.run(_x64_stays_off) == [(False, want)] * n
