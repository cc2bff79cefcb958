"""Pipeline parallelism on "tpu" beside gloo (issue 54): the point-to-point orders pipelines use,
and every schedule of ``torch.distributed.pipelining`` (torch 2.13).

1. Point-to-point orders that complete on gloo: each rank posts its ``isend``/``irecv`` of a
   phase in a random order (messages of one sender, receiver, group and tag in the order they
   were made, as gloo's matching needs: tags, groups and directions interleave at random), waits
   on its receives in another random order, and on each send then or only at the very end, as
   torch's interleaved schedules do. Tags, groups (WORLD and a ``new_group`` of every rank),
   sizes and dtypes vary. Before the fix "tpu" hung at the first seed (its queued ops were
   dispatched, blocking, in an order of its own at each wait).
2. The schedules on ``examples/train_pp.py``'s stages (a small decoder, one block a stage):
   on 2 ranks every schedule with its default stages a rank (1 for GPipe and 1F1B, else 2) and
   twice as many microbatches as stages, and two with the shapes inferred at run time (the
   object sends torch uses for it); on 4 ranks every schedule as a pure pipeline and on a 2-D
   (pp 2, dp 2) mesh with FSDP2 sharding each stage over dp. Each step's loss and the last
   step's gradients (local shards) equal gloo's. Before the fix Interleaved1F1B and LoopedBFS
   hung in a receive.

A hang fails its run within the run's timeout (the harness kills the world, with every rank's
stacks). One World per backend and world size serves every body.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import World

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV",
)
_RUN_TIMEOUT = 120


def _both(worlds: Callable[..., World], size: int) -> tuple[World, World]:
    return worlds(size, backend="tpu", timeout=_RUN_TIMEOUT), worlds(size, timeout=_RUN_TIMEOUT)


# -- 1. point-to-point orders that complete on gloo ---------------------------------------------

_DTYPES = (torch.float32, torch.int64, torch.bfloat16, torch.bool)


def _payload(message: dict) -> torch.Tensor:
    """The tensor message ``message`` carries (every rank can make it)."""
    g = torch.Generator().manual_seed(message["id"])
    values = torch.randint(-1000, 1000, (message["size"],), generator=g)
    return values.to(_DTYPES[message["dtype"]])


def _script(world_size: int, seed: int, count: int, phases: int) -> list[dict]:
    """The job's messages: the same on every rank."""
    rng = random.Random(seed)
    return [
        {
            "id": i, "phase": rng.randrange(phases),
            "ends": tuple(rng.sample(range(world_size), 2)),  # (sender, receiver)
            "tag": rng.choice((0, 0, 1, 7)), "group": rng.randrange(2),
            "size": rng.choice((1, 5, 300)), "dtype": rng.randrange(len(_DTYPES)),
        }
        for i in range(count)
    ]


def _posting_order(messages: list[dict], rng: random.Random) -> list[dict]:
    """``messages`` in a random order that keeps each (sender, receiver, group, tag)'s own order."""
    slots = list(range(len(messages)))
    rng.shuffle(slots)
    order: list[dict | None] = [None] * len(messages)
    by_channel: dict[tuple, list[int]] = {}
    for message, slot in zip(messages, slots):
        by_channel.setdefault((message["ends"], message["group"], message["tag"]), []).append(slot)
    for channel, taken in by_channel.items():
        mine = [m for m in messages if (m["ends"], m["group"], m["tag"]) == channel]
        for message, slot in zip(mine, sorted(taken)):
            order[slot] = message
    return order  # type: ignore[return-value]


def _p2p_orders(rank: int, world_size: int, seed: int, count: int, phases: int) -> list[str]:
    """Run :func:`_script` (module doc, 1.); returns what arrived wrong."""
    everyone = dist.new_group(list(range(world_size)))
    groups = [None, everyone]
    mine = random.Random(seed * 1009 + rank)
    late_sends, problems = [], []
    messages = _script(world_size, seed, count, phases)
    for phase in range(phases):
        posted = []
        ours = [m for m in messages if m["phase"] == phase and rank in m["ends"]]
        for m in _posting_order(ours, mine):
            src, dst = m["ends"]
            group = groups[m["group"]]
            if src == rank:
                work = dist.isend(_payload(m), dst, group=group, tag=m["tag"])
                posted.append((m, work, None))
            else:
                into = torch.empty(m["size"], dtype=_DTYPES[m["dtype"]])
                posted.append((m, dist.irecv(into, src, group=group, tag=m["tag"]), into))
        mine.shuffle(posted)
        for m, work, into in posted:
            if into is None and mine.random() < 0.5:
                late_sends.append(work)
                continue
            work.wait()
            if into is not None and not torch.equal(into, _payload(m)):
                problems.append(f"message {m} arrived as {into.tolist()[:5]}")
    for work in late_sends:
        work.wait()
    return problems


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("backend", ["tpu", "gloo"])
def test_p2p_orders_that_complete_on_gloo_complete_here(worlds, backend: str, size: int) -> None:
    world = worlds(size, backend=backend, timeout=_RUN_TIMEOUT)
    for seed in range(3):
        results = world.run(_p2p_orders, seed, 40 * size, 4, timeout=_RUN_TIMEOUT)
        assert results == [[]] * size, (seed, results)


