"""The finish steps of a plan: what a collective does after its program ran (plan stage).

A :class:`~._plan.Plan` lists its steps (:attr:`~._plan.Plan.steps`); :meth:`~._plan.Plan.finish`
runs them in order on the program's result blocks (torch tensors, in the order of the plan's
blocks). Each step is a small named object: blocks in, blocks out, and the last one writes the
op's outputs and returns them. :func:`~._plan_build.build_plan` puts the steps every plan may
need first (:class:`DropTpuPadding`, :class:`RefillEmptyBlocks`); the op's plan function gives
the rest. For example a ``gather`` on TPU, where this rank's input is not empty::

    DropTpuPadding -> RaiseIfRejected -> WriteRows

drops the padding of each gathered part, fails the call if a rank rejected it (the last block,
one verdict a rank) and writes row ``r`` of what is left into the root's ``gather_list[r]``.
Steps are frozen dataclasses compared by identity (``eq=False``: their fields hold tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from tpu_dist.collectives._plan import GroupView
from tpu_dist.collectives._plan_blocks import from_permutes, write
from tpu_dist.collectives._types import Kind

# -- steps every plan may take first (build_plan adds them) ------------------------------------


@dataclass(frozen=True, eq=False)
class DropTpuPadding:
    """Drop the padding a TPU all-gather's or reduce-scatter's blocks were given
    (:func:`~._plan_build.build_plan`): an all-gather's result holds ``size`` padded parts, a
    reduce-scatter's one."""

    kind: Kind
    size: int
    parts: tuple[tuple[int, int], ...]
    """(elements, padded elements) of each block's part, per block."""

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for r, (n, m) in zip(results, self.parts):
            if n == m:
                out.append(r)
            elif self.kind == Kind.ALLGATHER:
                out.append(r.view(self.size, m)[:, :n].reshape(-1))
            else:
                out.append(r[:n])
        return out


@dataclass(frozen=True, eq=False)
class RefillEmptyBlocks:
    """Put the empty blocks back in their places: they stayed out of the program (XLA refuses
    zero-length collectives), so the results are those of the others."""

    empties: tuple[torch.Tensor | None, ...] = field(repr=False)
    """An empty block where the plan's block was empty, None where it went to the program."""

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        it = iter(results)
        return [e if e is not None else next(it) for e in self.empties]


# -- checks of the call that the program carried ------------------------------------------------


def raise_if_rejected(group: GroupView, op: str, verdicts: Sequence[int]) -> None:
    """Raise ``DistBackendError`` when any rank's verdict (one word per group rank) is set:
    that rank rejected its part of the call, so every rank fails it, writing nothing."""
    rejecting = [
        group.global_ranks[r] if group.global_ranks else r for r, v in enumerate(verdicts) if v
    ]
    if rejecting:
        raise dist.DistBackendError(
            f"tpu_dist: {op} on rank {group.global_rank} of group {group.name!r} failed: "
            f"rank(s) {rejecting} rejected their arguments (the ValueError or TypeError raised "
            "there says which and why). Every rank of the group fails the call and this rank's "
            "outputs were left unchanged; the group stays usable."
        )


@dataclass(frozen=True, eq=False)
class RaiseIfRejected:
    """Fail the call on every rank if any rank rejected its part (:class:`~._plan.Plan`): the
    last block holds one verdict word per group rank. Passes on the other blocks."""

    group: GroupView
    op: str

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        raise_if_rejected(self.group, self.op, results[-1].tolist())
        return results[:-1]


@dataclass(frozen=True, eq=False)
class CheckBroadcastSource:
    """Fail a broadcast whose ranks passed different src values: the last block is the sum
    over the group of ``(src + 1, (src + 1)**2)``, which is ``size`` times this rank's only if
    every rank passed the same src (:func:`~._plan_collectives.broadcast`). Passes on the
    other blocks."""

    group: GroupView
    root: int

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        size, mark = self.group.size, self.root + 1
        total, squares = results[-1].tolist()
        if (total, squares) != (size * mark, size * mark * mark):
            raise dist.DistBackendError(
                f"tpu_dist: broadcast on rank {self.group.global_rank} of group "
                f"{self.group.name!r}: the ranks of the group passed different src values "
                f"(this rank: src={self.root}; the group's mean: {total / size - 1:g}). Every "
                "rank must pass the same src; the tensor was left unchanged."
            )
        return results[:-1]


@dataclass(frozen=True, eq=False)
class TakeAgreedWidth:
    """The first program of an uneven all-to-all (:func:`~._plan_all_to_all.uneven_all_to_all`):
    its MAX all-reduce of (largest chunk, verdict) gives the width every rank pads to; a
    verdict (the rejecting group rank + 1, the highest one) fails the call on every rank.
    Writes the agreed pair into ``agreed`` and returns it."""

    group: GroupView
    op: str
    agreed: torch.Tensor = field(repr=False)

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        width, verdict = results[0].tolist()
        if verdict:
            verdicts = [int(r == verdict - 1) for r in range(self.group.size)]
            raise_if_rejected(self.group, self.op, verdicts)
        return [self.agreed.copy_(results[0])]


