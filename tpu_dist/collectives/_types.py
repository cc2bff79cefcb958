"""The package's vocabulary: the kinds of program, the key of a program, and a call's record.

A leaf: it imports nothing of tpu_dist, JAX or torch, so every stage can use it (plan, lowering,
dispatch, the watchdog and flight recorder, the compile-only job) without depending on another.

* :class:`Kind` - the program kinds, with what each stage needs to know about one
  (:attr:`Kind.reduces`, :attr:`Kind.bench_op`, :attr:`Kind.recorded_output`). A new kind is
  a member here, a body in ``_lowering`` (its ``_ALGORITHMS`` tables), and a plan function
  (``_plan_collectives``, beside it ``_plan_all_to_all``) that builds its key.
* :class:`ProgramKey` - everything that decides a program's XLA code.
* :class:`Call` - one issued call as it passes the stages after plan (track, dispatch,
  complete) and reaches the watchdog, the flight recorder and the compile-only recorder.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal


class Kind(str, enum.Enum):
    """A program's kind: which body it runs (``ProgramKey.kind``).

    A ``str`` enum: ``Kind.ALLREDUCE == "allreduce"``, it hashes, prints and formats as its
    value, so keys and messages read the same as plain strings.
    """

    __str__ = str.__str__
    __format__ = str.__format__

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    REDUCE_SCATTER = "reduce_scatter"
    ALLTOALL = "alltoall"
    BROADCAST = "broadcast"
    SCATTER = "scatter"
    PERMUTE = "permute"
    BARRIER = "barrier"

    @property
    def reduces(self) -> bool:
        """Whether the program reduces values: its first param is the reduce op's name
        (``SUM``, ``AVG``, ...). The others move raw words, exact for every dtype."""
        return self in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER)

    @property
    def bench_op(self) -> str:
        """The ``tpu-dist-bench`` op whose bus-bandwidth formula the program follows
        (``tpu_dist.mesh.bus_factor``): a broadcast and a barrier are psums, a scatter is an
        all-to-all of the root's rows, a permute one send."""
        return _BENCH_OPS[self][0]

    def bench_bytes(self, bytes_per_rank: int, ranks: int) -> int:
        """The :attr:`bench_op`'s message size ``S`` for ``bytes_per_rank`` on ``ranks``
        ranks (an all-gather's ``S`` is the gathered output: ``bytes_per_rank * ranks``)."""
        return _BENCH_OPS[self][1](bytes_per_rank, ranks)

    @property
    def recorded_output(self) -> Literal["repeat", "chunk", "same"]:
        """A rank's result block if every rank had passed this rank's input (what compile-only
        mode returns without communicating): the input repeated once per rank (an
        all-gather), this rank's chunk of it (a reduce-scatter, a scatter), or the input."""
        if self is Kind.ALLGATHER:
            return "repeat"
        if self in (Kind.REDUCE_SCATTER, Kind.SCATTER):
            return "chunk"
        return "same"


_BENCH_OPS: dict[Kind, tuple[str, Callable[[int, int], int]]] = {
    Kind.ALLREDUCE: ("all_reduce", lambda b, n: b),
    Kind.BARRIER: ("all_reduce", lambda b, n: b),
    Kind.BROADCAST: ("all_reduce", lambda b, n: b),
    Kind.ALLGATHER: ("all_gather_into_tensor", lambda b, n: b * n),
    Kind.REDUCE_SCATTER: ("reduce_scatter_tensor", lambda b, n: b),
    Kind.ALLTOALL: ("all_to_all_single", lambda b, n: b),
    Kind.SCATTER: ("all_to_all_single", lambda b, n: b),
    Kind.PERMUTE: ("send_recv", lambda b, n: b),
}


@dataclass(frozen=True)
class ProgramKey:
    """Everything that decides a program's XLA code."""

    kind: str
    """Which body: a :class:`Kind` (plain strings of its values are accepted and equal)."""
    devices: tuple[int, ...]
    """JAX device ids of the program: the group's, in group-rank order; for a family program
    (``groups > 1``) every group's of the family, group after group, each in group-rank
    order."""
    blocks: tuple[tuple[int, str], ...]
    """(length, dtype name) of each argument's block."""
    params: tuple = ()
    """Op-specific constants: reduce op name, root, factor, permutation."""
    algorithm: str | None = None
    """How the program carries out its kind: ``"xla"`` (XLA's own collective), ``"exchange"``
    (direct all-to-all exchanges), ``"gather_reduce"`` (all-gather, then reduce locally); see
    :data:`tpu_dist.collectives._plan_algorithms.Algorithm`. The backend's keys always carry the one
    :func:`~tpu_dist.collectives._plan_algorithms.choose_algorithm` chose; None (a key built by hand)
    means "as the backend would choose", which
    :func:`tpu_dist.collectives.compile_only.compile_collective` resolves for its devices."""

    groups: int = 1
    """How many groups run the program together: 1 for a group's own program over its
    devices; ``G > 1`` for a *family program*: ``devices`` holds ``G`` groups of equal size
    that partition them (the groups of one mesh dimension), the collective runs within each
    group (XLA's replica groups are the family's groups) and each rank passes and gets back
    only its own block. On TPU v5e and v6e a collective over a part of a slice compiles only
    this way (docs/decisions/0020-family-programs.md)."""

    @property
    def group_size(self) -> int:
        """Devices per group: the collective's size (what the program's body sees)."""
        return len(self.devices) // self.groups

    @property
    def reduce_op(self) -> str | None:
        """The reduce op's name for a reducing kind (``SUM``, ``AVG``, ...), else None."""
        return self.params[0] if Kind(self.kind).reduces and self.params else None


@dataclass(frozen=True)
class Call:
    """One issued call of a group, as the stages after plan see it.

    Built by the group's pipeline when the call is issued; read by the watchdog, the flight
    recorder and (compile-only) the recorder. For a point-to-point op the "group" is the pair:
    ``group`` is its direction, ``"p2p:<sender>-><receiver>"``, and ``ranks`` the two global ranks
    (sender first).
    """

    op: str
    """The op as users know it: ``all_reduce``, ``send (peer 1, tag 0)``."""
    group: str
    """The group's name (torch's ``group_name``), or ``p2p:<sender>-><receiver>``."""
    ranks: tuple[int, ...]
    """Global rank of each group rank."""
    seq: int
    """The call's sequence number in its group (1 for the first), the same on every rank."""
    key: ProgramKey
    """The program it runs."""
    timeout: timedelta
    """The group's timeout when the call was issued: the watchdog's deadline."""
    params: tuple = ()
    """What the flight recorder shows of the call's parameters (default: the key's)."""

    @property
    def blocks(self) -> tuple[tuple[int, str], ...]:
        """(length, dtype) of each block the program takes."""
        return self.key.blocks

    @property
    def shown_params(self) -> tuple:
        return self.params or self.key.params
