"""The stages after *plan*, once for every call of one group: track, dispatch, complete.

A "tpu" collective's life is plan -> track -> dispatch -> complete. The group
(:class:`~._backend.ProcessGroupTPU`) keeps its identity and its op table: each op is its plan
function (:mod:`._plan`, pure) handed to the group's :class:`Pipeline`, which owns the rest:

1. a :class:`~._types.Call` record is made (op, group, ranks, sequence number, program,
   timeout): what the watchdog, the flight recorder and error messages see;
2. **track** (:func:`._watchdog.track`): flight recorder and watchdog, always before dispatch
   (the first call of a program sets up XLA's communicators inside dispatch and blocks there
   until every peer has arrived);
3. **dispatch** (:class:`._dispatch.Dispatcher`): the cached XLA program (:mod:`._lowering`)
   started in the order every rank agrees on, inline or on the dispatcher thread;
4. **complete** (:class:`._work.TPUWork`): the plan's finish steps (:attr:`._plan.Plan.steps`,
   run in order: drop padding, check verdicts, write the outputs, ...) turn the result blocks
   into the op's outputs, on whichever thread waits first.

Point-to-point ops are tracked when posted and handed to their direction's channel
(:class:`._p2p.P2PChannels`): an XLA program needs both ends, so each send and its receive run
the same programs, in the sender's order, matched by group and tag as gloo matches them. An op
whose program cannot start fails its own work.

With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` every call is first checked against the other ranks'
(:meth:`Pipeline._check_same_call`).

The pipeline's collaborators are the process's (:class:`Services`), handed down by the runtime
(:meth:`._runtime.Runtime.pipeline`, the composition root); nothing here imports the runtime.
Compile-only mode (:mod:`tpu_dist.compile_job`) plugs a pipeline of its own into the same group
class: it plans the same way and records instead of running (:class:`GroupPipeline` is what
both provide).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from tpu_dist.collectives import _plan, _plan_algorithms, _watchdog
from tpu_dist.collectives._dispatch import Ticket, device_set_of
from tpu_dist.collectives._p2p import P2POp
from tpu_dist.collectives._types import Call, Kind
from tpu_dist.collectives._work import TPUWork, wait_interruptibly

if TYPE_CHECKING:
    from tpu_dist.collectives._dispatch import DeviceSets, Dispatcher
    from tpu_dist.collectives._p2p import P2PChannels
    from tpu_dist.collectives._work import Completer

_CALL_BYTES = 256
"""Bytes of a call's description in the DETAIL check."""


class GroupPipeline(Protocol):
    """What a group hands its planned calls to (this module's :class:`Pipeline`, or
    compile-only mode's recording pipeline)."""

    def run(
        self, group: _plan.GroupView, plan: _plan.Plan, timeout: timedelta, async_op: bool
    ) -> TPUWork:
        """Run a planned collective; the work completes it."""

    def send_or_recv(
        self, group: _plan.GroupView, plan: _plan.P2PPlan, timeout: timedelta
    ) -> TPUWork:
        """Post (or record) a planned send or receive."""

    def deferred(self, description: str, before_wait: Callable[[bool], None]) -> TPUWork:
        """A work that ``before_wait`` completes (a receive from any source)."""

    def set_family(self, family: tuple[tuple[int, ...], ...]) -> None:
        """The group is now one of ``family`` (device ids of each group; () for none)."""

    def close(self) -> None:
        """The group was destroyed."""


@dataclass(frozen=True)
class Services:
    """What a pipeline uses of its process: the runtime's, handed down by it."""

    dispatcher: Dispatcher
    p2p: P2PChannels
    device_sets: DeviceSets
    completer: Completer
    watchdog: _watchdog.Watchdog | None
    """None in a process without one (a test's)."""
    to_jax: Callable[[torch.Tensor], object]
    """A 1-D tensor as a JAX array on this rank's device (zero-copy on CPU)."""
    to_torch: Callable[[object], torch.Tensor]
    """A result block as a CPU tensor (zero-copy on CPU)."""
    rank: int
    """This process's global rank."""


