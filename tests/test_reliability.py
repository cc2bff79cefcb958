"""No silent hangs: timeouts, dead and stopped peers, mismatched calls, the flight recorder.

Each scenario has a world of its own (a failed collective leaves its world
unusable) with short timeouts, so every test ends in bounded time even when
the code under test is broken: the harness kills a world whose ranks do not
return, dumps their stacks and fails.

Most of a scenario is waiting (for a timeout, a heartbeat, a late rank's sleep), so the
``scenarios`` fixture runs them all at once, each world in a thread of its own, at the start of
the module; each test then checks its scenario's outcome. The timing bounds they assert are
loose enough for that (a failure within 20 s, a timeout run within 60 s).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import World, WorldError
from tests.launch_worker import free_port
from tpu_dist.collectives import set_timeout

FAST = {"TPU_DIST_HEARTBEAT_TIMEOUT": "4"}

_SCENARIOS: dict[str, Callable[[Path], Any]] = {}


def scenario(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
    """Register ``fn(directory)`` to run in the ``scenarios`` fixture, under its own name."""
    _SCENARIOS[fn.__name__] = fn
    return fn


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Any]]:
    """Starts every registered scenario at once, each in a thread with its own world and
    directory; ``scenarios(name)`` waits for that one and returns what it returned (or raises
    what it raised)."""
    pool = ThreadPoolExecutor(max_workers=len(_SCENARIOS), thread_name_prefix="scenario")
    futures: dict[str, Future] = {
        name: pool.submit(fn, tmp_path_factory.mktemp(name)) for name, fn in _SCENARIOS.items()
    }
    yield lambda name: futures[name].result()
    pool.shutdown(wait=True)


def _failure(world: World, fn: Callable[..., Any], *args: Any) -> WorldError:
    """Run ``fn`` on ``world``, which must fail; return the harness's error."""
    with pytest.raises(WorldError) as caught:
        world.run(fn, *args)
    return caught.value


def _raise_policy_world(world_size: int, records: os.PathLike) -> World:
    """A "tpu" world whose group timeouts raise instead of aborting; the flight recorder writes
    to ``records``; the harness gives up on it after 90 s. Its group timeout is
    :data:`WARM_UP_TIMEOUT`: bodies shorten it with :func:`_short_timeout` after a warm-up."""
    env = {**FAST, "TPU_DIST_TIMEOUT_POLICY": "raise", "TPU_DIST_FLIGHT_RECORDER_DIR": str(records)}
    return World(world_size, backend="tpu", env=env, timeout=90,
                 init_kwargs={"timeout": WARM_UP_TIMEOUT})


# The scenarios start at once, so a first collective (compiled, communicators set up) can take
# several seconds on a loaded machine: bodies warm up under this timeout, then shorten it.
WARM_UP_TIMEOUT = datetime.timedelta(seconds=60)


def _short_timeout(seconds: float) -> None:
    """The default group's timeout becomes ``seconds`` for the collectives issued from now on."""
    set_timeout(datetime.timedelta(seconds=seconds))


def _skip_one_collective(
    rank: int, world_size: int, timeout_s: float, late_rank: int, slow_rank: int | None = None
) -> str:
    """Every rank but ``late_rank`` all-reduces under a ``timeout_s`` group timeout;
    ``late_rank`` stays away for a while. ``slow_rank`` joins 2 s after the others, so the
    group has failed (on the ranks that timed out first) before its own timeout would end its
    wait.

    A first all_reduce of the same shape runs on every rank (under the warm-up timeout), so the
    second finds its program compiled and XLA's communicators set up (an async dispatch).
    """
    t = torch.arange(4.0) + rank
    dist.all_reduce(t.clone())
    _short_timeout(timeout_s)
    if rank == late_rank:
        time.sleep(8)  # past the others' timeouts; it never joins either way
        return "late rank slept"
    if rank == slow_rank:
        time.sleep(2)
    before = t.clone()
    try:
        dist.all_reduce(t)
    except dist.DistBackendError as err:
        assert torch.equal(t, before), "a failed collective modified its input"
        return str(err)
    return "no error"


