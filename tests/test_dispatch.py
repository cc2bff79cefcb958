"""The dispatcher's ordering guarantees, one process, with threads (unit tier).

:class:`~tpu_dist.collectives._dispatch.Dispatcher` takes the process's program cache and
hands it each program to start (``programs.run(key, devices, blocks)``, which returns the
program's result blocks at once, still computing). Here the program cache is the test's: each
program is a function of the test that records where and when it started, and may hold its
start until the test releases it (an event), so each rule is checked at the moment it applies,
with no sleep standing in for a clock. Result blocks are real JAX arrays, or a block of the
test's whose program finishes when the test says (:class:`Block`). Devices are ids, as XLA
keys its communicators by them.

The rules (the module's docstring): programs on one device set start in the order they were
handed over, on the set's helper thread while it has any, inline when it is idle; a program
another thread started inline on the same devices is waited for; different device sets never
wait for each other, whatever devices they share; a program's error reaches its caller and
the set carries on; calls of groups that share a device set start in the order every rank
agrees on. Every wait is bounded (:data:`WAIT`): a hang fails the test.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpu_dist.collectives import _dispatch
from tpu_dist.collectives._dispatch import (
    DeviceSets,
    Dispatcher,
    Lane,
    agreement_key,
    settle,
)
from tpu_dist.collectives._types import Kind, ProgramKey

WAIT = 30.0
"""Seconds any wait of a test may take before it fails (a hang, not a slow machine)."""


@dataclasses.dataclass(frozen=True)
class Device:
    """What the dispatcher reads of a JAX device."""

    id: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def devices(*ids: int) -> list[Device]:
    return [Device(i) for i in ids]


class Block:
    """A result block whose program finishes when the test calls :meth:`finish` (a jax.Array's
    ``is_ready`` and ``block_until_ready``)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited_on = threading.Event()
        """Set when someone blocks until it is ready."""

    def is_ready(self) -> bool:
        return self.done.is_set()

    def block_until_ready(self) -> Block:
        self.waited_on.set()
        if not self.done.wait(WAIT):
            raise TimeoutError("the test never finished this program")
        return self

    def finish(self) -> None:
        self.done.set()


class Programs:
    """The program cache as the dispatcher uses it: ``run(key, devices, blocks)``.

    A program is ``key``'s function in :attr:`programs` (given the blocks, returns the result
    blocks), else it returns its blocks. Every start is noted in :attr:`started` as (key, name
    of the thread that started it), in start order.
    """

    def __init__(self) -> None:
        self.programs: dict[object, Callable[[list], list]] = {}
        self.started: list[tuple[object, str]] = []
        self._lock = threading.Lock()

    def run(self, key: object, devices: list, blocks: list) -> list:
        with self._lock:
            self.started.append((key, threading.current_thread().name))
        program = self.programs.get(key)
        return program(blocks) if program is not None else list(blocks)

    def started_keys(self) -> list[object]:
        with self._lock:
            return [key for key, _ in self.started]

    def thread_of(self, key: object) -> str:
        with self._lock:
            (name,) = [name for k, name in self.started if k == key]
        return name

    def hold(self, key: object) -> tuple[threading.Event, threading.Event]:
        """Make ``key``'s program wait, once started, until the test sets the second event
        returned; the first is set when it has started."""
        started, release = threading.Event(), threading.Event()

        def program(blocks: list) -> list:
            started.set()
            if not release.wait(WAIT):
                raise TimeoutError(f"the test never released {key!r}")
            return list(blocks)

        self.programs[key] = program
        return started, release


def to_jax(tensor: torch.Tensor) -> object:
    return jnp.asarray(tensor.numpy())


def to_torch(array: object) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


def new_dispatcher(programs: Programs, sets: DeviceSets | None = None) -> Dispatcher:
    return Dispatcher(programs, to_jax, to_torch, sets or DeviceSets())


def lane_name(*ids: int) -> str:
    return f"tpu_dist-dispatch-{'-'.join(map(str, ids))}"


