"""A paused rank (SIGSTOP: a debugger, Ctrl-Z, a cgroup freezer, a VM pause) is waited for.

Issue 34, item 4: a rank stopped for longer than ``TPU_DIST_HEARTBEAT_TIMEOUT`` used to end
the job ("stopped, no heartbeat for 10 s") and then died of SIGABRT itself when resumed. As on
gloo, a stopped or silent rank now gets the group's timeout; only a dead process on this host
counts as gone early (``tests/test_reliability.py``: ``test_dead_peer_fails_survivors_naming_it``).

Each body runs on a 2-rank "tpu" world and a 2-rank gloo world, side by side (at once, each
world driven from a thread of its own: the test is mostly waiting): the paused rank stops
itself (SIGSTOP) and a child process resumes it (SIGCONT) ``PAUSE_S`` seconds later, while its
peer is in a collective with it; both must complete it with the right result.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from tests.harness import World

HEARTBEAT_S = 1
"""``TPU_DIST_HEARTBEAT_TIMEOUT`` of the "tpu" worlds: the pause lasts several times as long
(before the fix, the peer ended the job one to two heartbeat timeouts into the pause)."""
PAUSE_S = 3
GROUP_TIMEOUT_S = 90
"""The group's timeout, far longer than the pause."""


BACKENDS = ("tpu", "gloo")


def _world(worlds: Callable[..., World], backend: str) -> World:
    return worlds(
        2, backend=backend, timeout=150,
        env={"TPU_DIST_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S), "TPU_DIST_PLATFORM": "cpu"},
        init_kwargs={"timeout": datetime.timedelta(seconds=GROUP_TIMEOUT_S)},
    )


def _pause_self(seconds: float) -> None:
    """Stop this process (every thread) for ``seconds``: a child resumes it."""
    waker = subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    waker.wait()


def _pause_in_collective(
    rank: int, world_size: int, paused: int, when: str, seconds: float
) -> tuple[list[float], list[float], float]:
    """Rank ``paused`` stops for ``seconds`` before (``when="before"``) or while
    (``"during"``) an all_reduce its peers are in; then every rank runs one more.

    Returns (the all_reduce's distinct values, the next one's, seconds the first took here).
    """
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x.clone())  # compiled and connected: the pause hits a running group
    dist.barrier()
    start = time.monotonic()
    if rank != paused:
        if when == "during":
            time.sleep(1.0)  # the paused rank's all_reduce is in flight, waiting for this one
        dist.all_reduce(x)
    elif when == "before":
        _pause_self(seconds)
        dist.all_reduce(x)
    else:
        work = dist.all_reduce(x, async_op=True)
        _pause_self(seconds)
        work.wait()
    took = time.monotonic() - start
    y = torch.full((7,), 10.0 * (rank + 1))
    dist.all_reduce(y)
    return sorted(set(x.tolist())), sorted(set(y.tolist())), took


@pytest.mark.parametrize(("paused", "when"), [(1, "before"), (1, "during"), (0, "before")])
def test_a_paused_rank_is_waited_for(
    worlds: Callable[..., World], paused: int, when: str
) -> None:
    each = {backend: _world(worlds, backend) for backend in BACKENDS}
    with ThreadPoolExecutor(len(each)) as pool:
        running = {backend: pool.submit(world.run, _pause_in_collective, paused, when, PAUSE_S)
                   for backend, world in each.items()}
        outcomes = {backend: future.result() for backend, future in running.items()}
    for backend, results in outcomes.items():
        for rank, (first, second, took) in enumerate(results):
            assert first == [3.0] and second == [30.0], (backend, rank, results)
        # The peer really waited through the pause (the test tests something).
        assert results[1 - paused][2] >= PAUSE_S - 1, (backend, results)
