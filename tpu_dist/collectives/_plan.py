"""The *plan* stage of a "tpu" collective: what a plan is.

A collective's life is plan -> track -> dispatch -> complete. Planning is pure: from a c10d call
and a :class:`GroupView` (rank, size, device ids, platform) one stateless function per op makes
a :class:`Plan`, which

1. has validated the call (raising ``ValueError``/``TypeError`` before anything is sent),
2. holds the 1-D blocks the program takes (zero-copy views where the layout allows: reductions
   act on values, data movement on raw words),
3. names the program: its kind *and* its algorithm, both part of the
   :class:`~tpu_dist.collectives._types.ProgramKey`,
4. and lists the finish :attr:`Plan.steps` that turn the program's result blocks into the op's
   outputs, run in order by :meth:`Plan.finish`.

The stage's modules, each importing only those above it:

* this one: :class:`GroupView`, :class:`Plan`, :class:`P2PPlan`;
* :mod:`._plan_blocks`: tensors as blocks (values, words) and results written back;
* :mod:`._plan_algorithms`: which program runs a call (:func:`~._plan_algorithms.choose_algorithm`,
  :func:`~._plan_algorithms.program_key`);
* :mod:`._plan_finish`: the finish steps, small named objects (write the outputs, drop the TPU
  padding, fail a call some rank rejected, ...);
* :mod:`._plan_build`: :func:`~._plan_build.build_plan`, what every op's plan goes through
  (empty blocks out, TPU padding, the key);
* the ops' plan functions: :mod:`._plan_collectives` (all-reduce, all-gather, reduce-scatter,
  broadcast, scatter, gather, barrier), :mod:`._plan_all_to_all`, :mod:`._plan_p2p`.

Nothing here communicates, touches a JAX device or keeps state, so every plan can be tested in
one process. Example, ``all_reduce`` of a float32 tensor of 3 elements, SUM, on rank 0 of a
2-rank CPU group over devices (0, 1)::

    plan.op     == "all_reduce"
    plan.key    == ProgramKey("allreduce", (0, 1), ((3, "float32"),), ("SUM",), "exchange")
    plan.blocks == (tensor.view(-1),)           # the tensor itself, flat
    plan.steps  == (WriteOutputs((tensor,)),)   # one step: the result written into tensor
    plan.finish([result]) writes result into tensor and returns [tensor]

Every rank of the group makes the same plan kind for the same call (the key is the same on
every rank, so every rank runs the same program); what differs between ranks is the blocks
(each rank's data) and, for rooted ops, what the finish steps write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tpu_dist.collectives._types import ProgramKey

Step = Callable[[list[torch.Tensor]], list[torch.Tensor]]
"""One finish step (:mod:`._plan_finish`): blocks in, blocks (or, for the last step, the op's
output tensors, written) out."""


def run_steps(steps: Sequence[Step], results: list[torch.Tensor]) -> list[torch.Tensor]:
    """``results`` through each of ``steps`` in order: what the last one returns."""
    for step in steps:
        results = step(results)
    return results


@dataclass(frozen=True)
class GroupView:
    """What a plan needs to know about the group: no devices, no runtime."""

    rank: int
    """This process's rank in the group."""
    size: int
    """Number of ranks in the group."""
    device_ids: tuple[int, ...]
    """JAX device id of each group rank, in group-rank order."""
    platform: str
    """The devices' platform: ``"cpu"`` or ``"tpu"`` (it decides algorithms)."""
    global_ranks: tuple[int, ...] = ()
    """Global rank of each group rank (for error messages); default: the group ranks."""
    name: str = ""
    """The group's name (for error messages)."""
    desc: str = ""
    """The group's description (``mesh_<dim>`` for a DeviceMesh dimension's group)."""
    family: tuple[tuple[int, ...], ...] = ()
    """The device ids of every group of the group's *family* (this group's row among them),
    each in group-rank order, when the group is registered as one of the equal groups of a
    mesh dimension (``tpu_dist.mesh.register_mesh``); empty otherwise. Its collectives then
    run as family programs (:attr:`ProgramKey.groups`)."""
    device_kind: str = ""
    """The devices' ``device_kind`` (``"TPU v5 lite"``, ``"cpu"``): whether a family's
    collectives run as family programs on them (:func:`uses_family_program`)."""

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self.global_ranks[self.rank] if self.global_ranks else self.rank