def in_thread(fn: Callable[[], object]) -> concurrent.futures.Future:
    """Run ``fn`` on a new thread; its result (or error) in the future returned."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def body() -> None:
        try:
            future.set_result(fn())
        except BaseException as err:  # noqa: BLE001 (handed to the test)
            future.set_exception(err)

    threading.Thread(target=body, daemon=True).start()
    return future


def must(event: threading.Event, what: str) -> None:
    assert event.wait(WAIT), f"timed out waiting until {what}"


# -- one device set ------------------------------------------------------------------------------


def test_programs_on_one_device_set_start_in_the_order_handed_over() -> None:
    programs = Programs()
    dispatcher = new_dispatcher(programs)
    first_started, release = programs.hold("p0")
    futures = [dispatcher.submit("p0", devices(0, 1), [jnp.full(2, 0.0)])]
    must(first_started, "the first program started")
    # Handed over while the first still holds the set's thread: they queue behind it.
    futures += [
        dispatcher.submit(f"p{i}", devices(1, 0), [jnp.full(2, float(i))]) for i in range(1, 6)
    ]
    release.set()
    results = [future.result(timeout=WAIT) for future in futures]
    assert [float(r[0][0]) for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert programs.started_keys() == ["p0", "p1", "p2", "p3", "p4", "p5"]
    # One thread for the set, whatever order its devices were given in.
    assert {name for _, name in programs.started} == {lane_name(0, 1)}


def test_a_synchronous_call_starts_inline_when_its_set_is_idle() -> None:
    programs = Programs()
    dispatcher = new_dispatcher(programs)
    (out,) = dispatcher.run_in_order("now", devices(0, 1), [jnp.arange(3.0)])
    assert out.tolist() == [0.0, 1.0, 2.0]
    assert programs.thread_of("now") == threading.current_thread().name
    # Still inline after the set's thread has run a program and gone idle.
    dispatcher.submit("queued", devices(0, 1), [jnp.zeros(1)]).result(timeout=WAIT)
    dispatcher.run_in_order("again", devices(0, 1), [jnp.zeros(1)])
    assert programs.thread_of("again") == threading.current_thread().name


class ObservedDispatcher(Dispatcher):
    """A Dispatcher that says when a program was handed to a set's thread (:meth:`submit`,
    which :meth:`run_in_order` calls for a program it does not start inline)."""

    def __init__(self, programs: Programs) -> None:
        super().__init__(programs, to_jax, to_torch, DeviceSets())
        self.handed_over: list[object] = []
        self.handed_over_event = threading.Event()

    def submit(self, key, devices, arrays, ticket=None) -> concurrent.futures.Future:
        future = super().submit(key, devices, arrays, ticket)
        self.handed_over.append(key)
        self.handed_over_event.set()
        return future


def test_a_synchronous_call_waits_behind_the_programs_queued_on_its_set() -> None:
    programs = Programs()
    dispatcher = ObservedDispatcher(programs)
    started, release = programs.hold("async")
    queued = dispatcher.submit("async", devices(0, 1), [jnp.zeros(1)])
    must(started, "the queued program started")
    dispatcher.handed_over_event.clear()
    sync = in_thread(lambda: dispatcher.run_in_order("sync", devices(0, 1), [jnp.ones(1)]))
    # Released only once the call was handed to the set's thread (else it started inline
    # while the queued program was still running: the "sync" assertions below fail).
    must(dispatcher.handed_over_event, "the synchronous call was handed to the set's thread")
    release.set()
    assert queued.result(timeout=WAIT)[0].tolist() == [0.0]
    assert sync.result(timeout=WAIT)[0].tolist() == [1.0]
    # Behind the queued program, on the set's thread: never inline on the caller's.
    assert programs.started_keys() == ["async", "sync"]
    assert programs.thread_of("sync") == lane_name(0, 1)
    assert dispatcher.handed_over == ["async", "sync"]


def test_a_program_another_thread_started_inline_is_waited_for() -> None:
    """XLA:CPU does not order programs started from different threads: a program the set's
    thread starts waits until the one another thread started inline on the same devices is
    done."""
    programs = Programs()
    dispatcher = new_dispatcher(programs)
    running = Block()
    programs.programs["inline"] = lambda blocks: [running]
    assert in_thread(
        lambda: dispatcher.run_in_order("inline", devices(0, 1), [jnp.zeros(1)])
    ).result(timeout=WAIT) == [running]
    # Still computing, and started by another thread: this call goes to the set's thread,
    # which waits for it before it starts the next program.
    after = in_thread(lambda: dispatcher.run_in_order("after", devices(0, 1), [jnp.ones(1)]))
    must(running.waited_on, "the set's thread waited for the running program")
    assert programs.started_keys() == ["inline"]
    running.finish()
    assert after.result(timeout=WAIT)[0].tolist() == [1.0]
    assert programs.started_keys() == ["inline", "after"]
    assert programs.thread_of("after") == lane_name(0, 1)


def test_a_threads_own_running_program_does_not_hold_its_next_call() -> None:
    programs = Programs()
    dispatcher = new_dispatcher(programs)
    running = Block()
    programs.programs["first"] = lambda blocks: [running]
    dispatcher.run_in_order("first", devices(0, 1), [jnp.zeros(1)])
    # The same thread's programs run in the order it starts them: inline, no wait.
    dispatcher.run_in_order("second", devices(0, 1), [jnp.zeros(1)])
    assert programs.thread_of("second") == threading.current_thread().name
    assert not running.waited_on.is_set()
    running.finish()


# -- several device sets -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [(2, 3), (0, 1), (1, 2), (0, 1, 2, 3, 4)],
    ids=["disjoint", "a-subset", "overlapping", "a-superset"],
)
def test_a_device_set_never_waits_for_another(other: tuple[int, ...]) -> None:
    """A program held on one set's thread (as an order agreement waits for its ranks) does not
    hold up another set's, whatever devices they share (issue 48)."""
    programs = Programs()
    dispatcher = new_dispatcher(programs)
    started, release = programs.hold("held")
    held = dispatcher.submit("held", devices(0, 1, 2, 3), [jnp.zeros(1)])
    must(started, "the held program started")
    try:
        free = dispatcher.submit("free", devices(*other), [jnp.ones(1)])
        assert free.result(timeout=WAIT)[0].tolist() == [1.0]
        inline = dispatcher.run_in_order("inline", devices(*other), [jnp.ones(1)])
        assert inline[0].tolist() == [1.0]
        assert not held.done()
    finally:
        release.set()
    held.result(timeout=WAIT)
    assert programs.thread_of("held") == lane_name(0, 1, 2, 3)
    assert programs.thread_of("free") == lane_name(*other)


