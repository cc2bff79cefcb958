"""A "tpu" process group that records collectives instead of running them (compile-only mode).

``tpu-launch --compile-only`` runs a job's script once, as one rank of the whole target world
(thousands of ranks), in one process with no TPU. Every "tpu" group of that process is a
:class:`RecordingProcessGroup`: it checks its arguments and plans each call exactly as
:class:`~tpu_dist.collectives._backend.ProcessGroupTPU` does (same checks, same blocks, same
:class:`~tpu_dist.collectives._lowering.ProgramKey`), then records the call and completes it at
once with outputs of the right shape. Nothing is communicated and the values are not meaningful:
each rank's outputs are computed as if every rank had passed this rank's inputs (an all-gather
repeats the input, a reduce-scatter keeps this rank's chunk, everything else returns its input),
which keeps the shapes right and object collectives decodable.

:mod:`tpu_dist.collectives.compile_job` then compiles every distinct recorded program for the
group's TPU devices and reports.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from tpu_dist.collectives import _plan
from tpu_dist.collectives._backend import ProcessGroupTPU
from tpu_dist.collectives._lowering import ProgramKey
from tpu_dist.collectives._work import TPUWork

#: Program kinds whose first parameter is a reduce op name.
_REDUCING = ("allreduce", "reduce_scatter")


@dataclass(frozen=True)
class CallSite:
    """Where a recorded collective was issued from: the innermost frame of the user's code."""

    file: str
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" + (f" ({self.code})" if self.code else "")


@dataclass
class RecordedCall:
    """One distinct collective of the run, with how often it was issued."""

    op: str
    """torch's name of the call: ``all_reduce``, ``all_gather_into_tensor``, ``send``, ..."""
    reduce_op: str | None
    """``SUM``, ``AVG``, ... for reducing collectives, else None."""
    group_ranks: tuple[int, ...]
    """Global ranks of the group, in group-rank order."""
    group_desc: str
    """The group's description (``mesh_<dim>`` for a DeviceMesh dimension's group)."""
    key: ProgramKey
    """The program the "tpu" backend would run for the call."""
    data_blocks: tuple[tuple[int, str], ...]
    """(length, dtype) of the blocks that carry the job's data (the key's blocks, less any
    header the backend adds of its own)."""
    first_site: CallSite | None
    """Where the call was first issued."""
    count: int = 0

    @property
    def mesh_dim(self) -> str | None:
        """The DeviceMesh dimension the group belongs to, if it came from a DeviceMesh."""
        if self.group_desc.startswith("mesh_") and self.group_desc != "mesh_default":
            return self.group_desc.removeprefix("mesh_")
        return None

    @property
    def bytes_per_rank(self) -> int:
        """Bytes each rank sends into the program (summed over its blocks)."""
        import numpy as np

        return sum(n * np.dtype(_np_name(dtype)).itemsize for n, dtype in self.data_blocks)

    @property
    def dtype(self) -> str:
        """The element type(s) of the program's blocks (data-movement programs move raw words)."""
        return ",".join(sorted({dtype for _, dtype in self.data_blocks}))


def _np_name(dtype: str) -> str:
    return "uint16" if dtype == "bfloat16" else dtype


@dataclass
class Recorder:
    """Every collective this process issued, merged by (op, reduce op, group, program)."""

    calls: dict[tuple, RecordedCall] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self, op: str, group: ProcessGroupTPU, key: ProgramKey,
        data_blocks: tuple[tuple[int, str], ...] | None = None,
    ) -> None:
        reduce_op = key.params[0] if key.kind in _REDUCING and key.params else None
        ident = (op, reduce_op, tuple(group.global_ranks), key)
        with self.lock:
            call = self.calls.get(ident)
            if call is None:
                call = RecordedCall(
                    op, reduce_op, tuple(group.global_ranks), group.getGroupDesc(), key,
                    key.blocks if data_blocks is None else data_blocks, _user_call_site(),
                )
                self.calls[ident] = call
            call.count += 1

    def recorded(self) -> list[RecordedCall]:
        """The distinct calls, in the order they were first issued."""
        with self.lock:
            return list(self.calls.values())


recorder = Recorder()
"""This process's recorder (one per process, like the flight recorder)."""

_OWN_CODE = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # tpu_dist/
    os.path.dirname(os.path.abspath(torch.__file__)),
)


def _user_call_site() -> CallSite | None:
    """The innermost frame outside tpu_dist, torch and the standard library."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_OWN_CODE) or "/lib/python" in path or frame.filename.startswith("<"):
            continue
        return CallSite(path, frame.lineno or 0, (frame.line or "").strip())
    return None


def _fake_output(kind: str, size: int, rank: int, block: torch.Tensor) -> torch.Tensor:
    """This rank's result block of ``kind`` if every rank had passed ``block`` (module doc).

    Views of ``block`` where the shapes allow: an all-reduce's finish step then copies the
    block onto itself, which torch skips, so a job's large buffers are never written here.
    """
    if kind == "allgather":
        return block.repeat(size)
    if kind in ("reduce_scatter", "scatter"):
        return block.view(size, -1)[rank]
    return block


class RecordingProcessGroup(ProcessGroupTPU):
    """A "tpu" group that plans, records and completes calls without communicating.

    Created instead of :class:`ProcessGroupTPU` in compile-only mode (see the module docstring);
    ``devices`` are the compile-only TPU devices of the group's ranks.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        timeout: timedelta,
        devices: Sequence,
    ) -> None:
        super().__init__(rank, size, global_ranks, timeout, devices=devices)
        self._check_calls = False  # the DETAIL check would be a collective of its own

    def _launch(self, plan: _plan.Plan, *, async_op: bool = False) -> TPUWork:
        # The plan is the backend's own (same checks, blocks and key): record its program and
        # complete at once with fake results (module doc).
        if plan.key is None:
            return TPUWork.completed(plan.op, plan.finish([]))
        key = plan.key
        checked_broadcast = key.kind == "broadcast" and key.params[-1] is True
        # The program compiled is the one the backend runs; a checked broadcast's 8-byte src
        # header is not the job's data, so its size is counted without it.
        recorder.add(plan.op, self, key,
                     data_blocks=key.blocks[:-1] if checked_broadcast else None)
        results = [_fake_output(key.kind, self.size(), self.rank(), b) for b in plan.blocks]
        if checked_broadcast:  # every rank agrees on src here: the header summed over ranks
            results[-1] = plan.blocks[-1] * self.size()
        return TPUWork.completed(plan.op, plan.finish(results))

    def _queue_p2p(self, plan: _plan.P2PPlan) -> TPUWork:
        # The backend's own plan (same checks), then the two-device permute program it would
        # run, recorded instead of queued.
        if plan.key is not None:
            recorder.add(plan.op, _PairView(*plan.pair, self), plan.key)
        return TPUWork.completed(plan.description, plan.finish([]))


@dataclass(frozen=True)
class _PairView:
    """The two-rank "group" of a point-to-point program, for the recorder."""

    low: int
    high: int
    parent: ProcessGroupTPU

    @property
    def global_ranks(self) -> list[int]:
        return [self.low, self.high]

    def getGroupDesc(self) -> str:  # noqa: N802 (ProcessGroup's name)
        return f"p2p in {self.parent.getGroupDesc() or 'default group'}"
