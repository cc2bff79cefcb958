"""Malformed settings fail ``init_process_group`` on every rank with a ValueError (issue 34).

``tests/test_settings.py`` checks the parsing in one process; here two ranks start a "tpu"
world with a malformed ``TPU_DIST_*`` variable, and both must raise the ``ValueError`` that
names it, before anything starts. Before, the rank that read the value first raised (rank 0
only, for the coordinator's address; after JAX had started, for the timeout policy) and its
death ended the other (SIGABRT from JAX's client once rank 0's coordination service went);
other values were accepted and failed later, far from their cause.

An address where no coordination service listens is an error naming the address on every
rank within the group's timeout (3 s here), instead of JAX's client retrying in silence and
then ending both processes (48 s, then SIGABRT).
"""

from __future__ import annotations

import datetime
import time

import pytest

from tests.harness import World, WorldError
from tests.launch_worker import free_port


def _start_failure(env: dict[str, str], init_timeout_s: float = 60) -> tuple[WorldError, float]:
    """Start a 2-rank "tpu" world with ``env``, which must fail; the error and how long."""
    world = World(
        2, backend="tpu", env={"TPU_DIST_PLATFORM": "cpu", **env}, start_timeout=120,
        failure_grace=30, init_kwargs={"timeout": datetime.timedelta(seconds=init_timeout_s)},
    )
    start = time.monotonic()
    try:
        with pytest.raises(WorldError) as caught:
            world.start()
    finally:
        world.close()
    return caught.value, time.monotonic() - start


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("TPU_DIST_TIMEOUT_POLICY", "bogus", "abort, raise"),  # was: rank 1 SIGABRT
        ("TPU_DIST_COORDINATOR_ADDRESS", "garbage", "host:port"),  # was: IndexError, rank 0
        ("TPU_DIST_COORDINATOR_ADDRESS", "127.0.0.1:notaport", "host:port"),
        ("TPU_DIST_COORDINATION_SERVICE", "garbage", "host:port"),  # was: int() error
        ("TPU_DIST_HEARTBEAT_TIMEOUT", "1e-9", "at least 0.1"),  # was: accepted
        ("TPU_DIST_EXIT_CODE", "abc", "0 to 255"),  # was: SIGABRT at exit
    ],
)
def test_every_rank_raises_the_value_error(name: str, value: str, accepted: str) -> None:
    err, _ = _start_failure({name: value})
    assert sorted(err.errors) == [0, 1], err
    for rank, trace in err.errors.items():
        assert f"ValueError: tpu_dist: malformed environment: {name}={value!r}" in trace, (
            rank, trace)
        assert accepted in trace, (rank, trace)
    # Nobody was ended by a signal (JAX's client aborts a rank whose service went away).
    assert all(code >= 0 for code in err.exitcodes.values()), err


def test_an_unreachable_coordination_service_is_an_error_in_bounded_time() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    err, took = _start_failure({"TPU_DIST_COORDINATION_SERVICE": address}, init_timeout_s=3)
    assert sorted(err.errors) == [0, 1], err
    for rank, trace in err.errors.items():
        assert "DistNetworkError" in trace, (rank, trace)
        assert f"rank {rank} could not connect to JAX's coordination service at {address}" in trace
        assert "set by TPU_DIST_COORDINATION_SERVICE" in trace and "within 3 s" in trace, trace
    assert all(code >= 0 for code in err.exitcodes.values()), err
    assert took < 60, took  # 3 s of waiting, plus starting two ranks on a loaded machine


def test_a_coordinator_address_rank_0_cannot_listen_on_is_an_error() -> None:
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is no host's address: JAX's service could not bind it
    # and ended rank 0 (SIGSEGV, "Failed to add port to server"), then JAX's client rank 1.
    address = f"192.0.2.1:{free_port()}"
    err, _ = _start_failure({"TPU_DIST_COORDINATOR_ADDRESS": address}, init_timeout_s=3)
    assert sorted(err.errors) == [0, 1], err
    assert f"rank 0 cannot host JAX's coordination service at {address}" in err.errors[0], err
    assert "set by TPU_DIST_COORDINATOR_ADDRESS" in err.errors[0], err
    # Rank 1 fails on the store rank 0 hosted (gone with it) or, if rank 0 is still up, on the
    # address it published; either way an error, not a signal.
    assert "DistNetworkError" in err.errors[1] or "DistStoreError" in err.errors[1], err
    assert all(code >= 0 for code in err.exitcodes.values()), err
