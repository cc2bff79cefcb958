"""Data movement on the "tpu" backend: gather, scatter, broadcast, all-to-all, p2p, objects.

Results must equal the other ranks' inputs bit for bit, for every dtype; each
rank rebuilds the inputs of all ranks with :func:`collective_cases.make_input`.
Worlds of 2, 3 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.collective_cases import DTYPES, make_input
from tests.harness import World
from tpu_dist.collectives._plan_algorithms import PERMUTE_MIN_BYTES


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest) -> World:
    with World(request.param, backend="tpu") as w:
        yield w


def _check(problems: list[str], name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        problems.append(f"{name}: got {got.flatten()[:6].tolist()}, want {want.flatten()[:6].tolist()}")


def _gathers(rank: int, world_size: int, async_op: bool) -> list[str]:
    problems: list[str] = []
    shape = (2, 3)
    for dtype in DTYPES:
        ins = [make_input(r, dtype, shape, salt=20) for r in range(world_size)]
        # all_gather into a list
        outs = [torch.empty(shape, dtype=dtype) for _ in range(world_size)]
        work = dist.all_gather(outs, ins[rank], async_op=async_op)
        if async_op:
            work.wait()
        for r in range(world_size):
            _check(problems, f"all_gather {dtype} from {r}", outs[r], ins[r])
        # all_gather_into_tensor, concat layout (dim 0) and stack layout (new dim 0)
        concat = torch.empty((world_size * 2, 3), dtype=dtype)
        dist.all_gather_into_tensor(concat, ins[rank])
        _check(problems, f"all_gather_into_tensor concat {dtype}", concat, torch.cat(ins))
        stacked = torch.empty((world_size, 2, 3), dtype=dtype)
        dist.all_gather_into_tensor(stacked, ins[rank])
        _check(problems, f"all_gather_into_tensor stack {dtype}", stacked, torch.stack(ins))
    return problems


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_gather_every_dtype(world: World, async_op: bool) -> None:
    assert world.run(_gathers, async_op, timeout=300) == [[]] * world.world_size


def _coalesced_gather(rank: int, world_size: int) -> list[str]:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _get_default_group

    problems: list[str] = []
    ins = [[make_input(r, dt, (i + 2,), salt=30) for r in range(world_size)]
           for i, dt in enumerate((torch.float32, torch.int64, torch.bfloat16))]
    outs = funcol.all_gather_single_coalesced([x[rank] for x in ins], _get_default_group())
    for i, out in enumerate(outs):
        _check(problems, f"all_gather_into_tensor_coalesced[{i}]", funcol.wait_tensor(out),
               torch.cat(ins[i]))
    return problems


def test_all_gather_coalesced(world: World) -> None:
    assert world.run(_coalesced_gather) == [[]] * world.world_size


def _rooted(rank: int, world_size: int) -> list[str]:
    problems: list[str] = []
    for dtype in (torch.float32, torch.float64, torch.int8, torch.bool, torch.complex128,
                  torch.bfloat16):
        for root in range(world_size):
            salt = 40 + root
            ins = [make_input(r, dtype, (3, 2), salt) for r in range(world_size)]
            # broadcast
            t = ins[rank].clone()
            dist.broadcast(t, src=root)
            _check(problems, f"broadcast {dtype} root {root}", t, ins[root])
            # gather
            gather_list = [torch.empty(3, 2, dtype=dtype) for _ in range(world_size)] if rank == root else None
            dist.gather(ins[rank], gather_list, dst=root)
            if rank == root:
                for r in range(world_size):
                    _check(problems, f"gather {dtype} root {root} from {r}", gather_list[r], ins[r])
            # scatter: the root's list, chunk i to rank i
            pieces = [make_input(root, dtype, (3, 2), salt + 100 + i) for i in range(world_size)]
            out = torch.empty(3, 2, dtype=dtype)
            dist.scatter(out, pieces if rank == root else None, src=root)
            _check(problems, f"scatter {dtype} root {root}", out, pieces[rank])
    return problems


def test_broadcast_gather_scatter_every_root(world: World) -> None:
    assert world.run(_rooted, timeout=300) == [[]] * world.world_size


def _all_to_all(rank: int, world_size: int) -> list[str]:
    problems: list[str] = []
    for dtype in (torch.float32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float16):
        # equal splits: chunk j of rank i's input goes to rank j
        ins = [make_input(r, dtype, (world_size * 2, 3), salt=50) for r in range(world_size)]
        out = torch.empty_like(ins[rank])
        dist.all_to_all_single(out, ins[rank])
        want = torch.cat([ins[r].chunk(world_size)[rank] for r in range(world_size)])
        _check(problems, f"all_to_all_single even {dtype}", out, want)
        # uneven splits: rank i sends (i + j) % 3 rows to rank j (some zero)
        def splits(i: int) -> list[int]:
            return [(i + j) % 3 for j in range(world_size)]

        ins = [make_input(r, dtype, (sum(splits(r)), 4), salt=51) for r in range(world_size)]
        recv = [splits(r)[rank] for r in range(world_size)]
        out = torch.empty((sum(recv), 4), dtype=dtype)
        dist.all_to_all_single(out, ins[rank], output_split_sizes=recv, input_split_sizes=splits(rank))
        want = torch.cat([ins[r].split(splits(r))[rank] for r in range(world_size)])
        _check(problems, f"all_to_all_single uneven {dtype}", out, want)
        # all_to_all with lists of differently sized tensors
        def piece(i: int, j: int) -> torch.Tensor:
            return make_input(i, dtype, (i + j + 1,), salt=52 + j)

        outs = [torch.empty(r + rank + 1, dtype=dtype) for r in range(world_size)]
        dist.all_to_all(outs, [piece(rank, j) for j in range(world_size)])
        for r in range(world_size):
            _check(problems, f"all_to_all list {dtype} from {r}", outs[r], piece(r, rank))
        # at least _plan_algorithms.PERMUTE_MIN_BYTES a rank: one collective-permute per peer on CPU,
        # even (an odd number of rows a peer: chunks at offsets no multiple of 64 bytes) and
        # uneven (some chunks of the agreed width, passed as they are, some padded)
        big = PERMUTE_MIN_BYTES // dtype.itemsize // (3 * world_size) + 1
        ins = [make_input(r, dtype, (world_size * big, 3), salt=53) for r in range(world_size)]
        out = torch.empty_like(ins[rank])
        dist.all_to_all_single(out, ins[rank])
        want = torch.cat([ins[r].chunk(world_size)[rank] for r in range(world_size)])
        _check(problems, f"all_to_all_single even large {dtype}", out, want)

        def big_splits(i: int) -> list[int]:
            return [big + 5 * ((i + j) % 2) for j in range(world_size)]

        ins = [make_input(r, dtype, (sum(big_splits(r)), 3), salt=54) for r in range(world_size)]
        recv = [big_splits(r)[rank] for r in range(world_size)]
        out = torch.empty((3, sum(recv)), dtype=dtype).t()  # an output that is not contiguous
        dist.all_to_all_single(out, ins[rank], output_split_sizes=recv,
                               input_split_sizes=big_splits(rank))
        want = torch.cat([ins[r].split(big_splits(r))[rank] for r in range(world_size)])
        _check(problems, f"all_to_all_single uneven large {dtype}", out, want)
    return problems


def test_all_to_all(world: World) -> None:
    assert world.run(_all_to_all, timeout=300) == [[]] * world.world_size


def _point_to_point(rank: int, world_size: int) -> list[str]:
    problems: list[str] = []
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        # blocking ring: even ranks send first, odd ranks receive first
        mine = make_input(rank, dtype, (4, 2), salt=60)
        got = torch.empty(4, 2, dtype=dtype)
        if world_size % 2 == 0:
            if rank % 2 == 0:
                dist.send(mine, nxt)
                dist.recv(got, prev)
            else:
                dist.recv(got, prev)
                dist.send(mine, nxt)
            _check(problems, f"send/recv ring {dtype}", got, make_input(prev, dtype, (4, 2), salt=60))
        # batch_isend_irecv ring, recv listed first
        got = torch.empty(4, 2, dtype=dtype)
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.irecv, got, prev),
            dist.P2POp(dist.isend, mine, nxt),
        ])
        for req in reqs:
            req.wait()
        _check(problems, f"batch_isend_irecv ring {dtype}", got, make_input(prev, dtype, (4, 2), salt=60))
    # isend/irecv with tags posted in different orders on the two ends of a pair
    if rank < 2:
        peer = 1 - rank
        a = make_input(rank, torch.float32, (3,), salt=61)
        b = make_input(rank, torch.float32, (5,), salt=62)
        got_a, got_b = torch.empty(3), torch.empty(5)
        if rank == 0:
            reqs = [dist.isend(a, peer, tag=1), dist.isend(b, peer, tag=2),
                    dist.irecv(got_b, peer, tag=2), dist.irecv(got_a, peer, tag=1)]
        else:
            reqs = [dist.irecv(got_b, peer, tag=2), dist.irecv(got_a, peer, tag=1),
                    dist.isend(b, peer, tag=2), dist.isend(a, peer, tag=1)]
        for req in reqs:
            req.wait()
        _check(problems, "tagged irecv a", got_a, make_input(peer, torch.float32, (3,), salt=61))
        _check(problems, "tagged irecv b", got_b, make_input(peer, torch.float32, (5,), salt=62))
    return problems


def test_point_to_point(world: World) -> None:
    assert world.run(_point_to_point, timeout=300) == [[]] * world.world_size


def _recv_any_source(rank: int, world_size: int) -> list[tuple[int, bool]]:
    """Rank 0 receives from any source once per peer; each peer sends its rank."""
    got = []
    if rank == 0:
        for _ in range(world_size - 1):
            t = torch.full((3,), -1.0)
            sender = dist.recv(t)
            got.append((sender, bool(torch.all(t == sender))))
    else:
        dist.send(torch.full((3,), float(rank)), 0)
    dist.barrier()
    return got


def test_recv_from_any_source(world: World) -> None:
    results = world.run(_recv_any_source)
    assert sorted(results[0]) == [(r, True) for r in range(1, world.world_size)], results


def _objects(rank: int, world_size: int) -> list[str]:
    problems: list[str] = []
    payload = {"rank": rank, "blob": "x" * (rank * 37 + 1), "nested": [rank, (rank, "t")]}
    want = [{"rank": r, "blob": "x" * (r * 37 + 1), "nested": [r, (r, "t")]} for r in range(world_size)]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, payload)
    if gathered != want:
        problems.append(f"all_gather_object: {gathered}")
    objs = [payload, rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(objs, src=1)
    if objs != [want[1], 1]:
        problems.append(f"broadcast_object_list: {objs}")
    out = [None] if rank == 0 else None
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if rank == 0 and gathered != want:
        problems.append(f"gather_object: {gathered}")
    received = [None]
    dist.scatter_object_list(received, [f"item{i}" for i in range(world_size)] if rank == 0 else None, src=0)
    if received != [f"item{rank}"]:
        problems.append(f"scatter_object_list: {received}")
    del out
    return problems


def test_object_collectives(world: World) -> None:
    assert world.run(_objects) == [[]] * world.world_size
