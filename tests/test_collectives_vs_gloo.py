"""The same program on "tpu" and on "gloo" gives the same results (3 ranks, odd on purpose).

The body runs a mix of collectives a training step uses and returns every
output; the two backends' outputs are compared rank by rank, bit for bit: float
sums too (all_reduce, reduce_scatter_tensor), in float32, float64 and bfloat16, small and
above the 256 KiB where the CPU programs change algorithm, and at sizes where gloo's ring
chunks do not line up with a rank's part (``_lowering.gloo_chunk``). Only float products
are compared to round-off (tpu_dist multiplies in rank order, gloo's ring in its own).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.collective_cases import make_input
from tests.harness import World
from tpu_dist.collectives import _plan_all_to_all


def _program(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for op in ("SUM", "MAX", "MIN", "PRODUCT"):
        t = make_input(rank, torch.float32, (17,), salt=70, small=op == "PRODUCT")
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce {op} f32"] = t
        t = make_input(rank, torch.int64, (9,), salt=71, small=op == "PRODUCT")
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce {op} i64"] = t
    for op in ("BAND", "BOR", "BXOR"):
        t = make_input(rank, torch.int32, (9,), salt=72)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce {op} i32"] = t
    for dtype in (torch.float32, torch.bfloat16):
        for n in (17, 3 * 1001, 70_001 if dtype == torch.float32 else 140_001):
            t = make_input(rank, dtype, (n,), salt=76)
            dist.all_reduce(t)
            out[f"all_reduce SUM {dtype} {n}"] = t
        part = torch.empty(1001, dtype=dtype)  # gloo's ring chunks here are 1002 elements
        dist.reduce_scatter_tensor(part, make_input(rank, dtype, (world_size * 1001,), salt=77))
        out[f"reduce_scatter_tensor {dtype} unaligned"] = part
    x = make_input(rank, torch.float64, (4, 3), salt=73)
    full = torch.empty(world_size * 4, 3, dtype=torch.float64)
    dist.all_gather_into_tensor(full, x)
    out["all_gather_into_tensor"] = full
    shard = torch.empty(4, 3, dtype=torch.float64)
    dist.reduce_scatter_tensor(shard, full * (rank + 1))
    out["reduce_scatter_tensor"] = shard
    b = make_input(rank, torch.int32, (5,), salt=74)
    dist.broadcast(b, src=world_size - 1)
    out["broadcast"] = b
    splits = [(rank + j) % 2 + 1 for j in range(world_size)]
    recv = [(r + rank) % 2 + 1 for r in range(world_size)]
    a2a = torch.empty(sum(recv), 2)
    dist.all_to_all_single(a2a, make_input(rank, torch.float32, (sum(splits), 2), salt=75), recv, splits)
    out["all_to_all_single uneven"] = a2a
    scattered = torch.empty(3, dtype=torch.int64)
    dist.scatter(scattered, [torch.arange(3) + 10 * i for i in range(world_size)] if rank == 1 else None, src=1)
    out["scatter"] = scattered
    objs: list = [None] * world_size
    dist.all_gather_object(objs, {"r": rank, "s": "x" * rank})
    out["all_gather_object"] = torch.tensor([o["r"] * 100 + len(o["s"]) for o in objs])
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(6)
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(6.0) * rank, nxt),
                                       dist.P2POp(dist.irecv, got, prev)]):
        req.wait()
    out["batch_isend_irecv"] = got
    return out


@pytest.mark.parametrize("size", [3])
def test_same_results_as_gloo(size: int, worlds: Callable[..., World]) -> None:
    want = worlds(size, backend="gloo").run(_program)
    got = worlds(size, backend="tpu").run(_program)
    for rank in range(size):
        assert got[rank].keys() == want[rank].keys()
        for name, expected in want[rank].items():
            actual = got[rank][name]
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
            if "PRODUCT" in name and expected.dtype.is_floating_point:
                torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=name)
            else:
                assert torch.equal(actual, expected), (rank, name, actual, expected)


_CALLS = 200
_MAX_ROWS = 300
_DIMS = (3, 40)


def _random_all_to_alls(rank: int, world_size: int, calls: int) -> dict:
    """``calls`` all_to_all_singles whose splits change every call (a router's, say): the
    splits of call ``i`` are drawn from a generator seeded with ``i``, the same matrix on every
    rank (rank r sends ``splits[r][j]`` rows to rank j). Returns every output, and on "tpu"
    how many programs the calls built."""
    from tpu_dist.collectives import compile_count

    tpu = dist.get_backend() == "tpu"
    before = compile_count() if tpu else 0
    outs = []
    for i in range(calls):
        g = torch.Generator().manual_seed(1000 + i)
        widest = int(torch.randint(1, _MAX_ROWS, (1,), generator=g))
        splits = torch.randint(0, widest + 1, (world_size, world_size), generator=g)
        send, recv = splits[rank].tolist(), splits[:, rank].tolist()
        dim = _DIMS[i % 2]  # the wider rows run as collective-permutes (_plan_algorithms.PERMUTE_MIN_BYTES)
        x = make_input(rank, torch.float32, (sum(send), dim), salt=i)
        out = torch.empty(sum(recv), dim)
        dist.all_to_all_single(out, x, recv, send)
        outs.append(out)
    return {"outs": outs, "programs": compile_count() - before if tpu else None}


def test_random_split_all_to_alls_build_few_programs_and_match_gloo(
    worlds: Callable[..., World],
) -> None:
    # 200 calls whose widest chunk is anything from 1 to 300 rows of 3 or 40 floats: one
    # agreement program, and the padded exchange's width rounded to one of 4 buckets per
    # doubling (at most 4 * log2(12,000) + 8 = 62 widths here, fewer in practice), not one
    # program per width. Rows of 40 floats are mostly collective-permutes.
    want = worlds(3, backend="gloo").run(_random_all_to_alls, _CALLS)
    got = worlds(3, backend="tpu").run(_random_all_to_alls, _CALLS)
    widths = {_plan_all_to_all.size_bucket(d * w) for d in _DIMS for w in range(1, _MAX_ROWS)}
    for rank in range(3):
        assert 0 < got[rank]["programs"] <= 1 + len(widths) <= 62, got[rank]["programs"]
        for i, (a, b) in enumerate(zip(got[rank]["outs"], want[rank]["outs"])):
            assert torch.equal(a, b), (rank, i)
