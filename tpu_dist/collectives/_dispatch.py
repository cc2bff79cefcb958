"""Dispatch: the one ordered way programs of "tpu" groups are started in a process.

Built by the runtime (the composition root, :mod:`._runtime`), one of each per process, and
handed to every group's pipeline (:mod:`._pipeline`):

* :class:`Dispatcher` starts XLA programs, collectives and point-to-point alike, in the order
  every rank agrees on (inline when it can, else on its helper thread);
* :class:`P2PQueue` holds the point-to-point ops waiting to be dispatched: an XLA program
  needs both ends, so a send and its recv must run the same program in the same order on both
  ranks; queued ops are dispatched, sorted by (rank pair, direction, tag), when any of them is
  waited on or the next collective is issued;
* :class:`DeviceSets` counts the groups over each set of devices: calls on a set that two
  groups share need the ranks to agree on their order first (:class:`Dispatcher`).

The pipelines plan and track each call, then hand its program here.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args

import torch

from tpu_dist.collectives import _plan
from tpu_dist.collectives._types import Kind, ProgramKey

if TYPE_CHECKING:
    from tpu_dist.collectives._lowering import ProgramCache
    from tpu_dist.collectives._work import TPUWork

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


class Dispatcher:
    """Starts XLA programs on one helper thread, in call order.

    XLA:CPU runs small programs inline, inside dispatch, and the first call of a program sets
    up communicators there: either blocks the caller until every peer has arrived. An
    ``async_op=True`` call must return at once, so its program starts here; with
    TPU_DIST_TIMEOUT_POLICY=raise every call starts here, so that the caller waits where the
    watchdog's error reaches it. Programs must start in the same order on every rank, so while
    this thread has programs to start, every other one of the process starts here too
    (:meth:`run_in_order`); when it is idle, synchronous calls start inline, with no thread hop.

    Programs started from different threads. XLA:CPU runs the programs one thread starts in
    that order, but a program started from another thread does not wait for them: it can run
    while they do (measured, jaxlib 0.10.2: an inline program finished while an all_reduce the
    helper thread had started was still running). Programs whose messages carry no order of
    their own then meet the wrong peer message: two point-to-point programs between the same
    pair (gloo sends and receives tagged 0) swapped their data, with no error, or aborted on
    gloo's size check. So "idle" means more than an empty queue: a program starts inline only
    when the last program started on its devices was started by this thread or is done
    (else it starts here, behind it), and this thread waits for a program another thread
    started inline on the same devices before it starts one there. Programs on other device
    sets use other communicators and are not held back (threads driving groups over
    different ranks stay independent, as on gloo).

    Groups over the same devices. XLA keys its communicators by the set of devices a program
    runs on (``gloo/<device ids>`` on CPU, one gloo context per set, every message tagged 0),
    so two groups over the same ranks share one communicator, where torch's gloo gives each
    group its own. Calls of two such groups issued from two threads reach XLA in a different
    order on different ranks, and then one rank's all_reduce of group A meets the other's of
    group B: wrong numbers when the sizes agree, gloo's abort when they do not. So every call
    on a device set that two or more groups share starts here, and the ranks agree on the
    order first: each rank offers its oldest waiting call's :data:`Ticket` in a small
    all-gather over the set (one extra program per call, only on shared sets), all take the
    smallest ticket offered, and each starts that call as soon as it has been issued locally.
    One call starts per round, so every rank starts the same calls in the same order. When
    every group over the set is one of the same family (a mesh dimension and a dimension
    flattened to the same ranks, as HSDP's and TorchTitan's meshes have), the all-gather is
    that family's program, as the groups' own calls are (:func:`agreement_key`; TPU v5e and v6e
    compile no other program over part of a slice).
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
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._queued = 0
        # Per shared device set (sorted device ids): its waiting calls by ticket, in arrival
        # order, and the ticket all ranks agreed on that has not been issued here yet.
        self._waiting: dict[tuple[int, ...], dict[Ticket, _Job]] = {}
        self._awaited: dict[tuple[int, ...], Ticket] = {}
        # Per device set (sorted ids): the thread (ident) that started the last program on it
        # and weak references to that program's result blocks, while it runs ("Programs started from different
        # threads").
        self._running: dict[tuple[int, ...], tuple[int, list]] = {}

    def submit(
        self, key: ProgramKey, devices, arrays, ticket: Ticket | None = None
    ) -> concurrent.futures.Future:
        """Start ``key``'s program after every earlier one; the future holds its result blocks.

        With a ``ticket``, the program starts in the order the ranks agree on (class doc).
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                # A daemon thread: one stuck in a collective whose peer is gone must not keep
                # the process from exiting (a ThreadPoolExecutor's worker would).
                self._thread = threading.Thread(
                    target=self._loop, name="tpu_dist-dispatch", daemon=True
                )
                self._thread.start()
            self._queued += 1
        self._queue.put(_Job(future, key, devices, list(arrays), ticket))
        return future

    def run_in_order(self, key: ProgramKey, devices, arrays) -> list:
        """Start ``key``'s program now, inline, unless earlier ones are still queued here or
        a program another thread started on the same devices is still running (then here)."""
        me, device_set = threading.get_ident(), device_set_of(devices)
        if self._queued == 0 and not self._running_elsewhere(device_set, me):
            return self._started(device_set, me, self._programs.run(key, devices, arrays))
        return self.submit(key, devices, arrays).result()

    def _started(self, device_set: tuple[int, ...], thread: int, outs: list) -> list:
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

    def _running_elsewhere(self, device_set: tuple[int, ...], me: int) -> bool:
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
        return thread != me

    def _wait_for_others(self, device_set: tuple[int, ...], me: int) -> None:
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

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job.ticket is None:
                self._start(job)
            else:
                self._order(job)
            job = None  # not kept while this thread waits: its arrays hold the call's tensors

    def _start(self, job: _Job) -> None:
        me, device_set = threading.get_ident(), device_set_of(job.devices)
        self._wait_for_others(device_set, me)
        try:
            outs = self._programs.run(job.key, job.devices, job.arrays)
            self._started(device_set, me, outs)
        except BaseException as err:  # handed to whoever waits on the future
            self._one_started()
            job.future.set_exception(err)
        else:
            self._one_started()
            job.future.set_result(outs)

    def _order(self, job: _Job) -> None:
        """Start the calls of ``job``'s device set in the order every rank agrees on."""
        devices = sorted(job.devices, key=lambda d: d.id)
        ids = tuple(d.id for d in devices)
        waiting = self._waiting.setdefault(ids, {})
        waiting[job.ticket] = job
        while waiting:
            awaited = self._awaited.get(ids)
            if awaited is not None:
                if awaited not in waiting:
                    return  # the agreed call has not been issued here yet
                del self._awaited[ids]
                self._start(waiting.pop(awaited))
                continue
            offer = next(iter(waiting))
            try:
                agreed = min(self._agree(devices, offer))
            except BaseException as err:  # the set is broken: every call on it fails
                for failed in waiting.values():
                    self._one_started()
                    failed.future.set_exception(err)
                waiting.clear()
                return
            if agreed in waiting:
                self._start(waiting.pop(agreed))
            else:
                self._awaited[ids] = agreed

    def _agree(self, devices: list, offer: Ticket) -> list[Ticket]:
        """All-gather every rank's offered ticket over ``devices`` (sorted by id)."""
        ids = tuple(d.id for d in devices)
        key = agreement_key(
            ids, devices[0].platform, self._device_sets.family(ids), devices[0].device_kind
        )
        mine = self._to_jax(torch.tensor(offer, dtype=torch.int32))
        self._wait_for_others(ids, threading.get_ident())
        (gathered,) = self._programs.run(key, devices, [mine])
        gathered.block_until_ready()
        rows = self._to_torch(gathered).view(len(ids), len(offer)).tolist()
        return [tuple(row) for row in rows]

    def _one_started(self) -> None:
        with self._lock:
            self._queued -= 1