# -- errors --------------------------------------------------------------------------------------


def test_a_programs_error_reaches_its_caller_and_the_set_carries_on() -> None:
    programs = Programs()
    dispatcher = new_dispatcher(programs)

    def broken(blocks: list) -> list:
        raise ValueError("tpu_dist test: program failed")

    programs.programs["broken"] = broken
    failed = dispatcher.submit("broken", devices(0, 1), [jnp.zeros(1)])
    with pytest.raises(ValueError, match="program failed"):
        failed.result(timeout=WAIT)
    assert dispatcher.submit("next", devices(0, 1), [jnp.ones(1)]).result(timeout=WAIT)
    # Nothing is left counted as queued: a synchronous call starts inline again.
    dispatcher.run_in_order("sync", devices(0, 1), [jnp.ones(1)])
    assert programs.thread_of("sync") == threading.current_thread().name
    with pytest.raises(ValueError, match="program failed"):
        dispatcher.run_in_order("broken", devices(0, 1), [jnp.zeros(1)])


def test_a_failed_order_agreement_fails_every_call_waiting_on_its_set() -> None:
    programs = Programs()
    sets = DeviceSets()
    group_a, group_b = sets.add((0, 1)), sets.add((0, 1))
    dispatcher = new_dispatcher(programs, sets)
    agree = agreement_key((0, 1), "cpu", (), "cpu")

    def lost(blocks: list) -> list:
        raise RuntimeError("tpu_dist test: a rank of the set is gone")

    programs.programs[agree] = lost
    call = dispatcher.submit("call", devices(0, 1), [jnp.zeros(1)], (group_a, 1, 1))
    with pytest.raises(RuntimeError, match="a rank of the set is gone"):
        call.result(timeout=WAIT)
    assert "call" not in programs.started_keys()
    later = dispatcher.submit("later", devices(0, 1), [jnp.zeros(1)], (group_b, 1, 1))
    with pytest.raises(RuntimeError, match="a rank of the set is gone"):
        later.result(timeout=WAIT)
    # Nothing is left counted as queued: a call without a ticket starts inline again.
    dispatcher.run_in_order("sync", devices(0, 1), [jnp.ones(1)])
    assert programs.thread_of("sync") == threading.current_thread().name