def _sizes_differ(rank: int, world_size: int) -> str:
    """Rank 0 sends 5 floats; rank 1 receives into 3, then into 5 from a second send: the first
    receive fails saying both sizes, the second gets its data (the channel is still in step)."""
    if rank == 0:
        dist.send(torch.ones(5), 1)
        dist.send(torch.full((5,), 2.0), 1)
        return "sent"
    small, right = torch.zeros(3), torch.zeros(5)
    try:
        dist.recv(small, 0)
        first = "no error"
    except dist.DistBackendError as err:
        first = str(err)
    dist.recv(right, 0)
    return f"{first} | then {right.tolist()}"


def test_a_receive_of_another_size_fails_clearly(worlds) -> None:
    # gloo aborts the receiving process here (its tcp pair's size check): "tpu" raises instead.
    results = worlds(2, backend="tpu", timeout=_RUN_TIMEOUT).run(_sizes_differ)
    first, then = results[1].split(" | then ")
    assert "matched a send of 20 bytes, but its tensor holds 12 bytes" in first, first
    assert then == str([2.0] * 5), results


# -- 2. every schedule, beside gloo ------------------------------------------------------------


def _example():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_pp

    return train_pp


def _train(rank: int, world_size: int, argv: list[str]) -> dict:
    """``examples/train_pp.py`` with ``argv`` on this world: losses and last gradients."""
    from tpu_dist.mesh import init_device_mesh

    ex = _example()
    args = ex.parse(argv)
    plan = ex.layout(args, world_size)
    mesh = init_device_mesh((plan.pp, plan.dp), mesh_dim_names=("pp", "dp"))
    modules, stages, schedule = ex.build(
        args, plan, mesh.get_group("pp"), mesh.get_local_rank("pp"),
        mesh["dp"] if plan.dp > 1 else None,
    )
    losses, grads = ex.train(args, plan, modules, stages, schedule, mesh.get_local_rank("dp"))
    return {"losses": losses, "grads": grads, "stages": [s.stage_index for s in stages]}


def _compare(argv: list[str], tpu: list[dict], gloo: list[dict]) -> None:
    for rank, (t, g) in enumerate(zip(tpu, gloo)):
        assert t["stages"] == g["stages"], (argv, rank)
        assert t["losses"] == g["losses"], (argv, rank, t["losses"], g["losses"])
        assert t["grads"].keys() == g["grads"].keys() and t["grads"], (argv, rank)
        for name, grad in t["grads"].items():
            assert torch.equal(grad, g["grads"][name]), (argv, rank, name)
    losses = tpu[0]["losses"]
    assert losses[-1] < losses[0], (argv, losses)  # it trains


_TWO_RANKS = [[f"--schedule={s}"] for s in SCHEDULES] + [
    ["--schedule=1F1B", "--infer-shapes"],
    ["--schedule=Interleaved1F1B", "--infer-shapes", "--stages-per-rank=3"],
]


@pytest.mark.parametrize("argv", _TWO_RANKS, ids=" ".join)
def test_schedules_on_two_ranks_as_on_gloo(worlds, argv: list[str]) -> None:
    tpu, gloo = _both(worlds, 2)
    argv = [*argv, "--steps=3"]
    _compare(argv, tpu.run(_train, argv), gloo.run(_train, argv))


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_on_four_ranks_as_on_gloo(worlds, schedule: str, dp: int) -> None:
    # dp 1: a pipeline over 4 ranks; dp 2: two pipelines of 2 ranks, FSDP2 over dp.
    tpu, gloo = _both(worlds, 4)
    argv = [f"--schedule={schedule}", f"--dp={dp}", "--steps=2"]
    _compare(argv, tpu.run(_train, argv), gloo.run(_train, argv))