def agreement_key(
    device_ids: tuple[int, ...],
    platform: str,
    family: tuple[tuple[int, ...], ...] = (),
    device_kind: str = "",
) -> ProgramKey:
    """The program the ranks of a shared device set agree on their calls' order with: an
    all-gather of each rank's :data:`Ticket` over ``device_ids``; given the ``family`` (device
    ids of each group) that every group over the set belongs to, that family's program where
    the group's calls run as family programs (:func:`._plan.program_key`)."""
    blocks = ((len(get_args(Ticket)), "int32"),)
    return _plan.program_key(
        Kind.ALLGATHER, device_ids, blocks, (), platform, family, device_kind
    )


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


@dataclass
class P2POp:
    """A planned send or recv waiting in the :class:`P2PQueue`."""

    work: TPUWork
    plan: _plan.P2PPlan
    dispatch: Callable[[P2POp, bool], None]
    """Tracks and starts the op (its group's); never raises (it fails ``work`` instead)."""
    seq: int = 0
    """Its number among the ops between its two ranks, set when it is dispatched."""


def _p2p_order(op: P2POp) -> tuple[int, int, int, int]:
    """(low rank, high rank, 0 if the lower one sends else 1, tag): the same on both ends."""
    low, high = op.plan.pair
    upward = (op.plan.op == "send") == (op.plan.peer == high)
    return (low, high, 0 if upward else 1, op.plan.tag)


@dataclass
class P2PQueue:
    """Point-to-point ops of this process that wait to be dispatched (module doc)."""

    pending: list[P2POp] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _seq: dict[tuple[int, int], int] = field(default_factory=dict)

    def add(self, op: P2POp) -> None:
        with self.lock:
            self.pending.append(op)

    def next_seq(self, pair: tuple[int, int]) -> int:
        """The next sequence number of the ops between the global ranks ``pair``."""
        seq = self._seq[pair] = self._seq.get(pair, 0) + 1
        return seq

    def flush(self, block: bool = True) -> None:
        """Dispatch every queued op, in the order every rank agrees on (module doc).

        Never raises: an op whose program cannot be started fails its own work. With
        ``block=False`` every program starts on the dispatcher thread (a ``wait(timeout)``).
        """
        if not self.pending:  # every collective calls this; most find nothing queued
            return
        with self.lock:
            ops, self.pending = self.pending, []
        for op in sorted(ops, key=_p2p_order):
            op.dispatch(op, block)


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
