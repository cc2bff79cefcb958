"""The plans of point-to-point ops: ``send``, ``recv`` and a receive from any source (plan
stage).

A send and its receive run the same two two-device permute programs, the message's header
(:data:`~._plan.P2P_HEADER_WORDS` words) and then its data, which the p2p channels
(:mod:`._p2p`) run in the sender's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tpu_dist.collectives import _checks
from tpu_dist.collectives._plan import P2P_HEADER_WORDS, GroupView, P2PPlan
from tpu_dist.collectives._plan_blocks import DTYPE_NAMES, words
from tpu_dist.collectives._plan_finish import KeepOutputs, WriteOutputs
from tpu_dist.collectives._types import Kind, ProgramKey


@dataclass(frozen=True)
class AnySourcePlan:
    """A receive from any source (``recv`` without ``src``), before its sender is known.

    An XLA program needs both ends when it is compiled, so the backend learns the sender
    first (one of :attr:`peers`) and then runs :meth:`from_source`'s plan, an ordinary
    receive from it.
    """

    group: GroupView
    tensor: torch.Tensor
    tag: int
    description: str
    """``recv (any source, tag 0)``."""
    peers: tuple[int, ...]
    """Group ranks that may be the sender: every rank but this one."""

    def from_source(self, src: int) -> P2PPlan:
        """The receive from group rank ``src``, once it is known to be the sender.

        Raises:
            ValueError: ``src`` is out of range or this rank.
        """
        return p2p(self.group, "recv", [self.tensor], src, self.tag)


def p2p(
    group: GroupView,
    op: Literal["send", "recv"],
    tensors: Sequence[torch.Tensor],
    peer: int,
    tag: int,
) -> P2PPlan:
    """A ``send`` of ``tensors[0]`` to group rank ``peer``, or a ``recv`` from it.

    The programs (the header's, then the data's) are permutes between the two ranks' devices,
    ordered by global rank: their devices are (lower, higher) global rank's, and their
    permutation ``((0, 1),)`` when the lower one sends, ``((1, 0),)`` when it receives.
    """
    is_send = op == "send"
    tensor = _checks.check_single(op, tensors)
    _checks.check_rank(op, peer, group.size, "dst" if is_send else "src")
    if not is_send:
        _checks.check_output(op, tensor, "tensor")
    if peer == group.rank:
        raise ValueError(
            f"{op}: rank {group.rank} cannot {op} to itself on the 'tpu' backend; "
            "copy the tensor locally instead."
        )
    me, other = group.global_rank, group.global_ranks[peer] if group.global_ranks else peer
    src, dst = (me, other) if is_send else (other, me)
    low, high = sorted((src, dst))
    ranks = (group.rank, peer) if me == low else (peer, group.rank)
    block = words(tensor)
    devices = (group.device_ids[ranks[0]], group.device_ids[ranks[1]])
    upward = src == low
    key = None
    if block.numel():
        key = permute_key(devices, block.numel(), DTYPE_NAMES[block.dtype], upward)
    last = KeepOutputs((tensor,)) if is_send else WriteOutputs((tensor,))
    return P2PPlan(
        op, f"{op} (peer {peer}, tag {tag})", key,
        permute_key(devices, P2P_HEADER_WORDS, "int32", upward), group.name, tensor, block,
        (last,), other, int(tag), (low, high), ranks,
    )


def permute_key(devices: tuple[int, int], length: int, dtype: str, upward: bool) -> ProgramKey:
    """The program that moves ``length`` words of ``dtype`` between the two ``devices`` (the
    lower global rank's first): from the first to the second if ``upward``, else back."""
    return ProgramKey(
        Kind.PERMUTE, devices, ((length, dtype),), ((0, 1),) if upward else ((1, 0),), "xla"
    )


def recv_any_source(
    group: GroupView, tensors: Sequence[torch.Tensor], tag: int
) -> AnySourcePlan:
    """A ``recv`` of ``tensors[0]`` from whichever rank sends to this one with ``tag``."""
    tensor = _checks.check_single("recv", tensors)
    _checks.check_output("recv", tensor, "tensor")
    peers = tuple(r for r in range(group.size) if r != group.rank)
    return AnySourcePlan(group, tensor, int(tag), f"recv (any source, tag {tag})", peers)
