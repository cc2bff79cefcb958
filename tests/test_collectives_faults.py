"""Issue 16's defects of the collectives core, each checked on "tpu" beside gloo.

Every scenario runs the same body on a 2-rank "tpu" world and a 2-rank gloo world; gloo's
behaviour is the reference (a result is right when it equals what each rank computes itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.harness import World

BACKENDS = ["tpu", "gloo"]


@pytest.fixture(params=BACKENDS)
def world(request: pytest.FixtureRequest, worlds: Callable[..., World]) -> World:
    return worlds(2, backend=request.param, timeout=120)


# -- item 1: two threads, two groups over the same ranks ------------------------------------


def _two_threads_two_groups(rank: int, world_size: int, sizes: tuple[int, int], iters: int) -> list[int]:
    """Each thread all-reduces on its own group over every rank; returns wrong results per thread."""
    ranks = list(range(world_size))
    groups = [dist.new_group(ranks), dist.new_group(ranks)]
    wrong = [0, 0]
    errors: list[BaseException] = []

    def loop(which: int) -> None:
        try:
            base = 1000.0 * (which + 1)
            for i in range(iters):
                x = torch.full((sizes[which],), base + i + rank)
                dist.all_reduce(x, group=groups[which])
                expected = sum(base + i + r for r in ranks)
                if not torch.equal(x, torch.full_like(x, expected)):
                    wrong[which] += 1
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=loop, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for g in groups:
        dist.destroy_process_group(g)
    return wrong


@pytest.mark.parametrize("sizes", [(1000, 1000), (1000, 500)])
def test_two_threads_on_two_groups_over_the_same_ranks(world: World, sizes) -> None:
    assert world.run(_two_threads_two_groups, sizes, 50) == [[0, 0], [0, 0]]


# -- item 2: a later collective's completion implies earlier works' outputs -----------------


def _unwaited_then_later(rank: int, world_size: int, n: int, later: str) -> tuple[int, int]:
    """``n`` async all_reduces nobody waits on, then a later collective on the group.

    Returns (outputs written when the later collective returned, outputs a second later still
    holding what the program put there after the later collective).
    """
    outs = [torch.full((4,), float(i + rank)) for i in range(n)]
    works = [dist.all_reduce(t, async_op=True) for t in outs]
    if later == "barrier":
        dist.barrier()
    else:
        dist.all_reduce(torch.ones(3))
    written = sum(
        torch.equal(t, torch.full((4,), float(sum(i + r for r in range(world_size)))))
        for i, t in enumerate(outs)
    )
    for t in outs:
        t.fill_(100.0)  # the program reuses its buffers
    time.sleep(1.5)
    kept = sum(torch.equal(t, torch.full((4,), 100.0)) for t in outs)
    for w in works:
        w.wait()
    return written, kept


@pytest.mark.parametrize("later", ["barrier", "all_reduce"])
def test_later_collective_completes_after_earlier_outputs_are_written(world: World, later) -> None:
    assert world.run(_unwaited_then_later, 200, later) == [(200, 200)] * 2