@scenario
def timeout_raises(tmp_path: Path) -> tuple[list[str], float, subprocess.CompletedProcess]:
    with _raise_policy_world(3, tmp_path) as world:
        start = time.monotonic()
        results = world.run(_skip_one_collective, 5, 1, 2)
        took = time.monotonic() - start
    # The watchdogs dumped the flight records; the analyzer says who is behind.
    out = subprocess.run(
        [sys.executable, "-m", "tpu_dist.collectives.flight_recorder", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    return results, took, out


def test_timeout_raises_naming_the_missing_rank(scenarios) -> None:
    results, took, out = scenarios("timeout_raises")
    for rank in (0, 2):
        message = results[rank]
        assert "timed out after 5 s" in message, message
        assert "all_reduce" in message and "collective #2" in message
        assert "did not arrive: [1]" in message
    assert took < 60
    # Rank 2 failed because rank 0 failed the group; it wrote its flight record all the same.
    assert "tpu_dist_fr_rank2.json" in results[2], results[2]
    assert "never completed on ranks [0, 2]" in out.stdout, out.stdout


@scenario
def timeout_aborts(tmp_path: Path) -> tuple[WorldError, bool]:
    env = {**FAST, "TPU_DIST_FLIGHT_RECORDER_DIR": str(tmp_path)}
    with World(2, backend="tpu", env=env, timeout=60, failure_grace=30,
               init_kwargs={"timeout": WARM_UP_TIMEOUT}) as world:
        err = _failure(world, _skip_one_collective, 5, 1)
    return err, (tmp_path / "tpu_dist_fr_rank0.json").exists()


def test_timeout_aborts_by_default_with_a_message(scenarios) -> None:
    err, recorded = scenarios("timeout_aborts")
    assert err.exitcodes.get(0) == 1, err
    assert "timed out after 5 s" in str(err) and "did not arrive: [1]" in str(err)
    assert "TPU_DIST_TIMEOUT_POLICY=abort" in str(err)
    assert recorded


def _die_mid_collective(rank: int, world_size: int) -> None:
    t = torch.ones(8)
    dist.all_reduce(t)  # everyone is up
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    before = t.clone()
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except dist.DistBackendError:
        assert torch.equal(t, before), "a failed collective modified its input"
        assert time.monotonic() - start < 20, "the failure took too long to surface"
        raise


@scenario
def dead_peer(tmp_path: Path) -> WorldError:
    with World(3, backend="tpu", env=FAST, timeout=60, failure_grace=20) as world:
        return _failure(world, _die_mid_collective)


def test_dead_peer_fails_survivors_naming_it(scenarios) -> None:
    err = scenarios("dead_peer")
    assert err.exitcodes.get(2) == -signal.SIGKILL, err
    for rank in (0, 1):
        assert "rank(s) [2] did not report the failure" in err.errors.get(rank, ""), err


def _stop_mid_collective(rank: int, world_size: int) -> None:
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)


@scenario
def stopped_peer(tmp_path: Path) -> WorldError:
    # Group timeout 8 s, heartbeat timeout 4 s: the stopped rank gets the group's timeout.
    with World(3, backend="tpu", env=FAST, timeout=60, failure_grace=15,
               init_kwargs={"timeout": datetime.timedelta(seconds=8)}) as world:
        return _failure(world, _stop_mid_collective)


def test_stopped_peer_gets_the_group_timeout(scenarios) -> None:
    err = scenarios("stopped_peer")
    # Ranks 0 and 2 end themselves (abort policy) after the group's timeout, not the heartbeat
    # timeout (a paused rank may come back: tests/test_paused_rank.py), naming rank 1 as
    # stopped. Once rank 0 has gone, JAX's coordination service (which rank 0 hosts) aborts
    # rank 2 (SIGABRT) if its own watchdog has not ended it first.
    survivors = {err.exitcodes.get(0), err.exitcodes.get(2)}
    assert 1 in survivors and survivors <= {1, -signal.SIGABRT}, err
    assert "timed out after 8 s (the group's timeout)" in str(err), err
    assert "rank(s) [1] are stopped (SIGSTOP" in str(err), err


def _mismatched(rank: int, world_size: int) -> list[str]:
    messages = []
    cases = [
        lambda: dist.all_reduce(torch.ones(4 + rank)),                      # shapes differ
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)),
        lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX),
        lambda: (dist.all_reduce(torch.ones(4)) if rank == 0
                 else dist.broadcast(torch.ones(4), src=0)),                 # ops differ
    ]
    for case in cases:
        try:
            case()
            messages.append("no error")
        except RuntimeError as err:
            messages.append(str(err))
    ok = torch.ones(3)
    dist.all_reduce(ok)  # the group still works
    messages.append(str(ok.tolist()))
    return messages


@scenario
def mismatched(tmp_path: Path) -> list[list[str]]:
    with World(2, backend="tpu", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=120) as world:
        return world.run(_mismatched)


