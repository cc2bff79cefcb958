"""The watchdog's decisions, one process, on a clock of the test's own (unit tier).

A :class:`~tpu_dist.collectives._watchdog.Watchdog` without its threads: the test calls
``beat()`` (one heartbeat: write this rank's, read the peers' and the failure notes) and
``look()`` (one look at the calls in flight) itself, and moves the watchdog's clock, so each
rule is checked at the second it applies instead of after real sleeps. The store is a real
c10d store (``HashStore``, or a ``TCPStore`` whose server is gone); the peers are this test
writing their heartbeats and notes into it, as their watchdogs would; the call is a real
``TPUWork`` whose program never starts (its peers never come).

The rules (the module's docstring): a peer that noted its exit fails the call within two
intervals, under either policy; a silent or stopped peer gets the group's timeout, never the
heartbeat's; past the timeout the error names the ranks behind and those stopped; a store that
fails every request fails the call after the heartbeat timeout; a failure note of the group
fails its calls on every rank and refuses new ones.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tpu_dist.collectives import _watchdog
from tpu_dist.collectives._types import Call, Kind, ProgramKey
from tpu_dist.collectives._work import TPUWork

HEARTBEAT_TIMEOUT = 10.0
INTERVAL = 1.0
GROUP_TIMEOUT = 30.0
RANKS = [0, 1, 2]


class Clock:
    """The watchdog's seconds, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def _flight_records_here(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TPU_DIST_FLIGHT_RECORDER_DIR", str(tmp_path / "flight"))


def _new_watchdog(store: dist.Store, clock: Clock, policy: str = "raise") -> _watchdog.Watchdog:
    return _watchdog.Watchdog(
        store, 0, len(RANKS), policy, HEARTBEAT_TIMEOUT, INTERVAL, clock=clock, threads=False
    )


def _issue(dog: _watchdog.Watchdog, group: str = "g", seq: int = 1) -> TPUWork:
    """Collective ``seq`` of ``group`` issued on rank 0 and tracked: its program never starts."""
    work = TPUWork("all_reduce", poll=True)
    work.start_later(concurrent.futures.Future(), lambda outs: outs)
    key = ProgramKey(Kind.ALLREDUCE, (0, 1, 2), ((4, "float32"),), ("SUM",), "xla")
    call = Call("all_reduce", group, tuple(RANKS), seq, key, timedelta(seconds=GROUP_TIMEOUT))
    work.on_done(_watchdog.track(dog, work, call))
    return work


def _heartbeat(store: dist.Store, peer: int, beats: int, progress: str = "") -> None:
    """What ``peer``'s heartbeat thread writes: ``count|group=seq,...|waiting``."""
    store.set(f"heartbeat/{peer}", f"{beats}|{progress}|")


def _error(work: TPUWork) -> str:
    """The error ``work`` failed with (it must have failed: nothing waits here)."""
    assert work.is_completed(), "the watchdog did not fail the call"
    with pytest.raises(dist.DistBackendError) as info:
        work.wait()
    return str(info.value)


def _tick(dog: _watchdog.Watchdog, clock: Clock, seconds: float) -> None:
    """``seconds`` of the threads' life: a look and a heartbeat every interval."""
    for _ in range(int(seconds / INTERVAL)):
        clock.advance(INTERVAL)
        dog.look()
        dog.beat()


def test_a_silent_peer_gets_the_groups_timeout_not_the_heartbeats() -> None:
    store, clock = dist.HashStore(), Clock()
    dog = _new_watchdog(store, clock)
    work = _issue(dog)
    _heartbeat(store, 1, 1, "g=1")  # rank 1 issued the call; rank 2 never did
    _heartbeat(store, 2, 1)
    _tick(dog, clock, GROUP_TIMEOUT - INTERVAL)  # both silent from here, past the heartbeat's
    assert not work.is_completed()
    _tick(dog, clock, 2 * INTERVAL)
    message = _error(work)
    assert "all_reduce (collective #1 of group 'g', ranks [0, 1, 2]) on rank 0" in message
    assert f"timed out after {GROUP_TIMEOUT:.0f} s" in message, message
    assert "ranks that did not arrive: [2]" in message, message
    assert f"sent no heartbeat for more than {HEARTBEAT_TIMEOUT:g} s" in message, message
    # raise policy: the group is failed for every rank, through the store
    assert store.get("failed_group/g/0").decode().startswith("on rank 0:")


def test_a_peer_that_exited_fails_the_call_within_two_intervals_under_either_policy() -> None:
    store, clock = dist.HashStore(), Clock()
    dog = _new_watchdog(store, clock, policy="abort")  # abort ends the process, but not for this
    work = _issue(dog)
    _tick(dog, clock, 2 * INTERVAL)
    store.set("exited/1", "1")
    _tick(dog, clock, INTERVAL)  # the heartbeat sees the note
    assert not work.is_completed()  # not yet: XLA's own error comes first if it can
    _tick(dog, clock, 3 * INTERVAL)
    message = _error(work)
    assert "rank(s) 1 (exited) will not join it" in message, message


def test_a_stopped_peer_is_waited_for_then_named() -> None:
    store, clock = dist.HashStore(), Clock()
    stopped = subprocess.Popen(["sleep", "120"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while _watchdog._pid_state(stopped.pid) != "stopped":  # the kernel delivers it later
            assert time.monotonic() < deadline, "sleep did not stop"
            time.sleep(0.01)
        store.set("process/2", f"{_watchdog._host_id()} {stopped.pid}")  # rank 2 runs here
        dog = _new_watchdog(store, clock)
        work = _issue(dog)
        _heartbeat(store, 1, 1, "g=1")
        _tick(dog, clock, GROUP_TIMEOUT - INTERVAL)
        assert not work.is_completed()  # stopped is not gone: it may be resumed
        _tick(dog, clock, 2 * INTERVAL)
        message = _error(work)
        assert "rank(s) [2] are stopped (SIGSTOP" in message, message
    finally:
        stopped.kill()
        stopped.wait()


def test_a_store_that_fails_every_request_fails_the_call_after_the_heartbeat_timeout() -> None:
    clock = Clock()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=2))
    dog = _new_watchdog(client, clock)
    work = _issue(dog)
    _tick(dog, clock, 2 * INTERVAL)
    del server  # rank 0's process with env:// rendezvous, gone
    _tick(dog, clock, HEARTBEAT_TIMEOUT - INTERVAL)
    assert not work.is_completed()
    _tick(dog, clock, 3 * INTERVAL)
    message = _error(work)
    assert "the c10d store has failed every request for" in message, message


def test_a_failure_note_fails_the_groups_calls_and_refuses_new_ones() -> None:
    store, clock = dist.HashStore(), Clock()
    dog = _new_watchdog(store, clock)
    dog.group_created("g")
    work = _issue(dog)
    other = _issue(dog, group="h")
    store.set("failed_group/g/0", "on rank 2: all_reduce timed out")  # rank 2's watchdog
    dog.beat()
    dog.look()
    message = _error(work)
    assert "the group failed (on rank 2: all_reduce timed out)" in message, message
    assert not other.is_completed()  # another group is not touched
    with pytest.raises(dist.DistBackendError, match="the group failed earlier"):
        _issue(dog, seq=2)
    dog.group_created("g")  # re-created: usable again, the old note is the old group's
    dog.beat()
    assert not _issue(dog, seq=1).done
