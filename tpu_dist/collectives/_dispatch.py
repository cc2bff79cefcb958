"""Dispatch: the one ordered way programs of "tpu" groups are started in a process.

Built by the runtime (the composition root, :mod:`._runtime`), one of each per process, and
handed to every group's pipeline (:mod:`._pipeline`):

* :class:`Dispatcher` starts the collectives' XLA programs in the order every rank agrees on
  (inline when it can, else on the helper thread of their device set, a :class:`Lane`);
* :class:`DeviceSets` counts the groups over each set of devices: calls on a set that two
  groups share need the ranks to agree on their order first (:class:`Dispatcher`).

The pipelines plan and track each call, then hand its program here. Point-to-point ops take
channels of their own (:mod:`._p2p`, on :class:`Lane` threads too).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args

import torch

from tpu_dist.collectives import _plan_algorithms
from tpu_dist.collectives._types import Kind, ProgramKey

if TYPE_CHECKING:
    from tpu_dist.collectives._lowering import ProgramCache

logger = logging.getLogger(__name__)

Ticket = tuple[int, int, int]
"""Where a call stands among the calls on its device set: (index of its group among the groups
over that set, the group's sequence number, 0 for a DETAIL check and 1 for the call itself)."""


@dataclass
class _Job:
    """One program for the dispatcher to start."""

    future: concurrent.futures.Future
    key: ProgramKey
    devices: Sequence
    arrays: list
    ticket: Ticket | None = None
    """Set for a call on a device set that several groups share (:class:`Dispatcher`)."""


_LANE_IDLE_SECONDS = 10.0
"""How long a :class:`Lane`'s thread waits for its next job before it ends (a new one starts
with the next job)."""


class Lane:
    """A helper thread that runs the jobs handed to it one at a time, in the order given.

    The thread starts with the first job and ends after :data:`_LANE_IDLE_SECONDS` without
    one (the next job starts a new one), so a process that used many device sets once does
    not keep a thread for each. A daemon thread: one stuck in a collective whose peer is gone
    must not keep the process from exiting (a ThreadPoolExecutor's worker would).
    """

    def __init__(self, name: str, run: Callable[[object], None]) -> None:
        """``run(job)`` must not raise (a job's failure belongs to its own future)."""
        self._name = name
        self._run = run
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, job: object) -> None:
        """Run ``job`` on the lane's thread after every job handed to it before."""
        with self._lock:
            self._jobs.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_LANE_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:  # put() starts a new thread once this one is marked gone
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            try:
                self._run(job)
            except BaseException:  # a bug: logged, and the lane stays alive for the others
                logger.exception("tpu_dist: %s: a job failed outside its own future", self._name)
            job = None  # not kept while this thread waits: its arrays hold the call's tensors


@dataclass
class _SetState:
    """What the dispatcher keeps per device set (sorted device ids)."""

    lane: Lane
    queued: int = 0
    """Jobs handed to the lane and not started yet (the agreement's waiting ones included)."""
    waiting: dict[Ticket, _Job] = field(default_factory=dict)
    """On a shared set: the calls waiting for the ranks' agreement, by ticket, in arrival
    order."""
    awaited: Ticket | None = None
    """On a shared set: the call all ranks agreed on that has not been issued here yet."""