# -- all-to-all: result blocks to chunks, one per source rank -----------------------------------


@dataclass(frozen=True, eq=False)
class FromPermutes:
    """A ``"permute"`` all-to-all's results (one block per peer, as words of ``own``'s dtype)
    in source-rank order, this rank's own chunk in its place
    (:func:`~._plan_blocks.from_permutes`)."""

    own: torch.Tensor = field(repr=False)
    """This rank's chunk for itself (it stayed out of the program)."""
    rank: int

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        received = [r.view(self.own.dtype) for r in results]
        return from_permutes(received, self.own, self.rank)


@dataclass(frozen=True, eq=False)
class SplitRows:
    """A padded all-to-all's one result block as its ``size`` rows of ``width`` words of
    ``dtype``, one from each source rank."""

    dtype: torch.dtype
    size: int
    width: int

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(results[0].view(self.dtype).view(self.size, self.width))


@dataclass(frozen=True, eq=False)
class CheckSentLengths:
    """A padded all-to-all's chunks each end in the sender's length of it (one 32-bit word,
    its first ``length`` words of the chunk's type after ``width`` words): check each against the
    words this rank expects from that rank and strip them. A sender whose split sizes disagree
    with this rank's fails the call here, naming both, before anything is written (as gloo's
    size check fails the receiver); the group stays in step."""

    group: GroupView
    op: str
    expected: tuple[int, ...]
    """Words expected from each source rank."""
    width: int
    length: int
    unit: tuple[int, str]
    """(words per unit, the unit's name) for the message: (words a row, "rows")."""

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        if any(is_fake(chunk) for chunk in results):  # a dry run's: no values to check
            return [chunk[: self.width] for chunk in results]
        sent = [int(chunk[self.width:self.width + self.length].view(torch.int32)[0])
                for chunk in results]
        wrong = [(peer, got, want) for peer, (got, want) in enumerate(zip(sent, self.expected))
                 if got != want]
        if wrong:
            per, name = self.unit
            ranks = self.group.global_ranks or tuple(range(self.group.size))
            said = "; ".join(f"rank {ranks[p]} sent {got // per} {name}, this rank expected "
                             f"{want // per}" for p, got, want in wrong)
            raise dist.DistBackendError(
                f"tpu_dist: {self.op} on rank {self.group.global_rank} of group "
                f"{self.group.name!r}: the ranks' split sizes disagree ({said}): rank i's "
                "input split for rank j must equal rank j's output split for rank i. This "
                "rank's output was left unchanged; the group stays usable."
            )
        return [chunk[: self.width] for chunk in results]


@dataclass(frozen=True, eq=False)
class TrimChunks:
    """Each source rank's chunk cut to the words it sent (the rest was padding)."""

    counts: tuple[int, ...]
    """Words received from each source rank."""

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        return [chunk[:count] for chunk, count in zip(results, self.counts)]


# -- the last step: the op's outputs ------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class WriteOutputs:
    """Write result block ``i`` into ``outputs[i]``; the outputs are the op's result."""

    outputs: tuple[torch.Tensor, ...] = field(repr=False)

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        for out, result in zip(self.outputs, results):
            write(out, result)
        return list(self.outputs)


@dataclass(frozen=True, eq=False)
class KeepOutputs:
    """Write nothing: ``outputs`` are the op's result as they are (a send's tensor, the root's
    own tensor of a broadcast, a non-root rank's of a reduce; none for a barrier)."""

    outputs: tuple[torch.Tensor, ...] = field(repr=False)

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.outputs)


@dataclass(frozen=True, eq=False)
class WriteRows:
    """Write row ``r`` of the gathered block (the first result) into ``outputs[r]``."""

    outputs: tuple[torch.Tensor, ...] = field(repr=False)
    size: int

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        for out, chunk in zip(self.outputs, results[0].chunk(self.size)):
            write(out, chunk)
        return list(self.outputs)


@dataclass(frozen=True, eq=False)
class WriteGatheredLists:
    """``all_gather_coalesced``: row ``r`` of gathered block ``i`` into ``output_lists[r][i]``;
    the result is every output, rank after rank."""

    output_lists: tuple[Sequence[torch.Tensor], ...] = field(repr=False)
    size: int

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        for i, gathered in enumerate(results):
            for outputs, chunk in zip(self.output_lists, gathered.chunk(self.size)):
                write(outputs[i], chunk)
        return [out for outputs in self.output_lists for out in outputs]


@dataclass(frozen=True, eq=False)
class JoinInto:
    """Join the chunks (one per source rank, in rank order) into ``output``: straight into
    ``target`` (the output's words, of the chunks' dtype) where there is one, so no
    output-sized temporary is made, else through a joined copy."""

    output: torch.Tensor = field(repr=False)
    target: torch.Tensor | None = field(repr=False)

    def __call__(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.target is not None:
            torch.cat(results, out=self.target)
        else:
            write(self.output, torch.cat(results))
        return [self.output]
