"""Issue 16's defects of the collectives core, each checked on "tpu" beside gloo.

Every scenario runs the same body on a 2-rank "tpu" world and a 2-rank gloo world; gloo's
behaviour is the reference (a result is right when it equals what each rank computes itself).
"""

from __future__ import annotations

import threading
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