@dataclass(frozen=True)
class Plan:
    """One collective call, planned: the program to run, its input blocks and its finish steps.

    ``key`` is None when there is nothing to send (every block empty): the call completes at
    once with ``finish([])``. After the program ran, :meth:`finish` runs :attr:`steps` on its
    result blocks, in order. ``then`` is set for calls of two programs (an uneven all-to-all
    first agrees on the widest chunk): run this plan to completion, and ``then(outputs)`` is
    the plan of the second program.

    A call can be rejected on some ranks only, when a check reads an argument that only those
    ranks pass or that differs between ranks by design (the root's ``scatter_list``, a rank's
    own split sizes): the other ranks' calls are valid. Such a rank's plan is still made: it
    has ``rejected`` set, and its blocks carry its *verdict* (:func:`._plan_build.verdict`), so the program
    every rank runs tells every rank that the call was rejected somewhere. Every rank's finish
    step then raises (``DistBackendError`` naming the rejecting ranks) and writes nothing, the
    pipeline raises ``rejected`` on the rejecting ranks, and the group's ranks stay in step:
    no rank's next call meets another rank's rejected one.
    """

    op: str
    """The op as users know it (``all_reduce``, ``all_gather_into_tensor``)."""
    key: ProgramKey | None
    blocks: tuple[torch.Tensor, ...]
    """This rank's input blocks, 1-D, in the order of ``key.blocks``."""
    steps: tuple[Step, ...]
    """What turns the program's result blocks (in the order of ``blocks``) into the op's
    outputs: :class:`._plan_finish` steps, run in order by :meth:`finish`."""
    then: Callable[[list[torch.Tensor]], Plan] | None = None
    data_blocks: tuple[tuple[int, str], ...] | None = None
    """(length, dtype) of the call's own data blocks where they are not ``key.blocks``: the
    program's are padded (an all-gather or reduce-scatter on TPU,
    :data:`._plan_algorithms.TPU_BLOCK_ALIGN`), or
    its last blocks are checks (:attr:`checks`); None where they are ``key.blocks``."""
    checks: int = 0
    """How many of the last blocks check the call instead of carrying its data: a broadcast's
    src header, a rooted op's or an uneven all-to-all's verdicts (what compile-only reports
    leave out of a call's size)."""
    rejected: Exception | None = None
    """Why this rank rejected its part of the call, when the other ranks may not have (class
    doc): the pipeline runs the program, then raises this."""

    def finish(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """The op's outputs, written from the program's result blocks (:attr:`steps`)."""
        return run_steps(self.steps, results)


P2P_HEADER_WORDS = 8
"""int32 words of the header program every send and receive runs before its data
(:mod:`._p2p`: it carries the group, the tag and the size of the message)."""


@dataclass(frozen=True)
class P2PPlan:
    """A send or a receive, planned: two two-device permute programs from ``src`` to ``dst``,
    the message's header (``header``), then its data (``key``).

    The pair's programs run over the devices of the lower and the higher global rank, in that
    order (``key.devices``); ``key`` is None for an empty tensor (only the header moves).
    """

    op: Literal["send", "recv"]
    description: str
    """``send (peer 1, tag 0)``."""
    key: ProgramKey | None
    header: ProgramKey
    """The header's program (:data:`P2P_HEADER_WORDS` int32 words, the same direction)."""
    group: str
    """The group's name: sends and receives match within one group, as gloo's."""
    tensor: torch.Tensor
    """The tensor sent, or received into."""
    block: torch.Tensor
    """The tensor as raw words (what is sent; a recv's block only gives the program its shape)."""
    steps: tuple[Step, ...]
    """The finish steps (:class:`Plan`'s)."""
    peer: int
    """Global rank of the other end."""
    tag: int
    pair: tuple[int, int]
    """Global ranks (low, high) of the two ends: the program's devices are theirs."""
    pair_group_ranks: tuple[int, int]
    """Group ranks of ``pair``."""

    @property
    def peer_group_rank(self) -> int:
        """Group rank of the other end."""
        return self.pair_group_ranks[self.pair.index(self.peer)]

    def finish(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensor, received into or sent (:attr:`steps`)."""
        return run_steps(self.steps, results)
