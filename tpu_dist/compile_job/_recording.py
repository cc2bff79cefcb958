"""The compile-only pipeline: plan every call as the backend does, record it, return at once.

``tpu-launch --compile-only`` runs a job's script once, as one rank of the whole target world
(thousands of ranks), in one process with no TPU. Every "tpu" group of that process is the
backend's own :class:`~tpu_dist.collectives.ProcessGroupTPU` (same checks, same plans, same
:class:`~tpu_dist.collectives.ProgramKey`), with a :class:`RecordingPipeline` in place of the
one that runs programs: each call is recorded (:class:`Recorder`) and completed at once with
outputs of the right shape. Nothing is communicated and the values are not meaningful: each
rank's outputs are computed as if every rank had passed this rank's inputs (an all-gather
repeats the input, a reduce-scatter keeps this rank's chunk, everything else returns its
input: :attr:`~tpu_dist.collectives._types.Kind.recorded_output`), which keeps the shapes
right and object collectives decodable.

:mod:`._compile` then compiles every distinct recorded program for the group's TPU devices and
reports.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from tpu_dist.collectives.pipelines import GroupView, Kind, P2PPlan, Plan, ProgramKey, TPUWork


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
    origin: str = "script"
    """Who issued it (:func:`_origin`): ``fsdp``, ``ddp``, ``tensor`` (DTensor / tensor
    parallelism) or ``script``."""
    count: int = 0
    per_step: dict[int, int] = field(default_factory=dict)
    """Calls per step: step index (:attr:`Recorder.step` when issued) -> calls."""

    @property
    def overlappable(self) -> bool:
        """Whether the call can run under compute (the rule: :data:`OVERLAPPABLE_ORIGINS`)."""
        return self.origin in OVERLAPPABLE_ORIGINS

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
    """Every collective this process issued, merged by (op, reduce op, group, program, origin)."""

    calls: dict[tuple, RecordedCall] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    step: int = 0
    """The training step being run: each call is counted under it too
    (:attr:`RecordedCall.per_step`). Advanced by :class:`~._step.StepMeter` at each optimizer
    step; 0 throughout when no meter runs."""

    def add(
        self, op: str, group_ranks: Sequence[int], group_desc: str, key: ProgramKey,
        data_blocks: tuple[tuple[int, str], ...] | None = None,
    ) -> None:
        """Count one call of ``op`` on the group of ``group_ranks`` running ``key``'s program."""
        reduce_op = key.reduce_op
        origin = _origin()
        ident = (op, reduce_op, tuple(group_ranks), key, origin)
        with self.lock:
            call = self.calls.get(ident)
            if call is None:
                call = RecordedCall(
                    op, reduce_op, tuple(group_ranks), group_desc, key,
                    key.blocks if data_blocks is None else data_blocks, _user_call_site(),
                    origin,
                )
                self.calls[ident] = call
            call.count += 1
            call.per_step[self.step] = call.per_step.get(self.step, 0) + 1

    def recorded(self) -> list[RecordedCall]:
        """The distinct calls, in the order they were first issued."""
        with self.lock:
            return list(self.calls.values())


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN_CODE = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # tpu_dist/
    os.path.dirname(os.path.abspath(torch.__file__)),
    # tpu-launch's entry and torch's autoload hook, beside the package
    os.path.join(_REPO, "_tpu_dist_launch.py"),
    os.path.join(_REPO, "_tpu_dist_autoload.py"),
)
_STDLIB = tuple(
    os.path.abspath(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "platstdlib")
)
"""The standard library's folders. Other installed packages (a framework such as TorchTitan in
site-packages) are the user's code here: their line is where a collective came from."""


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_ORIGINS = (
    (os.path.join(_TORCH_DIR, "distributed", "fsdp") + os.sep, "fsdp"),
    (os.path.join(_TORCH_DIR, "nn", "parallel") + os.sep, "ddp"),
    (os.path.join(_TORCH_DIR, "distributed", "tensor") + os.sep, "tensor"),
)
OVERLAPPABLE_ORIGINS = frozenset({"fsdp", "ddp"})
"""The overlap rule. FSDP's collectives (FSDP2 prefetches the next unit's all-gather while
the current one computes and reduce-scatters gradients while the backward goes on) and DDP's
bucketed gradient all-reduces are built to run under compute: overlappable. Everything else
sits on the critical path: DTensor's collectives (tensor parallelism's activation all-reduces,
sequence parallelism's all-gathers and reduce-scatters, ``loss_parallel``'s reductions: the
next op needs their result) and the script's own calls (a loss all-reduce, a barrier)."""


def _origin() -> str:
    """Who issued the call being recorded: the innermost frame of torch's FSDP, DDP or
    DTensor code on the stack (``fsdp``, ``ddp``, ``tensor``), else ``script``.

    Innermost first: a DTensor collective in a block's forward runs under FSDP2's hooks further
    out, and is DTensor's; FSDP2's all-gathers of DTensor parameters are FSDP's.
    """
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TORCH_DIR):
            for prefix, name in _ORIGINS:
                if path.startswith(prefix):
                    return name
        frame = frame.f_back
    return "script"


