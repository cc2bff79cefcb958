"""Tests of the multi-process test harness (``tests/harness.py``) on the gloo backend.

Worlds: 2 ranks of gloo, and 3 ranks of gloo with extra env and init kwargs, each shared by the
module (the ``worlds`` fixture of ``tests/conftest.py``); the failure tests break them on purpose
and check that the next run restarts them. A few tests start short-lived worlds of their own.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import World, WorldError

# World arguments by world size: 3 ranks also try extra env vars and init kwargs.
SPECS: dict[int, dict[str, Any]] = {
    2: {},
    3: {
        "env": {"HARNESS_TEST_VAR": "hello", "OMP_NUM_THREADS": "2"},
        "init_kwargs": {"timeout": datetime.timedelta(seconds=45)},
    },
}
BOTH = pytest.mark.parametrize("n", [2, 3], ids=["2ranks", "3ranks"])

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# -- bodies (module level: the workers import them from this file) ----------------------------


def _whoami(rank: int, world_size: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {
        "rank": rank,
        "world_size": world_size,
        "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "env": {key: os.environ.get(key) for key in _ENV_KEYS},
        "extra_env": (os.environ.get("HARNESS_TEST_VAR"), os.environ.get("OMP_NUM_THREADS")),
        # torch keeps no public record of the group's timeout; the gloo backend's options do.
        "timeout": dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout,
        "args": args,
        "kwargs": kwargs,
        "pid": os.getpid(),
    }


def _all_reduce_sum(rank: int, world_size: int, n: int) -> torch.Tensor:
    t = torch.full((n,), float(rank + 1))
    dist.all_reduce(t)
    return t


def _raise_on_last_rank(rank: int, world_size: int) -> int:
    if rank == world_size - 1:
        _failing_helper(rank)
    return rank


def _failing_helper(rank: int) -> None:
    raise ValueError(f"rank {rank} failed on purpose")


def _failing_assert(rank: int, world_size: int) -> None:
    got = [rank, world_size]
    assert got == [rank, -1]


def _unpicklable_result(rank: int, world_size: int) -> Any:
    return (lambda: None) if rank == 0 else rank


def _print_and_return(rank: int, world_size: int) -> int:
    print(f"rank {rank} says hi")
    return rank


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _rank1_hangs(rank: int, world_size: int) -> None:
    # Rank 1 never arrives at the all_reduce, so the other ranks wait in it.
    if rank == 1:
        _sleep_forever(rank, world_size)
    dist.all_reduce(torch.ones(1))


def _rank1_exits(rank: int, world_size: int) -> None:
    # Rank 1 dies; the others are in an all_reduce it never joins (gloo notices the closed peer).
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _rank1_stops_rank0_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # can return only after a SIGCONT
    time.sleep(0.5)
    raise RuntimeError("rank 0 failed while rank 1 is stopped")


def _init_by_env(rank: int, world_size: int) -> list[Any]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return [os.environ["HARNESS_TEST_VAR"], t.tolist()]


# -- tests -------------------------------------------------------------------------------------


@BOTH
def test_results_come_back_per_rank(worlds: Callable[..., World], n: int) -> None:
    world = worlds(n, **SPECS[n])
    results = world.run(_whoami, 1, "two", three=3.0)
    n = world.world_size
    assert [r["rank"] for r in results] == list(range(n))
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, r in enumerate(results):
        assert r["world_size"] == n
        assert r["dist"] == (rank, n, "gloo")
        assert r["args"] == (1, "two") and r["kwargs"] == {"three": 3.0}
        expected = {"RANK": rank, "WORLD_SIZE": n, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": n}
        assert {k: int(r["env"][k]) for k in expected} == expected
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert [r["pid"] for r in results] == world.pids
    if "HARNESS_TEST_VAR" in world.env:
        assert all(r["extra_env"] == ("hello", "2") for r in results)
        assert all(r["timeout"] == datetime.timedelta(seconds=45) for r in results)
    else:
        assert all(r["extra_env"] == (None, "1") for r in results)  # OMP_NUM_THREADS default


@BOTH
def test_all_reduce_sums_over_ranks(worlds: Callable[..., World], n: int) -> None:
    world = worlds(n, **SPECS[n])
    n = world.world_size
    results = world.run(_all_reduce_sum, 4)
    assert len(results) == n
    for t in results:
        torch.testing.assert_close(t, torch.full((4,), n * (n + 1) / 2))


@BOTH
def test_exception_names_the_rank_and_its_traceback(worlds: Callable[..., World], n: int) -> None:
    world = worlds(n, **SPECS[n])
    pids = world.pids
    last = world.world_size - 1
    with pytest.raises(WorldError) as info:
        world.run(_raise_on_last_rank)
    message = str(info.value)
    assert f"raised on rank {last} of {world.world_size}" in message
    assert f"=== rank {last}: raised ===" in message
    assert "Traceback (most recent call last)" in message
    assert "in _raise_on_last_rank" in message and "in _failing_helper" in message
    assert f"ValueError: rank {last} failed on purpose" in message
    assert list(info.value.errors) == [last] and not info.value.restarted
    # Every rank returned, so the same processes serve the next run.
    assert world.run(_print_and_return) == list(range(world.world_size))
    assert world.pids == pids


@BOTH
def test_failing_assert_in_body_shows_values(worlds: Callable[..., World], n: int) -> None:
    world = worlds(n, **SPECS[n])
    with pytest.raises(WorldError) as info:
        world.run(_failing_assert)
    assert sorted(info.value.errors) == list(range(world.world_size))
    assert "assert [0, " in info.value.errors[0]  # pytest's rewritten assert message


def test_unpicklable_result_is_a_clean_error(world: World, worlds: Callable[..., World]) -> None:
    assert world is worlds(2)  # The default world fixture is the module's 2-rank world.
    pids = world.pids
    with pytest.raises(WorldError, match="could not be pickled") as info:
        world.run(_unpicklable_result)
    assert list(info.value.errors) == [0]
    assert world.pids == pids


# The indirect parameters name the module's two worlds, so no new world starts.
@pytest.mark.parametrize(
    "world", [2, {"world_size": 3, **SPECS[3]}], ids=["2ranks", "3ranks"], indirect=True
)
def test_output_is_forwarded_with_rank_prefix(
    world: World, capfd: pytest.CaptureFixture[str]
) -> None:
    world.run(_print_and_return)
    err = capfd.readouterr().err
    assert all(f"[rank {r}] rank {r} says hi" in err for r in range(world.world_size))


def test_hang_dumps_every_rank_and_next_run_restarts(worlds: Callable[..., World]) -> None:
    world = worlds(3, **SPECS[3])
    old_pids = world.pids
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        world.run(_rank1_hangs, timeout=2.0)
    elapsed = time.monotonic() - start
    assert elapsed < 15.0, f"a 2 s hang took {elapsed:.1f} s to report"
    err = info.value
    assert err.timed_out == [0, 1, 2] and err.restarted
    message = str(err)
    assert "did not return within 2 s" in message
    for rank in range(3):
        assert f"=== rank {rank} (did not return): Python stacks (faulthandler) ===" in message
        assert "_rank1_hangs" in err.stacks[rank]
    assert "in _sleep_forever" in err.stacks[1]
    assert "in all_reduce" in err.stacks[0] and "in all_reduce" in err.stacks[2]
    assert _all_gone(old_pids)
    # The next run starts a fresh world transparently.
    assert [t.tolist() for t in world.run(_all_reduce_sum, 1)] == [[6.0]] * 3
    assert set(world.pids).isdisjoint(old_pids)


def test_dead_rank_is_reported_quickly_with_exit_code(worlds: Callable[..., World]) -> None:
    world = worlds(2)
    old_pids = world.pids
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        world.run(_rank1_exits, timeout=60.0)
    elapsed = time.monotonic() - start
    assert elapsed < 10.0, f"a dead rank took {elapsed:.1f} s to report (timeout: 60 s)"
    assert info.value.exitcodes == {1: 3} and info.value.restarted
    assert "rank 1 exited with code 3" in str(info.value)
    assert _all_gone(old_pids)
    assert world.run(_print_and_return) == [0, 1]


def test_stopped_rank_ends_the_grace_at_once(worlds: Callable[..., World]) -> None:
    world = worlds(2)
    assert world.failure_grace == 5.0
    old_pids = world.pids
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        world.run(_rank1_stops_rank0_raises, timeout=60.0)
    elapsed = time.monotonic() - start
    # Waiting out the grace (5 s) and a stack dump from the stopped rank (5 s) would gain nothing.
    assert elapsed < 4.0, f"a stopped rank kept the failed run waiting {elapsed:.1f} s"
    err = info.value
    assert err.timed_out == [1] and err.restarted
    assert "rank 0 failed while rank 1 is stopped" in err.errors[0]
    assert err.stacks[1] == "(stopped: SIGSTOP, no stacks)"
    assert _all_gone(old_pids)
    assert world.run(_print_and_return) == [0, 1]


def test_body_must_be_importable_by_reference() -> None:
    world = World(2)  # Never started: the body is checked before anything is sent.
    with pytest.raises(TypeError, match="by reference"):
        world.run(lambda rank, world_size: None)
    with pytest.raises(TypeError, match="cannot be pickled"):
        world.run(_whoami, lambda: None)
    assert world.pids == []


def test_without_init_bodies_init_by_env_and_close_leaves_nothing() -> None:
    with World(1, init=False, env={"HARNESS_TEST_VAR": "x"}) as world:
        pids = world.pids
        assert world.run(_init_by_env) == [["x", [1.0, 1.0]]]
    assert world.pids == [] and _all_gone(pids)


def test_failure_to_start_is_reported_per_rank() -> None:
    world = World(2, backend_module="tests.no_such_backend_module")
    with pytest.raises(WorldError) as info:
        world.start()
    assert sorted(info.value.errors) == [0, 1]
    assert "No module named 'tests.no_such_backend_module'" in info.value.errors[1]
    assert world.pids == []
    world.close()


def _all_gone(pids: list[int]) -> bool:
    """Whether none of ``pids`` is running (they were reaped: no zombies either)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True
