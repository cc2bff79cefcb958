"""``ProcessGroupTPU``: the c10d process group behind ``init_process_group("tpu")``.

A group keeps its identity (rank, size, global ranks, devices, name, timeout) and its op
table; everything after *plan* belongs to its pipeline:

* **plan** (:mod:`._plan`, pure; the ops' functions in :mod:`._plan_collectives`,
  :mod:`._plan_all_to_all`, :mod:`._plan_p2p`): check the arguments (raise before anything is
  sent), flatten the tensors into blocks, choose the program (kind and algorithm, the
  :class:`~._types.ProgramKey`) and the finish steps;
* then the group's **pipeline** (:class:`~._pipeline.Pipeline`, built by the runtime; in
  compile-only mode a recording one): track, dispatch, complete (its module doc).

So each op method is a line: its plan function, then the pipeline. Method names and signatures
are the ones torch 2.13's Python process-group trampoline dispatches to (``allreduce``,
``all_gather_single``, ...). Code that calls the group object directly (DDP's ``join()``, comm
hooks) may use the shorter forms of c10d's ``ProcessGroup`` (``pg.allreduce(t)``,
``pg.broadcast(t, 0)``): each such op is defined with ``@call_forms(op)``
(:mod:`._call_forms`), which turns them into these; ``@other_devices_to(name)``
(:mod:`._delegate`) sends tensors of other device types to that device's backend.

Point-to-point ops are queued by the pipeline, not dispatched at once (an XLA program needs
both ends): see :mod:`._pipeline`. A receive from any source learns its sender through the
group's store first (:meth:`ProcessGroupTPU.recv_anysource`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from tpu_dist.collectives import _checks, _plan, _plan_all_to_all, _plan_collectives, _plan_p2p
from tpu_dist.collectives._call_forms import call_forms
from tpu_dist.collectives._delegate import DelegatingMixin, other_devices_to
from tpu_dist.collectives._pipeline import GroupPipeline
from tpu_dist.collectives._work import TPUWork


def _sent_key(src: int, dst: int, tag: int) -> str:
    """The store counter of sends from group rank ``src`` to ``dst`` with ``tag``."""
    return f"tpu_dist/p2p_sent/{src}/{dst}/{tag}"


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
        devices: Sequence,
        pipeline: GroupPipeline,
        on_named: Callable[[str], None] | None = None,
    ) -> None:
        """``devices``: the JAX device of each group rank; ``pipeline``: what runs the planned
        calls (the runtime's :meth:`~._runtime.Runtime.pipeline` for them, or compile-only
        mode's); ``on_named``: told the group's name when torch sets it (the watchdog)."""
        super().__init__(rank, size)
        self._store = store
        self._delegates = {}  # device type -> the backend for its tensors (see _delegate)
        # Receives from any source (recv without src): how many sends from each (group rank,
        # tag) this rank has received; senders count theirs in the group's store.
        self._received: dict[tuple[int, int], int] = {}
        self._global_ranks = list(global_ranks)
        self._devices = list(devices)
        self._view = _plan.GroupView(
            rank, size, tuple(d.id for d in self._devices), self._devices[0].platform,
            tuple(self._global_ranks), device_kind=self._devices[0].device_kind,
        )
        self._pipeline = pipeline
        # Tensors of these device types are this group's; others go to a delegate (_delegate).
        self._tensor_device_types = frozenset(getattr(pipeline, "tensor_device_types", ("cpu",)))
        self._timeout = timeout
        self._group_name = ""
        self._group_desc = ""
        self._on_named = on_named
        self._family_ranks: tuple[tuple[int, ...], ...] = ()

    # -- identity (funcol, DTensor, FSDP2 and TP need names) -----------------

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return "tpu"

    def name(self) -> str:
        return "tpu"

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name
        self._view = dataclasses.replace(self._view, name=name)
        if self._on_named is not None:
            self._on_named(name)

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc
        self._view = dataclasses.replace(self._view, desc=desc)

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each group rank."""
        return list(self._global_ranks)

    @property
    def devices(self) -> list:
        """The JAX device of each group rank (of each global rank, for the default group)."""
        return list(self._devices)

    @property
    def family(self) -> list[list[int]]:
        """The global ranks of each group of this group's family (:meth:`set_family`), or
        ``[]`` when it is not one of a family."""
        return [list(g) for g in self._family_ranks]

    def set_family(self, groups: Sequence[Sequence[int]], devices: Sequence) -> None:
        """Declare this group one of a *family*: the equal, disjoint groups of one mesh
        dimension, every one of which calls the same collectives at the same points (what
        DeviceMesh, FSDP2 and TP do). Its collectives then run as one program over the
        devices of the whole family, whose replica groups are the family's groups
        (:attr:`~._types.ProgramKey.groups`): on TPU v5e and v6e a collective over part of a
        slice compiles only so.

        ``tpu_dist.mesh.init_device_mesh`` and ``tpu_dist.mesh.register_mesh`` call this;
        every rank of every group of the family must call it with the same ``groups``, before
        the group's first collective. A group of one rank, or a family of one group, keeps
        its own program.

        Args:
            groups: The global ranks of each group of the family, each in group-rank order;
                this group's ranks are one of them.
            devices: The JAX device of each global rank (the default group's ``devices``).

        Raises:
            ValueError: the groups are not equal in size, overlap, or do not include this
                group as it is (same ranks, same order); nothing is changed then.
        """
        rows = tuple(tuple(int(r) for r in g) for g in groups)
        mine = tuple(self._global_ranks)
        sizes = {len(g) for g in rows}
        flat = [r for g in rows for r in g]
        problem = None
        if mine not in rows:
            problem = f"none of them is this group's ranks {list(mine)} (in group-rank order)"
        elif len(sizes) != 1:
            problem = f"their sizes differ ({sorted(sizes)})"
        elif len(set(flat)) != len(flat):
            problem = "a rank is in two of them"
        elif max(flat) >= len(devices) or min(flat) < 0:
            problem = f"a rank is outside the {len(devices)} devices given"
        if problem is not None:
            shown = [list(g) for g in rows[:4]] + (["..."] if len(rows) > 4 else [])
            raise ValueError(
                f"set_family: the groups {shown} ({len(rows)} groups) cannot be the family of "
                f"group {self._group_name or '?'}: {problem}. Pass every group of one mesh "
                "dimension, each as its ranks in group-rank order."
            )
        if self.size() < 2 or len(rows) < 2:
            rows = ()
        self._family_ranks = rows
        family = tuple(tuple(devices[r].id for r in g) for g in rows)
        self._view = dataclasses.replace(self._view, family=family)
        self._pipeline.set_family(family)

    @property
    def timeout(self) -> timedelta:
        """The watchdog's deadline for each of this group's collectives issued from now on."""
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the watchdog's deadline for this group's collectives issued from now on.

        What torch 2.14+'s ``dist.set_timeout(timeout, group)`` (and its deprecated
        ``_set_pg_timeout``) call on the group; on any torch,
        :func:`tpu_dist.collectives.set_timeout` does the same. Collectives already issued
        keep the deadline they started with. Local to the calling rank.

        Raises:
            TypeError: ``timeout`` is not a ``datetime.timedelta``.
            ValueError: ``timeout`` is not positive.
        """
        self._timeout = _checks.check_timeout("set_timeout", timeout)

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: the group no longer shares its devices."""
        self._pipeline.close()
        super().shutdown()

    def _run(self, plan: _plan.Plan, async_op: bool = False) -> TPUWork:
        """Hand ``plan`` to the pipeline (track, dispatch, complete)."""
        return self._pipeline.run(self._view, plan, self._timeout, async_op)

    # -- the ops: plan, then the common path ---------------------------------------------------
    # Each op is its plan function (_plan_collectives, _plan_all_to_all: checks, blocks,
    # program, finish steps) handed to _run. Names and signatures are the ones torch's
    # trampoline calls. Two decorators wrap most ops, shown on each:
    #   @call_forms(op)          c10d's short call forms (pg.allreduce(t)) become (..., opts)
    #                            first (_call_forms.FORMS); c10d's own names for the ops the
    #                            trampoline calls by others are bound below them (ALIASES);
    #   @other_devices_to(name)  tensors of other device types go to that device's backend,
    #                            as its method `name` (_delegate).

    @call_forms("allreduce")
    @other_devices_to("allreduce")
    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> TPUWork:
        plan = _plan_collectives.all_reduce(self._view, tensors, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    @call_forms("allreduce_coalesced")
    @other_devices_to("allreduce_coalesced")
    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceCoalescedOptions
    ) -> TPUWork:
        plan = _plan_collectives.all_reduce_coalesced(self._view, tensors, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    @call_forms("reduce")
    @other_devices_to("reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: dist.ReduceOptions) -> TPUWork:
        plan = _plan_collectives.reduce(self._view, tensors, opts.rootRank, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    @call_forms("allgather")
    @other_devices_to("allgather")
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions,
    ) -> TPUWork:
        plan = _plan_collectives.all_gather(self._view, output_tensors, input_tensors)
        return self._run(plan, opts.asyncOp)

    @other_devices_to("_allgather_base")
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: dist.AllgatherOptions
    ) -> TPUWork:
        plan = _plan_collectives.all_gather_into_tensor(self._view, output, input)
        return self._run(plan, opts.asyncOp)

    _allgather_base = call_forms("_allgather_base")(all_gather_single)

    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: dist.AllgatherOptions,
    ) -> TPUWork:
        plan = _plan_collectives.all_gather_into_tensor_coalesced(self._view, outputs, inputs)
        return self._run(plan, opts.asyncOp)

    allgather_into_tensor_coalesced = call_forms("allgather_into_tensor_coalesced")(
        all_gather_single_coalesced
    )

    @call_forms("allgather_coalesced")
    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions,
    ) -> TPUWork:
        """``all_gather_coalesced``: ``output_lists[r][i]`` gets rank r's ``input_tensors[i]``."""
        plan = _plan_collectives.all_gather_coalesced(self._view, output_lists, input_tensors)
        return self._run(plan, opts.asyncOp)

    @call_forms("gather")
    @other_devices_to("gather")
    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.GatherOptions,
    ) -> TPUWork:
        plan = _plan_collectives.gather(self._view, output_tensors, input_tensors, opts.rootRank)
        return self._run(plan, opts.asyncOp)

    @call_forms("reduce_scatter")
    @other_devices_to("reduce_scatter")
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: dist.ReduceScatterOptions,
    ) -> TPUWork:
        plan = _plan_collectives.reduce_scatter(
            self._view, output_tensors, input_tensors, opts.reduceOp
        )
        return self._run(plan, opts.asyncOp)

    @other_devices_to("_reduce_scatter_base")
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: dist.ReduceScatterOptions
    ) -> TPUWork:
        plan = _plan_collectives.reduce_scatter_tensor(self._view, output, input, opts.reduceOp)
        return self._run(plan, opts.asyncOp)

    _reduce_scatter_base = call_forms("_reduce_scatter_base")(reduce_scatter_single)

    def reduce_scatter_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: dist.ReduceScatterOptions,
    ) -> TPUWork:
        plan = _plan_collectives.reduce_scatter_tensor_coalesced(
            self._view, outputs, inputs, opts.reduceOp
        )
        return self._run(plan, opts.asyncOp)

    reduce_scatter_tensor_coalesced = call_forms("reduce_scatter_tensor_coalesced")(
        reduce_scatter_single_coalesced
    )

    @call_forms("broadcast")
    @other_devices_to("broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> TPUWork:
        plan = _plan_collectives.broadcast(self._view, tensors, opts.rootRank)
        return self._run(plan, opts.asyncOp)

    @call_forms("scatter")
    @other_devices_to("scatter")
    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: dist.ScatterOptions,
    ) -> TPUWork:
        plan = _plan_collectives.scatter(self._view, output_tensors, input_tensors, opts.rootRank)
        return self._run(plan, opts.asyncOp)

    @other_devices_to("alltoall_base")
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: dist.AllToAllOptions,
    ) -> TPUWork:
        plan = _plan_all_to_all.all_to_all_single(
            self._view, output, input, output_split_sizes, input_split_sizes
        )
        return self._run(plan, opts.asyncOp)

    alltoall_base = call_forms("alltoall_base")(all_to_all_single)

    @call_forms("alltoall")
    @other_devices_to("alltoall")
    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: dist.AllToAllOptions,
    ) -> TPUWork:
        plan = _plan_all_to_all.all_to_all(self._view, output_tensors, input_tensors)
        return self._run(plan, opts.asyncOp)

    @call_forms("barrier")
    def barrier(self, opts: dist.BarrierOptions) -> TPUWork:
        return self._run(_plan_collectives.barrier(self._view), opts.asyncOp)

    # -- point to point -----------------------------------------------------------------

    @other_devices_to("send")
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> TPUWork:
        work = self._queue_p2p(_plan_p2p.p2p(self._view, "send", tensors, dst, tag))
        if self.size() > 2 and self._store is not None:
            # Count the send where a receiver from any source can see it (recv_anysource).
            self._store.add(_sent_key(self.rank(), dst, tag), 1)
        return work

    @other_devices_to("recv")
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> TPUWork:
        return self._receive(_plan_p2p.p2p(self._view, "recv", tensors, src, tag))

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
        plan = _plan_p2p.recv_any_source(self._view, tensors, tag)
        received = []

        def receive(block: bool) -> None:
            if received:
                return
            src = self._wait_for_sender(plan)
            self._receive(plan.from_source(src)).wait()
            received.append(src)
            work.received_from(src)
            work.start((), lambda outs: [plan.tensor])

        work = self._pipeline.deferred(plan.description, receive)
        return work

    def _receive(self, plan: _plan.P2PPlan) -> TPUWork:
        """Queue a planned receive, counted as received from its source (recv_anysource)."""
        work = self._queue_p2p(plan)
        source = (plan.peer_group_rank, plan.tag)
        self._received[source] = self._received.get(source, 0) + 1
        return work

    def _wait_for_sender(self, plan: _plan_p2p.AnySourcePlan) -> int:
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
        """Hand a planned send/recv to the pipeline (queued until the next flush)."""
        return self._pipeline.send_or_recv(self._view, plan, self._timeout)