class Dispatcher:
    """Starts XLA programs in call order per device set, each set's on its own helper thread.

    XLA:CPU runs small programs inline, inside dispatch, and the first call of a program sets
    up communicators there: either blocks the caller until every peer has arrived. An
    ``async_op=True`` call must return at once, so its program starts on the helper thread of
    its device set (a :class:`Lane`); with TPU_DIST_TIMEOUT_POLICY=raise every call starts
    there, so that the caller waits where the watchdog's error reaches it. Programs on one
    device set must start in the same order on every rank, so while a set's helper thread has
    programs to start, every other program on that set starts there too
    (:meth:`run_in_order`); when it is idle, synchronous calls start inline, with no thread
    hop.

    Device sets are independent. XLA keys its communicators by device set, so programs on
    different sets never meet each other's messages, and the order in which they start does
    not matter. Each set has a helper thread of its own, so that no program waits behind
    another set's: with one thread for the process, a program for set B queued behind an
    order agreement of set A (which blocks until every rank of A has joined) deadlocked
    against a rank that had started B first and joined A only after it (issue 48: two threads
    over WORLD and a pair group, with a ``new_group`` of all ranks alive; a mesh's ``dp``,
    flattened ``dp_cp`` and ``tp`` from three threads). Threads driving groups over different
    ranks stay independent, as on gloo, whatever the sets share.

    Programs started from different threads. XLA:CPU runs the programs one thread starts in
    that order, but a program started from another thread does not wait for them: it can run
    while they do (measured, jaxlib 0.10.2: an inline program finished while an all_reduce the
    helper thread had started was still running). Programs whose messages carry no order of
    their own then meet the wrong peer message: two point-to-point programs between the same
    pair (gloo sends and receives tagged 0) swapped their data, with no error, or aborted on
    gloo's size check. So "idle" means more than an empty queue: a program starts inline only
    when the last program started on its devices was started by this thread or is done
    (else it starts on the set's thread, behind it), and a set's thread waits for a program
    another thread started inline on the same devices before it starts one there.

    Groups over the same devices. XLA keys its communicators by the set of devices a program
    runs on (``gloo/<device ids>`` on CPU, one gloo context per set, every message tagged 0),
    so two groups over the same ranks share one communicator, where torch's gloo gives each
    group its own. Calls of two such groups issued from two threads reach XLA in a different
    order on different ranks, and then one rank's all_reduce of group A meets the other's of
    group B: wrong numbers when the sizes agree, gloo's abort when they do not. So every call
    on a device set that two or more groups share starts on the set's thread, and the ranks
    agree on the order first: each rank offers its oldest waiting call's :data:`Ticket` in a
    small all-gather over the set (one extra program per call, only on shared sets), all take
    the smallest ticket offered, and each starts that call as soon as it has been issued
    locally. One call starts per round, so every rank starts the same calls in the same order.
    When every group over the set is one of the same family (a mesh dimension and a dimension
    flattened to the same ranks, as HSDP's and TorchTitan's meshes have), the all-gather is
    that family's program, as the groups' own calls are (:func:`agreement_key`; TPU v5e and v6e
    compile no other program over part of a slice). An agreement blocks only its own set's
    thread.
    """

    def __init__(
        self,
        programs: ProgramCache,
        to_jax: Callable[[torch.Tensor], object],
        to_torch: Callable[[object], torch.Tensor],
        device_sets: DeviceSets,
    ) -> None:
        """``programs``: the process's compiled programs; ``to_jax``/``to_torch``: the runtime's
        hand-off of a tensor to this rank's device and back (for the order agreement);
        ``device_sets``: the process's groups by device set (the agreement's family)."""
        self._programs = programs
        self._device_sets = device_sets
        self._to_jax = to_jax
        self._to_torch = to_torch
        self._lock = threading.Lock()
        self._sets: dict[tuple[int, ...], _SetState] = {}
        # Per device set (sorted ids): the thread that started the last program on it and
        # weak references to that program's result blocks, while it runs ("Programs started
        # from different threads").
        self._running: dict[tuple[int, ...], tuple[threading.Thread, list]] = {}

    def submit(
        self, key: ProgramKey, devices, arrays, ticket: Ticket | None = None
    ) -> concurrent.futures.Future:
        """Start ``key``'s program after every earlier one on its devices, on their helper
        thread; the future holds its result blocks.

        With a ``ticket``, the program starts in the order the ranks agree on (class doc).
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        device_set = device_set_of(devices)
        with self._lock:
            state = self._sets.get(device_set)
            if state is None:
                name = f"tpu_dist-dispatch-{'-'.join(map(str, device_set))}"
                lane = Lane(name, lambda job, ids=device_set: self._run_job(ids, job))
                state = self._sets[device_set] = _SetState(lane)
            state.queued += 1
        state.lane.put(_Job(future, key, devices, list(arrays), ticket))
        return future

    def run_in_order(self, key: ProgramKey, devices, arrays) -> list:
        """Start ``key``'s program now, inline, unless earlier ones on its devices are still
        queued on their helper thread or a program another thread started on them is still
        running (then on the helper thread)."""
        me, device_set = threading.current_thread(), device_set_of(devices)
        state = self._sets.get(device_set)
        if (state is None or state.queued == 0) and not self._running_elsewhere(device_set, me):
            return self._started(device_set, me, self._programs.run(key, devices, arrays))
        return self.submit(key, devices, arrays).result()

    def _started(self, device_set: tuple[int, ...], thread: threading.Thread, outs: list) -> list:
        """Note ``outs`` as the last program started on ``device_set`` (by ``thread``), by
        weak references: a result block its work has copied and dropped is freed at once,
        not kept here until the next program on the set (issue 51)."""
        running = not _all_ready(outs)
        with self._lock:
            if running:
                self._running[device_set] = (thread, [weakref.ref(out) for out in outs])
            else:
                self._running.pop(device_set, None)
        return outs

    def _running_elsewhere(self, device_set: tuple[int, ...], me: threading.Thread) -> bool:
        """Whether the last program on ``device_set`` was started by a thread other than
        ``me`` and is still running.

        A finished one is forgotten (also ``me``'s): its result blocks are not kept alive here
        (a 1 GiB all_reduce's result is freed when its caller is done with it).
        """
        with self._lock:
            last = self._running.get(device_set)
        if last is None:
            return False
        thread, outs = last
        if _all_ready(_alive(outs)):
            with self._lock:
                if self._running.get(device_set) is last:
                    del self._running[device_set]
            return False
        return thread is not me

    def _wait_for_others(self, device_set: tuple[int, ...], me: threading.Thread) -> None:
        """Block until the last program on ``device_set`` is done if a thread other than
        ``me`` started it (a failure is reported by that program's own work)."""
        if not self._running_elsewhere(device_set, me):
            return
        with self._lock:
            last = self._running.get(device_set)
        if last is None:
            return
        for out in _alive(last[1]):
            try:
                out.block_until_ready()
            except Exception:  # noqa: BLE001 (the failure is reported by its own work)
                pass
        with self._lock:
            if self._running.get(device_set) is last:
                del self._running[device_set]

    def _run_job(self, device_set: tuple[int, ...], job: _Job) -> None:
        """On ``device_set``'s helper thread: start ``job`` (or order it first)."""
        state = self._sets[device_set]
        if job.ticket is None:
            self._start(state, job)
        else:
            self._order(state, job)

    def _start(self, state: _SetState, job: _Job) -> None:
        me, device_set = threading.current_thread(), device_set_of(job.devices)
        self._wait_for_others(device_set, me)
        try:
            outs = self._programs.run(job.key, job.devices, job.arrays)
            self._started(device_set, me, outs)
        except BaseException as err:  # handed to whoever waits on the future
            self._one_started(state)
            settle(job.future, error=err)
        else:
            self._one_started(state)
            settle(job.future, outs)

    def _order(self, state: _SetState, job: _Job) -> None:
        """Start the calls of ``job``'s device set in the order every rank agrees on."""
        devices = sorted(job.devices, key=lambda d: d.id)
        waiting = state.waiting
        waiting[job.ticket] = job
        while waiting:
            awaited = state.awaited
            if awaited is not None:
                if awaited not in waiting:
                    return  # the agreed call has not been issued here yet
                state.awaited = None
                self._start(state, waiting.pop(awaited))
                continue
            offer = next(iter(waiting))
            try:
                agreed = min(self._agree(devices, offer))
            except BaseException as err:  # the set is broken: every call on it fails
                for failed in waiting.values():
                    self._one_started(state)
                    settle(failed.future, error=err)
                waiting.clear()
                return
            if agreed in waiting:
                self._start(state, waiting.pop(agreed))
            else:
                state.awaited = agreed

    def _agree(self, devices: list, offer: Ticket) -> list[Ticket]:
        """All-gather every rank's offered ticket over ``devices`` (sorted by id)."""
        ids = tuple(d.id for d in devices)
        key = agreement_key(
            ids, devices[0].platform, self._device_sets.family(ids), devices[0].device_kind
        )
        mine = self._to_jax(torch.tensor(offer, dtype=torch.int32))
        self._wait_for_others(ids, threading.current_thread())
        (gathered,) = self._programs.run(key, devices, [mine])
        gathered.block_until_ready()
        rows = self._to_torch(gathered).view(len(ids), len(offer)).tolist()
        return [tuple(row) for row in rows]

    def _one_started(self, state: _SetState) -> None:
        with self._lock:
            state.queued -= 1


def agreement_key(
    device_ids: tuple[int, ...],
    platform: str,
    family: tuple[tuple[int, ...], ...] = (),
    device_kind: str = "",
) -> ProgramKey:
    """The program the ranks of a shared device set agree on their calls' order with: an
    all-gather of each rank's :data:`Ticket` over ``device_ids``; given the ``family`` (device
    ids of each group) that every group over the set belongs to, that family's program where
    the group's calls run as family programs (:func:`._plan_algorithms.program_key`)."""
    blocks = ((len(get_args(Ticket)), "int32"),)
    return _plan_algorithms.program_key(
        Kind.ALLGATHER, device_ids, blocks, (), platform, family, device_kind
    )


def settle(
    future: concurrent.futures.Future, outs: list | None = None, error: BaseException | None = None
) -> None:
    """Resolve ``future`` (a program's start) with ``outs``, or fail it with ``error``, unless
    its work was interrupted meanwhile (:meth:`._work.TPUWork.interrupt` failed it first)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outs)
    except concurrent.futures.InvalidStateError:
        pass


def device_set_of(devices: Sequence) -> tuple[int, ...]:
    """The sorted ids of ``devices``: what XLA keys a program's communicator by."""
    return tuple(sorted(d.id for d in devices))


def _alive(refs: list) -> list:
    """The result blocks behind ``refs`` (weak references) that still exist: a gone one was
    waited for and dropped by its work."""
    return [out for out in (ref() for ref in refs) if out is not None]


def _all_ready(outs: list) -> bool:
    """Whether every result block in ``outs`` is computed (or already handed out and gone)."""
    for out in outs:
        try:
            if not out.is_ready():
                return False
        except Exception:  # noqa: BLE001 (deleted after its data was taken: done)
            continue
    return True


class DeviceSets:
    """How many "tpu" groups of this process are over each set of devices (sorted ids), and the
    family each is one of.

    The same on every member rank, since groups are created (and destroyed) and registered as
    one of a family by every member in the same order; a group's index on its set
    (:meth:`add`) is never reused.
    """

    def __init__(self) -> None:
        # Per device set: the family (sorted device ids of each group, the groups sorted; ()
        # for none) of each live group, by its index on the set.
        self._live: dict[tuple[int, ...], dict[int, tuple[tuple[int, ...], ...]]] = {}
        self._created: dict[tuple[int, ...], int] = {}
        self._lock = threading.Lock()  # groups are made on one thread, agreed on on another

    def add(self, device_set: tuple[int, ...]) -> int:
        """Count a new group over ``device_set``; returns its index among the groups ever
        created over that set."""
        with self._lock:
            index = self._created.get(device_set, 0)
            self._created[device_set] = index + 1
            self._live.setdefault(device_set, {})[index] = ()
        return index

    def set_family(
        self, device_set: tuple[int, ...], index: int, family: tuple[tuple[int, ...], ...]
    ) -> None:
        """The group ``index`` over ``device_set`` is one of ``family`` (device ids of each
        group; () for none). Families are compared as sets of device sets: a dimension in
        mesh order and one flattened to the same ranks, sorted, are one family."""
        same = tuple(sorted(tuple(sorted(group)) for group in family))
        with self._lock:
            self._live[device_set][index] = same

    def remove(self, device_set: tuple[int, ...], index: int) -> None:
        """The group ``index`` over ``device_set`` was destroyed."""
        with self._lock:
            del self._live[device_set][index]

    def shared(self, device_set: tuple[int, ...]) -> bool:
        """Whether two or more live groups run over ``device_set`` (of two or more devices)."""
        with self._lock:
            return len(device_set) >= 2 and len(self._live.get(device_set, ())) >= 2

    def family(self, device_set: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The family every live group over ``device_set`` is one of (as :meth:`set_family`
        keeps it), or () when one is of none or two are of different families."""
        with self._lock:
            families = set(self._live.get(device_set, {}).values())
        return families.pop() if len(families) == 1 else ()
