"""Building a :class:`~._plan.Plan`: what every op's plan function ends with (plan stage).

An op's plan function (:mod:`._plan_collectives`, :mod:`._plan_all_to_all`) checks its
arguments, makes its blocks and its own finish steps, and hands them to :func:`build_plan`,
which leaves empty blocks out of the program, pads TPU all-gathers and reduce-scatters
(:func:`~._plan_algorithms.tpu_block_align`), puts the steps that undo both first, and makes
the program's key. The helpers below serve calls whose checks may fail on some ranks only
(:class:`~._plan.Plan`'s doc): :func:`one_sided` runs such checks, :func:`verdict` is the block
that tells the other ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tpu_dist.collectives._plan import GroupView, Plan, Step
from tpu_dist.collectives._plan_algorithms import Algorithm, program_key, tpu_block_align
from tpu_dist.collectives._plan_blocks import DTYPE_NAMES
from tpu_dist.collectives._plan_finish import DropTpuPadding, KeepOutputs, RefillEmptyBlocks
from tpu_dist.collectives._types import Kind


def build_plan(
    group: GroupView,
    op: str,
    kind: Kind,
    params: tuple,
    blocks: Sequence[torch.Tensor],
    steps: Sequence[Step],
    *,
    checks: int = 0,
    rejected: Exception | None = None,
    algorithm: Algorithm | None = None,
) -> Plan:
    """The plan of ``kind``'s program on ``blocks``, finished by ``steps`` (the op's own), of
    which the last ``checks`` blocks check the call (:attr:`Plan.checks`; never empty);
    ``rejected``: :attr:`Plan.rejected`; ``algorithm``: the one the blocks are laid out for, if
    the plan chose it (:func:`~._plan_algorithms.program_key`).

    Empty blocks stay out of the program (XLA refuses zero-length collectives) and get empty
    results back (:class:`~._plan_finish.RefillEmptyBlocks`); with every block empty there is
    no program (every rank of the group sees the same empty shapes, so none runs one). On TPU
    an all-gather's and a reduce-scatter's blocks are padded (:func:`_pad_for_tpu`), and the
    padding dropped first (:class:`~._plan_finish.DropTpuPadding`).
    """
    steps = tuple(steps)
    if any(b.numel() == 0 for b in blocks):
        empties = tuple(b.new_empty(0) if b.numel() == 0 else None for b in blocks)
        steps = (RefillEmptyBlocks(empties), *steps)
        blocks = [b for b in blocks if b.numel()]
    if not blocks:
        return Plan(op, None, (), steps)
    own = None  # the call's own blocks, where the program's may be padded (TPU only)
    if group.platform == "tpu" and kind in (Kind.ALLGATHER, Kind.REDUCE_SCATTER):
        own = tuple((b.numel(), DTYPE_NAMES[b.dtype]) for b in blocks)
        align = tpu_block_align(kind, group.device_kind)
        blocks, unpad = _pad_for_tpu(kind, group.size, blocks, align)
        if unpad is not None:
            steps = (unpad, *steps)
    meta = tuple((b.numel(), DTYPE_NAMES[b.dtype]) for b in blocks)
    key = program_key(
        kind, group.device_ids, meta, params, group.platform, group.family, group.device_kind,
        algorithm,
    )
    data = (own if own is not None else meta)[: len(meta) - checks]
    return Plan(
        op, key, tuple(blocks), steps, data_blocks=data if data != meta else None,
        checks=checks, rejected=rejected,
    )


def _pad_for_tpu(
    kind: Kind, size: int, blocks: Sequence[torch.Tensor], align: int
) -> tuple[Sequence[torch.Tensor], DropTpuPadding | None]:
    """``blocks`` with each rank's part padded with zeros to a multiple of ``align``
    elements (:func:`~._plan_algorithms.tpu_block_align`), and the step that drops the padding
    (None where there is none).

    An all-gather's block is this rank's part (its result: ``size`` parts); a reduce-scatter's
    block is ``size`` parts (its result: one). The padded elements of a reduce-scatter reduce
    among themselves, whatever the op, and are dropped."""
    parts = []
    for b in blocks:
        n = b.numel() if kind == Kind.ALLGATHER else b.numel() // size
        parts.append((n, -(-n // align) * align))
    if all(n == m for n, m in parts):
        return blocks, None
    padded = []
    for b, (n, m) in zip(blocks, parts):
        if n == m:
            padded.append(b)
        elif kind == Kind.ALLGATHER:
            p = b.new_zeros(m)
            p[:n] = b
            padded.append(p)
        else:
            p = b.new_zeros(size, m)
            p[:, :n] = b.view(size, n)
            padded.append(p.view(-1))
    return padded, DropTpuPadding(kind, size, tuple(parts))


def completed(op: str, outputs: Sequence[torch.Tensor]) -> Plan:
    """A plan with nothing to run whose outputs are ``outputs``."""
    return Plan(op, None, (), (KeepOutputs(tuple(outputs)),))


# -- calls rejected on some ranks only (Plan doc) ----------------------------------------------


def one_sided(check: Callable[[], object]) -> tuple[object, Exception | None]:
    """Run ``check``, the checks of a call's arguments that may differ between ranks; returns
    what it returns and None, or None and the ``ValueError``/``TypeError`` it raised."""
    try:
        return check(), None
    except (ValueError, TypeError) as err:
        return None, err


def verdict(rejected: Exception | None, slots: int = 1, slot: int = 0) -> torch.Tensor:
    """A rank's verdict on its part of a call: ``slots`` int32 words, ``slot`` set to 1 when
    ``rejected``. All-gathered (one slot) or summed (one slot per rank, this rank's set), the
    ranks' verdicts give every rank one word per rank
    (:class:`~._plan_finish.RaiseIfRejected`)."""
    verdict = torch.zeros(slots, dtype=torch.int32)
    if rejected is not None:
        verdict[slot] = 1
    return verdict