def test_mismatched_collectives_raise_on_every_rank_under_detail(scenarios) -> None:
    for messages in scenarios("mismatched"):
        *errors, after = messages
        assert after == "[2.0, 2.0, 2.0]"
        for message in errors:
            assert "mismatch between collectives" in message, message
        assert "rank 0: all_reduce SUM (float32[4])" in errors[0]
        assert "rank 1: all_reduce SUM (float32[5])" in errors[0]
        assert "float64" in errors[1] and "MAX" in errors[2] and "broadcast" in errors[3]


def _record_and_dump(rank: int, world_size: int, directory: str) -> str:
    from tpu_dist.collectives import flight_recorder

    for n in range(3):
        dist.all_reduce(torch.ones(n + 1))
    group = dist.new_group([0, 1])
    dist.all_gather_into_tensor(torch.empty(2), torch.ones(1), group=group)
    return flight_recorder.dump(directory)


@scenario
def flight_recorder(tmp_path: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    with World(2, backend="tpu", timeout=120) as world:
        paths = world.run(_record_and_dump, str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "tpu_dist.collectives.flight_recorder", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    return paths, out


def test_flight_recorder_dump_and_analyzer(scenarios) -> None:
    paths, out = scenarios("flight_recorder")
    assert sorted(os.path.basename(p) for p in paths) == ["tpu_dist_fr_rank0.json", "tpu_dist_fr_rank1.json"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every rank called the same collectives" in out.stdout


def _async_work_nobody_waits_on(rank: int, world_size: int) -> dict:
    # The timeout leaves room for a loaded machine (every scenario of this module runs at
    # once, beside another module): the ranks' arrival and a cold compile fit in 5 s.
    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=5))
    t = torch.full((1000,), float(rank + 1))
    work = dist.all_reduce(t, group=group, async_op=True)
    time.sleep(8)  # past the group's 5 s timeout; nobody calls work.wait()
    seen = t.tolist()  # read before is_completed(), which would itself complete the work
    return {"values": sorted(set(seen)), "completed": work.is_completed(), "ok": work.is_success()}


@scenario
def unwaited_async(tmp_path: Path) -> list[dict]:
    with World(2, backend="tpu", timeout=90) as world:
        return world.run(_async_work_nobody_waits_on)


def test_unwaited_async_work_completes_in_background_and_never_times_out(scenarios) -> None:
    # The watchdog used to keep such a work "in flight" and abort the process after the
    # group's timeout although its program had long finished.
    for result in scenarios("unwaited_async"):
        assert result == {"values": [3.0], "completed": True, "ok": True}, result


_EXIT_WITH_WORK_IN_FLIGHT = """
import os, torch, torch.distributed as dist
import tpu_dist
dist.init_process_group("tpu", rank=0, world_size=1)
small = torch.ones(4096)
works = [dist.all_reduce(small, async_op=True) for _ in range(64)]
large = torch.ones(4 << 20)
futures = [dist.all_reduce(large, async_op=True).get_future() for _ in range(3)]
print("script done", flush=True)
"""


@scenario
def exit_in_flight(tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TPU_DIST_PLATFORM": "cpu"}
    return subprocess.run([sys.executable, "-c", _EXIT_WITH_WORK_IN_FLIGHT], env=env,
                          capture_output=True, text=True, timeout=120)


def test_exit_with_async_work_in_flight_is_clean(scenarios) -> None:
    # A helper thread inside XLA when the interpreter finalized used to abort the process
    # ("FATAL: exception not rethrown", exit code 134); at exit, in-flight works now finish.
    out = scenarios("exit_in_flight")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "script done" in out.stdout


def _hold_the_gil(rank: int, world_size: int, seconds: float) -> float:
    """Rank 1 spends ``seconds`` in one C call that holds the GIL (as pickling a big object
    does): its heartbeat thread cannot run. The barrier must wait for it, not give it up."""
    import ctypes

    dist.barrier()
    start = time.monotonic()
    if rank == 1:
        ctypes.PyDLL(None).sleep(int(seconds))  # libc sleep(3) through PyDLL keeps the GIL
    dist.barrier()
    return time.monotonic() - start


def _gil_world(backend: str) -> list[float]:
    # Heartbeat timeout 3 s, group timeout 60 s: the rank is silent for 8 s, and alive.
    with World(2, backend=backend, env={"TPU_DIST_HEARTBEAT_TIMEOUT": "3"}, timeout=90,
               init_kwargs={"timeout": datetime.timedelta(seconds=60)}) as world:
        return world.run(_hold_the_gil, 8)


@scenario
def gil_gloo(tmp_path: Path) -> list[float]:
    return _gil_world("gloo")


@scenario
def gil_tpu(tmp_path: Path) -> list[float]:
    return _gil_world("tpu")


@pytest.mark.parametrize("backend", ["gloo", "tpu"])
def test_a_rank_holding_the_gil_is_not_declared_dead(scenarios, backend: str) -> None:
    waited = scenarios(f"gil_{backend}")
    assert min(waited) >= 7.5, waited


def _late_rank_after_a_timeout(rank: int, world_size: int) -> list[str]:
    """Rank 1 arrives at collective #2 after its peers gave up on it (group timeout 3 s)."""
    outcomes = []
    t = torch.ones(4)
    dist.all_reduce(t)
    _short_timeout(3)
    if rank == 1:
        time.sleep(8)
    for _ in range(2):  # the collective the peers gave up on, then the next one
        try:
            dist.all_reduce(torch.ones(4))
            outcomes.append("completed")
        except dist.DistBackendError as err:
            outcomes.append(f"failed: {err}")
    return outcomes


@scenario
def after_timeout(tmp_path: Path) -> list[list[str]]:
    with _raise_policy_world(3, tmp_path) as world:
        return world.run(_late_rank_after_a_timeout)


def test_after_a_timeout_every_rank_sees_the_group_failed(scenarios) -> None:
    results = scenarios("after_timeout")
    for rank in (0, 2):
        first, second = results[rank]
        assert first.startswith("failed:") and "timed out after 3 s" in first, results
        assert second.startswith("failed:") and "the group failed earlier" in second, results
    # The late rank must not complete the collective its peers gave up on (as NCCL's abort).
    late_first, late_second = results[1]
    assert late_first.startswith("failed:") and "the group failed earlier" in late_first, results
    assert late_second.startswith("failed:"), results


def _send_nobody_receives(rank: int, world_size: int) -> str:
    """Rank 0 sends to rank 1, which stays away; a first exchange set the pair up."""
    t = torch.arange(4.0)
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    _short_timeout(5)
    if rank == 1:
        time.sleep(7)  # past rank 0's 5 s timeout; it never receives either way
        return "late rank slept"
    try:
        dist.send(t, 1)
    except dist.DistBackendError as err:
        return str(err)
    return "no error"


@scenario
def p2p_watched(tmp_path: Path) -> tuple[list[str], str]:
    with _raise_policy_world(2, tmp_path) as world:
        results = world.run(_send_nobody_receives)
    return results, (tmp_path / "tpu_dist_fr_rank0.json").read_text()


def test_p2p_is_watched_from_before_dispatch(scenarios) -> None:
    # The send's programs wait until the peer runs them; it is under the watchdog from when
    # it was posted, as every collective is from before its dispatch, so it times out (a send
    # tracked only after its program started would hang here until the harness kills it).
    results, record = scenarios("p2p_watched")
    message = results[0]
    assert "timed out after 5 s" in message, message
    assert "send" in message and "collective #2 of group 'p2p:0->1'" in message, message
    assert "did not arrive: [1]" in message, message
    assert '"send"' in record and "p2p:0->1" in record


def _p2p_to_a_dead_peer(rank: int, world_size: int) -> None:
    """Rank 1 dies; rank 0's isend to it fails from its own work, not from the all_reduce of
    group {0, 2} issued after it."""
    pair = dist.new_group([0, 2])
    t = torch.ones(4)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        return
    time.sleep(1.0)  # rank 1 is gone
    work = dist.isend(t, 1) if rank == 0 else None
    total = torch.full((2,), float(rank))
    dist.all_reduce(total, group=pair)
    assert total.tolist() == [2.0, 2.0], total
    if work is None:
        raise RuntimeError("RESULT all_reduce ok")
    try:
        work.wait()
    except dist.DistBackendError as err:
        raise RuntimeError(f"RESULT all_reduce ok; isend.wait() raised: {err}") from None
    raise RuntimeError("RESULT all_reduce ok; isend.wait() returned")


@scenario
def p2p_dead_peer(tmp_path: Path) -> WorldError:
    with World(3, backend="tpu", env=FAST, timeout=60, failure_grace=20) as world:
        return _failure(world, _p2p_to_a_dead_peer)


def test_p2p_failure_surfaces_from_its_own_work(scenarios) -> None:
    err = scenarios("p2p_dead_peer")
    assert err.exitcodes.get(1) == -signal.SIGKILL, err
    assert "RESULT all_reduce ok" in err.errors.get(2, ""), err
    zero = err.errors.get(0, "")
    assert "RESULT all_reduce ok; isend.wait() raised" in zero, err
    assert "send (peer 1, tag 0)" in zero and "p2p:0->1" in zero, zero