def _user_call_site() -> CallSite | None:
    """The innermost frame outside tpu_dist (and tpu-launch), torch and the standard library
    (installed packages, a framework's code, count as the script's); on a thread with
    none, the main thread's (the script's). Autograd runs the backward of a non-CPU device's
    tensors (the emulated ``"tpu"``'s) on a thread of its own, while the main thread waits in
    the script's ``loss.backward()``: that line is the call site, as on CPU tensors."""
    found = _innermost_user_frame(traceback.extract_stack())
    if found is None and threading.current_thread() is not threading.main_thread():
        main = sys._current_frames().get(threading.main_thread().ident)
        if main is not None:
            found = _innermost_user_frame(traceback.extract_stack(main))
    return found


def _innermost_user_frame(stack: traceback.StackSummary) -> CallSite | None:
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(_OWN_CODE) or frame.filename.startswith("<") or (
                path.startswith(_STDLIB) and "site-packages" not in path):
            continue
        return CallSite(path, frame.lineno or 0, (frame.line or "").strip())
    return None


def _fake_output(kind: str, size: int, rank: int, block: torch.Tensor) -> torch.Tensor:
    """This rank's result block of ``kind`` if every rank had passed ``block`` (module doc).

    Views of ``block`` where the shapes allow: an all-reduce's finish step then copies the
    block onto itself, which torch skips, so a job's large buffers are never written here.
    """
    output = Kind(kind).recorded_output
    if output == "repeat":
        return block.repeat(size)
    if output == "chunk":
        return block.view(size, -1)[rank]
    return block


class RecordingPipeline:
    """A group's pipeline that records its calls and completes them at once (module doc).

    Plugged into the backend's own group by the compile-only session
    (:class:`~tpu_dist.compile_job.Session`); the plans it gets are the backend's own.
    """

    def __init__(self, recorder: Recorder, *, tensor_device_types: tuple[str, ...] = ("cpu",)
                 ) -> None:
        self._recorder = recorder
        self.tensor_device_types = tensor_device_types
        """The device types of the tensors the group takes (the backend's group reads it): the
        CPU, and the emulated ``"tpu"`` device when the run emulates it (its tensors are fake:
        nothing is moved)."""

    def run(self, group: GroupView, plan: Plan, timeout: timedelta, async_op: bool) -> TPUWork:
        """Record ``plan``'s program and complete at once with fake results (module doc)."""
        while True:
            if plan.rejected is not None:  # nothing runs: no other rank waits for its verdict
                raise plan.rejected
            work = self._record(group, plan)
            if plan.then is None:
                return work
            plan = plan.then(work.result())

    def _record(self, group: GroupView, plan: Plan) -> TPUWork:
        if plan.key is None:
            return TPUWork.completed(plan.op, plan.finish([]))
        key = plan.key
        # The program compiled is the one the backend runs; the blocks that check the call (a
        # broadcast's src header, a rooted op's verdicts) and the padding of a TPU all-gather's
        # or reduce-scatter's blocks are not the job's data, so its size is counted without
        # them.
        self._recorder.add(
            plan.op, group.global_ranks, group.desc, key, data_blocks=plan.data_blocks
        )
        results = [_fake_output(key.kind, group.size, group.rank, b) for b in plan.blocks]
        if plan.checks and key.kind in (Kind.BROADCAST, Kind.SCATTER):
            # Every rank agrees here: the check blocks summed over the ranks (a broadcast's src
            # header, a scatter's verdicts); an all-gathered verdict repeats as data does.
            for i in range(len(results) - plan.checks, len(results)):
                results[i] = plan.blocks[i] * group.size
        return TPUWork.completed(plan.op, plan.finish(results))

    def send_or_recv(self, group: GroupView, plan: P2PPlan, timeout: timedelta) -> TPUWork:
        """Record the two-device permute programs the backend would run (the message's header,
        then its data), instead of sending; a receive's tensor is filled with ones.

        Ones, not what the peer would send (no peer runs): a value code can go on with, where
        the tensor's own (often uninitialised) memory could hold a count or a size that sends
        the script astray. torch's pipeline schedules need it: their warm-up multiplies each
        stage's "shapes are known" vote (1) into what it received.
        """
        desc = f"p2p in {group.desc or 'default group'}"
        self._recorder.add(f"{plan.op} (header)", plan.pair, desc, plan.header)
        if plan.key is not None:
            self._recorder.add(plan.op, plan.pair, desc, plan.key)
        if plan.op == "recv":
            with torch.no_grad():  # as the backend's finish step writes (a leaf that requires grad)
                plan.tensor.fill_(1)
        return TPUWork.completed(plan.description, plan.finish([]))

    def deferred(self, description: str, before_wait: Callable[[bool], None]) -> TPUWork:
        return TPUWork(description, before_wait=before_wait)

    def set_family(self, family: tuple[tuple[int, ...], ...]) -> None:
        pass  # nothing is dispatched, so no order is agreed on

    def close(self) -> None:
        pass