# -- groups that share a device set: the ranks agree on the order --------------------------------


class AllGather:
    """The order agreement's all-gather between the dispatchers of two ranks in this process:
    each offers its ticket, and both get both, in rank order."""

    def __init__(self, ranks: int) -> None:
        self._offers: list[list[int] | None] = [None] * ranks
        self._barrier = threading.Barrier(ranks, timeout=WAIT)

    def program(self, rank: int) -> Callable[[list], list]:
        def all_gather(blocks: list) -> list:
            (mine,) = blocks
            self._offers[rank] = np.asarray(mine).tolist()
            self._barrier.wait()  # every rank has offered
            gathered = jnp.asarray(self._offers, dtype=jnp.int32)
            self._barrier.wait()  # every rank has read: the next round may offer
            return [gathered]

        return all_gather


def _two_ranks(
    family: tuple[tuple[int, ...], ...] = (),
) -> tuple[list[Programs], list[Dispatcher], tuple[int, int]]:
    """Two ranks' dispatchers, each with two groups over devices (0, 1) (their indices
    returned), whose order agreements meet in one all-gather."""
    all_gather = AllGather(2)
    programs, dispatchers = [], []
    for rank in range(2):
        sets = DeviceSets()
        indices = sets.add((0, 1)), sets.add((0, 1))
        if family:
            for index in indices:
                sets.set_family((0, 1), index, family)
        rank_programs = Programs()
        agree = agreement_key((0, 1), "cpu", family, "cpu")
        rank_programs.programs[agree] = all_gather.program(rank)
        programs.append(rank_programs)
        dispatchers.append(new_dispatcher(rank_programs, sets))
    return programs, dispatchers, indices


def test_groups_sharing_a_device_set_start_their_calls_in_one_order_on_every_rank() -> None:
    """Rank 0 hands over group A's and group B's calls interleaved, rank 1 all of B's first
    (as two threads, one per group, may): both start them in the same order, each group's in
    its own order."""
    programs, dispatchers, (a, b) = _two_ranks()
    calls = {  # name -> Ticket: (the group's index on the set, its sequence number, 1)
        f"{prefix}{seq}": (group, seq, 1)
        for group, prefix in ((a, "A"), (b, "B"))
        for seq in (1, 2, 3)
    }
    issue_order = (["A1", "B1", "A2", "B2", "A3", "B3"], ["B1", "B2", "B3", "A1", "A2", "A3"])
    futures = []
    for rank, names in enumerate(issue_order):
        for name in names:
            call = dispatchers[rank].submit(name, devices(0, 1), [jnp.zeros(1)], calls[name])
            futures.append(call)
    for future in futures:
        future.result(timeout=WAIT)
    started = [[k for k in p.started_keys() if isinstance(k, str)] for p in programs]
    assert sorted(started[0]) == sorted(calls)
    assert started[0] == started[1]
    # The first round: rank 0 offers A1, rank 1 offers B1; the smallest ticket wins.
    assert started[0][0] == "A1"
    for prefix in "AB":
        own = [k for k in started[0] if k.startswith(prefix)]
        assert own == [f"{prefix}{i}" for i in (1, 2, 3)]