class Pipeline:
    """Track, dispatch and complete every call of one group (module doc).

    Keeps what the group's calls share after plan: its devices, the sequence number, the works
    not completed yet (in issue order) and its place among the groups over the same devices.
    """

    def __init__(
        self, services: Services, devices: Sequence, *, poll: bool, check_calls: bool
    ) -> None:
        """``devices``: the JAX device of each group rank. ``poll``: works wait by polling, so
        that the watchdog can interrupt them (``TPU_DIST_TIMEOUT_POLICY=raise``; every program
        then starts on the dispatcher thread). ``check_calls``: the DETAIL check."""
        # The process's collaborators (Services), each under its own name.
        self._dispatcher = services.dispatcher
        self._p2p = services.p2p
        self._device_sets = services.device_sets
        self._completer = services.completer
        self._watchdog = services.watchdog
        self._to_jax = services.to_jax
        self._to_torch = services.to_torch
        self._rank = services.rank
        self._devices = list(devices)
        self._device_set = device_set_of(self._devices)
        # This group's index among the groups over its device set (see _dispatch.Dispatcher).
        self._index_in_set = services.device_sets.add(self._device_set)
        self._live = True
        self._poll = poll
        self._check_calls = check_calls
        self._seq = 0
        self._unfinished: collections.deque[TPUWork] = collections.deque()
        self._unfinished_lock = threading.Lock()

    def set_family(self, family: tuple[tuple[int, ...], ...]) -> None:
        """The group is now one of ``family``: the order agreement over its devices runs as
        that family's program when every group over them is one of it (see _dispatch)."""
        if self._live:
            self._device_sets.set_family(self._device_set, self._index_in_set, family)

    def close(self) -> None:
        """The group was destroyed: it no longer shares its devices."""
        if self._live:
            self._live = False
            self._device_sets.remove(self._device_set, self._index_in_set)

    # -- collectives -----------------------------------------------------------------------

    def run(
        self,
        group: _plan.GroupView,
        plan: _plan.Plan,
        timeout: timedelta,
        async_op: bool = False,
    ) -> TPUWork:
        """Run ``plan``: its program tracked, dispatched, and completed by the returned work.

        A plan with a follow-up (:attr:`~._plan.Plan.then`) runs to completion first, here;
        the plan it leads to is the one ``async_op`` applies to. With ``async_op`` the program
        starts on the dispatcher thread and this returns at once.

        A plan this rank rejected (:attr:`~._plan.Plan.rejected`: an argument only this rank
        reads failed its check) still runs, to completion, carrying this rank's verdict, so
        that every rank fails the call and the ranks stay in step; then its error is raised
        here, at the call.
        """
        while plan.then is not None or plan.rejected is not None:
            if plan.rejected is not None:
                try:
                    self._launch(group, plan, timeout).wait()
                except dist.DistBackendError:
                    pass  # every rank's finish fails on the verdict: this rank's error says why
                raise plan.rejected
            outputs = self._launch(group, plan, timeout).result()
            plan = plan.then(outputs)
        return self._launch(group, plan, timeout, async_op=async_op)

    def _launch(
        self,
        group: _plan.GroupView,
        plan: _plan.Plan,
        timeout: timedelta,
        *,
        async_op: bool = False,
    ) -> TPUWork:
        if plan.key is None:  # nothing to move
            return TPUWork.completed(plan.op, plan.finish([]))
        key = plan.key
        arrays = [self._to_jax(b) for b in plan.blocks]
        if self._check_calls:
            self._check_same_call(group, plan.op, key.params, key.blocks)
        self._seq += 1
        call = Call(plan.op, group.name, group.global_ranks, self._seq, key, timeout)

        def explain(err: BaseException) -> dist.DistBackendError:
            return _watchdog.explain_failure(self._watchdog, err, call, self._rank)

        work = TPUWork(
            call.op,
            poll=self._poll,
            explain=explain,
            complete_earlier=self._complete_before,
            completer=self._completer,
        )
        self._remember(work)
        work.on_done(_watchdog.track(self._watchdog, work, call))
        complete = functools.partial(_finish_on_host, plan, self._to_torch)
        ticket = self._ticket(call.seq, 1)
        dispatcher = self._dispatcher
        if async_op:
            work.start_later(dispatcher.submit(key, self._devices, arrays, ticket), complete)
            return work
        try:
            if self._poll:
                outs = wait_interruptibly(
                    work, dispatcher.submit(key, self._devices, arrays, ticket)
                )
            elif ticket is not None:
                outs = dispatcher.submit(key, self._devices, arrays, ticket).result()
            else:
                outs = dispatcher.run_in_order(key, self._devices, arrays)
        except dist.DistBackendError as err:
            work.fail(err)
            raise
        except Exception as err:
            error = explain(err)
            work.fail(error)
            raise error from err
        work.start(outs, complete)
        return work

    def _remember(self, work: TPUWork) -> None:
        with self._unfinished_lock:
            self._unfinished.append(work)
        work.on_done(self._forget_done)

    def _forget_done(self, error: BaseException | None = None) -> None:
        """Drop the ended works from the front of the unfinished ones (works end in issue
        order), so that none is kept, with its outputs, after the caller dropped it."""
        with self._unfinished_lock:
            while self._unfinished and self._unfinished[0].done:
                self._unfinished.popleft()

    def _complete_before(self, work: TPUWork) -> None:
        """Complete every unfinished work this group issued before ``work``, oldest first.

        XLA runs a group's programs in issue order, so theirs have finished (or are about
        to) when ``work``'s has; only their finish steps (copies into outputs) may be left.
        """
        with self._unfinished_lock:
            earlier = []
            for other in self._unfinished:
                if other is work:
                    break
                if not other.done:
                    earlier.append(other)
        for other in earlier:
            other.complete(flush=False)

    def _ticket(self, seq: int, part: int) -> Ticket | None:
        """The ticket of this group's call ``seq`` if other groups share its devices, else None.

        Calls on a device set no other group uses need no agreement: one group's calls are
        issued in the same order on every rank (see _dispatch.Dispatcher).
        """
        if not self._device_sets.shared(self._device_set):
            return None
        return (self._index_in_set, seq, part)

    def _check_same_call(
        self, group: _plan.GroupView, description: str, params: tuple, meta: tuple
    ) -> None:
        """TORCH_DISTRIBUTED_DEBUG=DETAIL: all ranks must call the same collective.

        Every rank all-gathers a fixed-size description of its call (one small
        program that cannot mismatch), so a mismatch raises on every rank instead
        of hanging, naming each rank's call.
        """
        call = f"{description} {' '.join(map(str, params))} ".strip() + " (" + ", ".join(
            f"{dtype}[{n}]" for n, dtype in meta
        ) + ")"
        raw = call.encode()[:_CALL_BYTES]
        mine = torch.zeros(_CALL_BYTES, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        key = _plan_algorithms.program_key(
            Kind.ALLGATHER, group.device_ids, ((_CALL_BYTES, "uint8"),), (), group.platform,
            group.family, group.device_kind,
        )
        ticket = self._ticket(self._seq + 1, 0)
        arrays = [self._to_jax(mine)]
        if ticket is None:
            (gathered,) = self._dispatcher.run_in_order(key, self._devices, arrays)
        else:
            (gathered,) = self._dispatcher.submit(key, self._devices, arrays, ticket).result()
        rows = self._to_torch(gathered).view(group.size, _CALL_BYTES)
        calls = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
        if len(set(calls)) > 1:
            detail = "; ".join(
                f"rank {group.global_ranks[i]}: {c}" for i, c in enumerate(calls)
            )
            raise RuntimeError(
                f"tpu_dist: detected mismatch between collectives on ranks of group "
                f"{group.name!r} (collective #{self._seq + 1}): {detail}. Every rank of a "
                "group must call the same collectives in the same order with the same sizes, "
                "dtypes and reduce ops (checked because TORCH_DISTRIBUTED_DEBUG=DETAIL)."
            )

    # -- point to point ----------------------------------------------------------------------

    def send_or_recv(
        self, group: _plan.GroupView, plan: _plan.P2PPlan, timeout: timedelta
    ) -> TPUWork:
        """Track a planned send or recv and post it to its channel (module doc)."""
        devices = tuple(self._devices[r] for r in plan.pair_group_ranks)
        op = P2POp(plan, devices, 0)
        op.seq = self._p2p.next_seq(plan, op.direction)
        work = TPUWork(
            plan.description,
            poll=self._poll,
            explain=lambda err: self._explain_p2p(err, op, timeout),
            completer=self._completer,
        )
        try:
            work.on_done(_watchdog.track(self._watchdog, work, self._p2p_call(op, timeout)))
        except dist.DistBackendError as err:
            work.fail(err)
            return work
        work.start_later(op.future, functools.partial(_finish_on_host, plan, self._to_torch))
        self._p2p.post(op)
        return work

    def deferred(self, description: str, before_wait: Callable[[bool], None]) -> TPUWork:
        """A work whose ``before_wait`` does the call (a receive from any source learns its
        sender first, then receives)."""
        return TPUWork(description, before_wait=before_wait, completer=self._completer)

    def _p2p_call(self, op: P2POp, timeout: timedelta, *, described: bool = False) -> Call:
        """``op`` as a call of its direction's "group" (``p2p:<sender>-><receiver>``): named
        ``send``/``recv`` (the flight recorder's and the watchdog's op), or with ``described``
        by its description (``send (peer 1, tag 0)``, for an error message)."""
        src, dst = op.direction
        name = op.plan.description if described else op.plan.op
        key = op.plan.key if op.plan.key is not None else op.plan.header
        return Call(
            name, f"p2p:{src}->{dst}", (src, dst), op.seq, key, timeout,
            params=(f"tag={op.plan.tag}",),
        )

    def _explain_p2p(
        self, err: BaseException, op: P2POp, timeout: timedelta
    ) -> dist.DistBackendError:
        call = self._p2p_call(op, timeout, described=True)
        return _watchdog.explain_failure(self._watchdog, err, call, self._rank)


def _finish_on_host(
    plan: _plan.Plan | _plan.P2PPlan, to_torch: Callable[[object], torch.Tensor], outs: list
) -> list[torch.Tensor]:
    """Complete a call whose program ran: its result arrays as torch tensors on the host, then
    the plan's finish steps (:attr:`~._plan.Plan.steps`) on them."""
    return plan.finish([to_torch(o) for o in outs])
