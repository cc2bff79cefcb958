"""``ProcessGroupTPU``: the c10d process group behind ``init_process_group("tpu")``.

Every op is one pipeline, each stage with one owner:

* **plan** (:mod:`._plan`, pure): check the arguments (raise before anything is sent), flatten
  the tensors into blocks, choose the program (kind and algorithm, the
  :class:`~._lowering.ProgramKey`) and the finish step;
* **track** (:func:`~._watchdog.track`): flight recorder and watchdog, always before dispatch;
* **dispatch** (:class:`~._dispatch.Dispatcher`): the cached XLA program (:mod:`._lowering`)
  started in the order every rank agrees on;
* **complete** (:class:`~._work.TPUWork`): the finish step copies the results into the outputs.

So each op method is a line: its plan function, then :meth:`ProcessGroupTPU._run`. A group
keeps its own state (rank, devices, sequence number, unfinished works); what is per process
(JAX, programs, dispatcher, p2p queue, watchdog) is the runtime's (``self._rt``, see
:mod:`._runtime`).

Method names and signatures are the ones torch 2.13's Python process-group
trampoline dispatches to (``allreduce``, ``all_gather_single``, ...). Code that calls the
group object directly (DDP's ``join()``, comm hooks) may use the shorter forms of c10d's
``ProcessGroup`` (``pg.allreduce(t)``, ``pg.broadcast(t, 0)``): :mod:`._call_forms` turns them
into these.

Point-to-point ops are queued, not dispatched at once: an XLA program needs
both ends, so a send and its recv must run the same program in the same order
on both ranks. Queued ops are dispatched when any of them is waited on or the
next collective is issued, sorted by (rank pair, direction, tag). That makes
``batch_isend_irecv`` and ``isend``/``irecv`` exchanges deadlock-free in any
issue order, like gloo; a blocking ``send`` must be matched by a ``recv`` on
the peer at the same point of its sequence, like NCCL (:class:`~._dispatch.P2PQueue`).
Each queued op is tracked (flight recorder, watchdog) just before it is
dispatched, as every collective is, and an op whose program cannot start fails
its own work: a collective that happened to flush the queue never raises a p2p
op's error.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from tpu_dist.collectives import _plan, _runtime, _watchdog
from tpu_dist.collectives._call_forms import accept_call_forms
from tpu_dist.collectives._delegate import DelegatingMixin, route_other_devices
from tpu_dist.collectives._dispatch import P2POp, Ticket
from tpu_dist.collectives._work import TPUWork, wait_interruptibly

def _sent_key(src: int, dst: int, tag: int) -> str:
    """The store counter of sends from group rank ``src`` to ``dst`` with ``tag``."""
    return f"tpu_dist/p2p_sent/{src}/{dst}/{tag}"


_CALL_BYTES = 256


@accept_call_forms  # outermost: short forms become (..., opts) before routing
@route_other_devices
class ProcessGroupTPU(DelegatingMixin, dist.ProcessGroup):
    """The "tpu" process group: c10d collectives as XLA collective programs.

    Created by ``torch.distributed`` (``init_process_group("tpu")``,
    ``new_group``, ``init_device_mesh``); group rank ``i`` runs on the JAX
    device of global rank ``global_ranks[i]``.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        timeout: timedelta,
        store: dist.Store | None = None,
        *,
        devices: Sequence | None = None,
    ) -> None:
        """``devices``: the JAX device of each group rank; default: the running runtime's."""
        super().__init__(rank, size)
        self._rt = _runtime.get()
        self._store = store
        self._delegates = {}  # device type -> the backend for its tensors (see _delegate)
        # Receives from any source (recv without src): how many sends from each (group rank,
        # tag) this rank has received; senders count theirs in the group's store.
        self._received: dict[tuple[int, int], int] = {}
        self._global_ranks = list(global_ranks)
        if devices is None:
            every = self._rt.global_devices()
            devices = [every[r] for r in self._global_ranks]
        self._devices = list(devices)
        self._device_ids = tuple(d.id for d in self._devices)
        self._device_set = tuple(sorted(self._device_ids))
        # This group's index among the groups over its device set (see _dispatch.Dispatcher).
        self._index_in_set = self._rt.device_sets.add(self._device_set)
        self._view = _plan.GroupView(
            rank, size, self._device_ids, self._devices[0].platform, tuple(self._global_ranks)
        )
        self._live = True
        self._timeout = timeout
        self._group_name = ""
        self._group_desc = ""
        self._seq = 0
        # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported; a
        # value set later (before init_process_group) counts too.
        self._check_calls = (
            dist.get_debug_level() == dist.DebugLevel.DETAIL
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        )
        watchdog = self._rt.watchdog  # it read the policy when it started
        policy = watchdog.policy if watchdog is not None else _watchdog.policy_from_env()
        self._poll = policy == "raise"
        # Works of this group not completed yet, in issue order (see _complete_before).
        self._unfinished: collections.deque[TPUWork] = collections.deque()
        self._unfinished_lock = threading.Lock()

    # -- identity (funcol, DTensor, FSDP2 and TP need names) -----------------

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return "tpu"

    def name(self) -> str:
        return "tpu"

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name
        self._view = dataclasses.replace(self._view, name=name)
        if self._rt.watchdog is not None:
            self._rt.watchdog.group_created(name)

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each group rank."""
        return list(self._global_ranks)

    @property
    def timeout(self) -> timedelta:
        """The watchdog's deadline for each of this group's collectives issued from now on."""
        return self._timeout

    def _set_default_timeout(self, timeout: timedelta) -> None:
        """What torch's backends call this; see :func:`tpu_dist.collectives.set_timeout`."""
        self._timeout = timeout

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: the group no longer shares its devices."""
        if self._live:
            self._live = False
            self._rt.device_sets.remove(self._device_set)
        super().shutdown()

    # -- the common path: track, dispatch, complete ------------------------------------------

    def _run(self, plan: _plan.Plan, async_op: bool = False) -> TPUWork:
        """Run ``plan``: its program tracked, dispatched, and completed by the returned work.

        A plan with a follow-up (:attr:`Plan.then`) runs to completion first, here; the plan it
        leads to is the one ``async_op`` applies to.
        """
        while plan.then is not None:
            outputs = self._launch(plan).result()
            plan = plan.then(outputs)
        return self._launch(plan, async_op=async_op)

    def _launch(self, plan: _plan.Plan, *, async_op: bool = False) -> TPUWork:
        """Track and dispatch ``plan``'s program; the work runs ``plan.finish`` on its results.

        With ``async_op`` the program starts on the dispatcher thread and this returns at once.
        """
        rt = self._rt
        rt.p2p.flush()
        description = plan.op
        if plan.key is None:  # nothing to move
            return TPUWork.completed(description, plan.finish([]))
        key = plan.key
        arrays = [rt.to_jax(b) for b in plan.blocks]
        if self._check_calls:
            self._check_same_call(description, key.params, key.blocks)
        self._seq += 1
        seq = self._seq

        def explain(err: BaseException) -> dist.DistBackendError:
            return _watchdog.explain_failure(
                rt.watchdog, err, description, self._group_name, seq, self._global_ranks,
                rt.info.rank,
            )

        work = TPUWork(
            description,
            poll=self._poll,
            explain=explain,
            complete_earlier=lambda: self._complete_before(work),
        )
        self._remember(work)
        # Watched from before dispatch: the first call of a program sets up XLA's
        # communicators inside dispatch and blocks there until every peer arrives.
        _watchdog.track(rt.watchdog, work, self._group_name, self._global_ranks, seq,
                        description, key.blocks, key.params, self._timeout)
        finish = plan.finish
        to_torch = rt.to_torch

        def complete(outs: list) -> list[torch.Tensor]:
            return finish([to_torch(o) for o in outs])

        ticket = self._ticket(seq, 1)
        dispatcher = rt.dispatcher
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
            while self._unfinished and self._unfinished[0].done:
                self._unfinished.popleft()
            self._unfinished.append(work)

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
        if not self._rt.device_sets.shared(self._device_set):
            return None
        return (self._index_in_set, seq, part)

    def _check_same_call(self, description: str, params: tuple, meta: tuple) -> None:
        """TORCH_DISTRIBUTED_DEBUG=DETAIL: all ranks must call the same collective.

        Every rank all-gathers a fixed-size description of its call (one small
        program that cannot mismatch), so a mismatch raises on every rank instead
        of hanging, naming each rank's call.
        """
        call = f"{description} {' '.join(map(str, params))} ".strip() + " (" + ", ".join(
            f"{dtype}[{n}]" for n, dtype in meta
        ) + ")"
        raw = call.encode()[: _CALL_BYTES]
        mine = torch.zeros(_CALL_BYTES, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        key = _plan.program_key(
            "allgather", self._device_ids, ((_CALL_BYTES, "uint8"),), (), self._view.platform
        )
        ticket = self._ticket(self._seq + 1, 0)
        arrays = [self._rt.to_jax(mine)]
        dispatcher = self._rt.dispatcher
        if ticket is None:
            (gathered,) = dispatcher.run_in_order(key, self._devices, arrays)
        else:
            (gathered,) = dispatcher.submit(key, self._devices, arrays, ticket).result()
        rows = self._rt.to_torch(gathered).view(self.size(), _CALL_BYTES)
        calls = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
        if len(set(calls)) > 1:
            detail = "; ".join(
                f"rank {self._global_ranks[i]}: {c}" for i, c in enumerate(calls)
            )
            raise RuntimeError(
                f"tpu_dist: detected mismatch between collectives on ranks of group "
                f"{self._group_name!r} (collective #{self._seq + 1}): {detail}. Every rank of a "
                "group must call the same collectives in the same order with the same sizes, "
                "dtypes and reduce ops (checked because TORCH_DISTRIBUTED_DEBUG=DETAIL)."
            )

    # -- the ops: plan, then the common path ---------------------------------------------------
    # Each op is its plan function (tpu_dist.collectives._plan: checks, blocks, program, finish)
    # handed to _run. Names and signatures are the ones torch's trampoline calls.

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> TPUWork:
        return self._run(_plan.all_reduce(self._view, tensors, opts.reduceOp), opts.asyncOp)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceCoalescedOptions
    ) -> TPUWork:
        plan = _plan.all_reduce_coalesced(self._view, tensors, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    def reduce(self, tensors: list[torch.Tensor], opts: dist.ReduceOptions) -> TPUWork:
        plan = _plan.reduce(self._view, tensors, opts.rootRank, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions,
    ) -> TPUWork:
        plan = _plan.all_gather(self._view, output_tensors, input_tensors)
        return self._run(plan, opts.asyncOp)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: dist.AllgatherOptions
    ) -> TPUWork:
        return self._run(_plan.all_gather_into_tensor(self._view, output, input), opts.asyncOp)

    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: dist.AllgatherOptions,
    ) -> TPUWork:
        plan = _plan.all_gather_into_tensor_coalesced(self._view, outputs, inputs)
        return self._run(plan, opts.asyncOp)

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions,
    ) -> TPUWork:
        """``all_gather_coalesced``: ``output_lists[r][i]`` gets rank r's ``input_tensors[i]``."""
        plan = _plan.all_gather_coalesced(self._view, output_lists, input_tensors)
        return self._run(plan, opts.asyncOp)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.GatherOptions,
    ) -> TPUWork:
        plan = _plan.gather(self._view, output_tensors, input_tensors, opts.rootRank)
        return self._run(plan, opts.asyncOp)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: dist.ReduceScatterOptions,
    ) -> TPUWork:
        plan = _plan.reduce_scatter(self._view, output_tensors, input_tensors, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: dist.ReduceScatterOptions
    ) -> TPUWork:
        plan = _plan.reduce_scatter_tensor(self._view, output, input, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    def reduce_scatter_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: dist.ReduceScatterOptions,
    ) -> TPUWork:
        plan = _plan.reduce_scatter_tensor_coalesced(self._view, outputs, inputs, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> TPUWork:
        return self._run(_plan.broadcast(self._view, tensors, opts.rootRank), opts.asyncOp)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: dist.ScatterOptions,
    ) -> TPUWork:
        plan = _plan.scatter(self._view, output_tensors, input_tensors, opts.rootRank)
        return self._run(plan, opts.asyncOp)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: dist.AllToAllOptions,
    ) -> TPUWork:
        plan = _plan.all_to_all_single(
            self._view, output, input, output_split_sizes, input_split_sizes
        )
        return self._run(plan, opts.asyncOp)

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: dist.AllToAllOptions,
    ) -> TPUWork:
        return self._run(_plan.all_to_all(self._view, output_tensors, input_tensors), opts.asyncOp)

    def barrier(self, opts: dist.BarrierOptions) -> TPUWork:
        return self._run(_plan.barrier(self._view), opts.asyncOp)

    # -- point to point -----------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> TPUWork:
        work = self._queue_p2p(_plan.p2p(self._view, "send", tensors, dst, tag))
        if self.size() > 2 and self._store is not None:
            # Count the send where a receiver from any source can see it (recv_anysource).
            self._store.add(_sent_key(self.rank(), dst, tag), 1)
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> TPUWork:
        return self._receive(_plan.p2p(self._view, "recv", tensors, src, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> TPUWork:
        """``recv`` without ``src``: receive the next send to this rank with ``tag``.

        An XLA program needs both ends when it is compiled, so the source is learnt
        first: every send of a group of more than two ranks adds one to a counter per
        (source, destination, tag) in the group's store, and this rank takes a source
        whose counter is ahead of what it has received from it (in a group of two the
        source is the other rank). Then it is an ordinary receive from that source
        (:meth:`_receive`). ``work._source_rank()`` (and so ``dist.recv``) gives the
        sender's group rank.
        """
        plan = _plan.recv_any_source(self._view, tensors, tag)
        received = []

        def receive(block: bool) -> None:
            if received:
                return
            src = self._wait_for_sender(plan)
            self._receive(plan.from_source(src)).wait()
            received.append(src)
            work.received_from(src)
            work.start((), lambda outs: [plan.tensor])

        work = TPUWork(plan.description, before_wait=receive)
        return work

    def _receive(self, plan: _plan.P2PPlan) -> TPUWork:
        """Queue a planned receive, counted as received from its source (recv_anysource)."""
        work = self._queue_p2p(plan)
        source = (plan.peer_group_rank, plan.tag)
        self._received[source] = self._received.get(source, 0) + 1
        return work

    def _wait_for_sender(self, plan: _plan.AnySourcePlan) -> int:
        """A group rank with a send to this rank (``plan.tag``) that was not received yet."""
        if len(plan.peers) == 1:
            return plan.peers[0]
        if self._store is None:
            raise RuntimeError(
                "recv: receiving from any source needs the group's store; this group was "
                "created without one."
            )
        me, tag = self.rank(), plan.tag
        deadline = time.monotonic() + self._timeout.total_seconds()
        delay = 1e-3
        while True:
            for src in plan.peers:
                sent = self._store.add(_sent_key(src, me, tag), 0)
                if sent > self._received.get((src, tag), 0):
                    return src
            if time.monotonic() > deadline:
                raise dist.DistBackendError(
                    f"tpu_dist: recv from any source (tag {tag}) on rank {me} of group "
                    f"{self._group_name!r}: no rank sent within the group's timeout "
                    f"({self._timeout.total_seconds():.0f} s)."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _queue_p2p(self, plan: _plan.P2PPlan) -> TPUWork:
        """Queue a planned send/recv (dispatched by the next flush, module doc)."""
        work = TPUWork(
            plan.description,
            poll=self._poll,
            explain=lambda err: self._explain_p2p(err, p2p_op),
            before_wait=self._rt.p2p.flush,
        )
        p2p_op = P2POp(work, plan, self._dispatch_p2p)
        self._rt.p2p.add(p2p_op)
        return work

    def _explain_p2p(self, err: BaseException, op: P2POp) -> dist.DistBackendError:
        low, high = op.plan.pair
        return _watchdog.explain_failure(
            self._rt.watchdog, err, op.work.description, f"p2p:{low}-{high}", op.seq,
            [low, high], self._rt.info.rank,
        )

    def _dispatch_p2p(self, op: P2POp, block: bool) -> None:
        """Track, then start one queued point-to-point op as a two-device permute program.

        Tracked before it is dispatched, as every collective is: the first call of a program
        sets up XLA's communicators inside dispatch and blocks there until the peer arrives.
        A program that cannot be started fails ``op.work``, never the caller (which may be
        an unrelated collective flushing the queue).
        """
        plan = op.plan
        if plan.key is None:
            op.work.start((), plan.finish)
            return
        rt = self._rt
        op.seq = rt.p2p.next_seq(plan.pair)

        def complete(outs: list) -> list[torch.Tensor]:
            return plan.finish([rt.to_torch(o) for o in outs])

        try:
            low, high = plan.pair
            _watchdog.track(rt.watchdog, op.work, f"p2p:{low}-{high}", [low, high], op.seq,
                            plan.op, plan.key.blocks, (f"tag={plan.tag}",), self._timeout)
            array = rt.to_jax(plan.block)
            devices = [self._devices[r] for r in plan.pair_group_ranks]
            if block and not self._poll:
                op.work.start(rt.dispatcher.run_in_order(plan.key, devices, [array]), complete)
            else:
                op.work.start_later(rt.dispatcher.submit(plan.key, devices, [array]), complete)
        except dist.DistBackendError as err:
            op.work.fail(err)
        except Exception as err:
            error = self._explain_p2p(err, op)
            error.__cause__ = err
            op.work.fail(error)