def test_the_order_agreement_of_one_familys_groups_is_that_familys_program() -> None:
    family = ((0, 1), (2, 3))
    programs, dispatchers, (a, _) = _two_ranks(family)
    futures = [
        dispatchers[rank].submit(f"call{rank}", devices(0, 1), [jnp.zeros(1)], (a, 1, 1))
        for rank in range(2)
    ]
    for future in futures:
        future.result(timeout=WAIT)
    (agreement,) = [k for k in programs[0].started_keys() if isinstance(k, ProgramKey)]
    assert agreement.kind == Kind.ALLGATHER
    assert agreement.groups == 2 and agreement.devices == (0, 1, 2, 3)
    assert agreement.blocks == ((3, "int32"),)  # a Ticket: three int32


# -- the parts -----------------------------------------------------------------------------------


def test_device_sets_count_live_groups_and_their_family() -> None:
    sets = DeviceSets()
    first = sets.add((0, 1))
    assert not sets.shared((0, 1))
    second = sets.add((0, 1))
    assert (first, second) == (0, 1) and sets.shared((0, 1))
    assert not sets.shared((2, 3))
    one = DeviceSets()
    one.add((0,)), one.add((0,))
    assert not one.shared((0,))  # one device: no communicator to share
    # A mesh dimension and one flattened to the same ranks, sorted: one family.
    sets.set_family((0, 1), first, ((2, 3), (0, 1)))
    assert sets.family((0, 1)) == ()  # the second group is of none yet
    sets.set_family((0, 1), second, ((1, 0), (3, 2)))
    assert sets.family((0, 1)) == ((0, 1), (2, 3))
    sets.remove((0, 1), first)
    assert not sets.shared((0, 1))
    assert sets.add((0, 1)) == 2  # an index is never reused
    assert sets.family((0, 1)) == ()


def test_agreement_keys_are_a_tickets_all_gather() -> None:
    own = agreement_key((0, 1), "cpu")
    assert own.kind == Kind.ALLGATHER and own.devices == (0, 1) and own.groups == 1
    assert own.blocks == ((3, "int32"),)
    assert agreement_key((0, 1), "cpu", ((0, 1), (2, 3))) == agreement_key(
        (2, 3), "cpu", ((0, 1), (2, 3))
    )  # every group of the family has the same program


def test_settle_keeps_the_first_outcome() -> None:
    future: concurrent.futures.Future = concurrent.futures.Future()
    settle(future, ["outs"])
    assert future.result(timeout=0) == ["outs"]
    interrupted: concurrent.futures.Future = concurrent.futures.Future()
    error = RuntimeError("tpu_dist test: the watchdog gave up")
    interrupted.set_exception(error)
    settle(interrupted, ["late outs"])  # the program started after its work failed: no error
    settle(interrupted, error=ValueError("late"))
    assert interrupted.exception(timeout=0) is error
    failed: concurrent.futures.Future = concurrent.futures.Future()
    settle(failed, error=error)
    assert failed.exception(timeout=0) is error


def test_a_lane_runs_its_jobs_in_order_and_survives_a_failing_one(caplog) -> None:
    ran: list[object] = []
    done = threading.Event()

    def run(job: object) -> None:
        if job == "bad":
            raise RuntimeError("tpu_dist test: a bug in run")
        ran.append(job)
        if job == "last":
            done.set()

    lane = Lane("test-lane", run)
    for job in [1, 2, "bad", 3, "last"]:
        lane.put(job)
    must(done, "the lane ran its last job")
    assert ran == [1, 2, 3, "last"]
    assert "a job failed outside its own future" in caplog.text


def test_an_idle_lanes_thread_ends_and_the_next_job_starts_a_new_one(monkeypatch) -> None:
    monkeypatch.setattr(_dispatch, "_LANE_IDLE_SECONDS", 0.05)
    threads: list[threading.Thread] = []
    ran = [threading.Event(), threading.Event()]

    def run(job: int) -> None:
        threads.append(threading.current_thread())
        ran[job].set()

    lane = Lane("test-lane", run)
    lane.put(0)
    must(ran[0], "the first job ran")
    threads[0].join(WAIT)
    assert not threads[0].is_alive(), "an idle lane's thread did not end"
    lane.put(1)
    must(ran[1], "the job after the idle time ran")
    assert threads[1] is not threads[0] and threads[1].name == "test-lane"
