"""The *plan* stage of a "tpu" collective: pure functions from a c10d call to a :class:`Plan`.

A collective's life is plan -> track -> dispatch -> complete. This module is the first stage
and only that: for each op of :class:`~tpu_dist.collectives._backend.ProcessGroupTPU` one
stateless function that

1. validates the call (raising ``ValueError``/``TypeError`` before anything is sent),
2. flattens the tensors into the 1-D blocks the program takes (zero-copy views where the
   layout allows: reductions act on values, data movement on raw words),
3. chooses the program: its kind *and* its algorithm (:func:`choose_algorithm`), both part of
   the :class:`~tpu_dist.collectives._types.ProgramKey`,
4. and returns them with the finish step that copies the result blocks into the outputs.

Nothing here communicates, touches a JAX device or keeps state: a plan is made from the
arguments and a :class:`GroupView` (rank, size, device ids, platform), so every function can be
tested in one process. Example, ``all_reduce`` of a float32 tensor of 3 elements, SUM, on rank 0
of a 2-rank CPU group over devices (0, 1)::

    plan.op     == "all_reduce"
    plan.key    == ProgramKey("allreduce", (0, 1), ((3, "float32"),), ("SUM",), "exchange")
    plan.blocks == (tensor.view(-1),)           # the tensor itself, flat
    plan.finish([result]) writes result into tensor and returns [tensor]

Every rank of the group makes the same plan kind for the same call (the key is the same on
every rank, so every rank runs the same program); what differs between ranks is the blocks
(each rank's data) and, for rooted ops, what the finish step writes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from tpu_dist.collectives import _checks
from tpu_dist.collectives._types import Kind, ProgramKey
from tpu_dist.mesh import generation_of_device_kind

Algorithm = Literal["xla", "exchange", "gather_reduce", "permute"]
"""How a program carries out its kind (:attr:`ProgramKey.algorithm`):

* ``"xla"``: XLA's own collective for the kind (``psum``, ``all_gather``, ``psum_scatter``, ...),
  which rides ICI/DCN on TPU with XLA's algorithms;
* ``"exchange"``: all-reduce, all-gather and reduce-scatter as direct all-to-all exchanges
  (every chunk sent straight to its owner; reductions done locally);
* ``"gather_reduce"``: all-reduce as an all-gather and a local reduction (the ops XLA's
  all-reduce does not have, and min/max of types XLA:TPU emulates);
* ``"permute"``: an all-to-all as one collective-permute per peer, each chunk its own block
  (:func:`permute_blocks`; CPU only).
"""

Finish = Callable[[list[torch.Tensor]], list[torch.Tensor]]
"""A plan's finish step: the program's result blocks (torch tensors, in the order of
:attr:`Plan.blocks`) in, the op's output tensors out (written)."""

PERMUTE_MIN_BYTES = 64 * 1024
"""On CPU, all-to-alls of at least this many bytes a rank run as collective-permutes
(:func:`permute_blocks`, the ``"permute"`` algorithm), not as XLA's all-to-all."""

DIRECT_EXCHANGE_MAX_BYTES = 256 * 1024
"""On CPU, all-reduces and all-gathers of at most this many bytes per rank (summed over a
call's blocks; all-gather: its output) exchange chunks directly (:func:`choose_algorithm`)."""

_TPU_EMULATED_DTYPES = frozenset({"float64", "int64", "uint64", "complex64", "complex128"})
"""Dtypes the TPU has no native type for: XLA:TPU rewrites them into 32-bit words, and its
collectives then support only part of them (see :func:`choose_algorithm`)."""

_SUMS = frozenset({"SUM", "AVG", "PREMUL_SUM"})

TPU_BLOCK_ALIGN = 128
"""On TPU, an all-gather's and a reduce-scatter's per-rank block is padded to a multiple of
this many elements (the program moves the padding; the plan's finish drops it).

The floor for TPUs the generation table does not know; an all-gather's block is padded to a
multiple of the generation's ``all_gather_block_multiple`` too (1,024 on every generation in the
table: :func:`tpu_block_align`). Measured with libtpu's compiler (docs/reference/libtpu.md;
docs/decisions/0022-tpu-block-alignment.md): an all-gather over 128 devices across two
``v5p:8x8x8`` slices of 1,950,000 bf16 elements a rank (Llama-3-70B's root-module parameters at
dp 128) took more than 8 GiB of the compiler's memory and did not compile (35-96 s, then out of
address space), while 1,950,080 (a multiple of 128) compiled in 0.6 s and 1,950,720 (of 1,024)
in 3.1 s; padding inside the program and slicing it off there did not help (XLA folds the slice
into the collective). Within a slice, 1,000,000 elements became an all-reduce of the whole
output, 1,000,064 (of 128) compiled in 16-33 s on v4, v5e and v6e, 1,000,448 (of 1,024) as a
plain all-gather in under 1.5 s. The padding costs one copy of the output on the host."""


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
    """One collective call, planned: the program to run, its input blocks and its finish step.

    ``key`` is None when there is nothing to send (every block empty): the call completes at
    once with ``finish([])``. ``then`` is set for calls of two programs (an uneven all-to-all
    first agrees on the widest chunk): run this plan to completion, and ``then(outputs)`` is
    the plan of the second program.

    A call can be rejected on some ranks only, when a check reads an argument that only those
    ranks pass or that differs between ranks by design (the root's ``scatter_list``, a rank's
    own split sizes): the other ranks' calls are valid. Such a rank's plan is still made: it
    has ``rejected`` set, and its blocks carry its *verdict* (:func:`_verdict`), so the program
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
    finish: Finish
    then: Callable[[list[torch.Tensor]], Plan] | None = None
    data_blocks: tuple[tuple[int, str], ...] | None = None
    """(length, dtype) of the call's own data blocks where they are not ``key.blocks``: the
    program's are padded (an all-gather or reduce-scatter on TPU, :data:`TPU_BLOCK_ALIGN`), or
    its last blocks are checks (:attr:`checks`); None where they are ``key.blocks``."""
    checks: int = 0
    """How many of the last blocks check the call instead of carrying its data: a broadcast's
    src header, a rooted op's or an uneven all-to-all's verdicts (what compile-only reports
    leave out of a call's size)."""
    rejected: Exception | None = None
    """Why this rank rejected its part of the call, when the other ranks may not have (class
    doc): the pipeline runs the program, then raises this."""


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
    finish: Finish
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


# -- algorithms ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _bytes(blocks: tuple[tuple[int, str], ...]) -> int:
    return sum(n * _itemsize(dtype) for n, dtype in blocks)


@functools.lru_cache(maxsize=4096)
def choose_algorithm(
    kind: Kind | str, blocks: tuple[tuple[int, str], ...], params: tuple, platform: str, size: int
) -> Algorithm:
    """The algorithm of ``kind``'s program over ``size`` devices of ``platform``.

    Args:
        kind: The program kind (a :class:`~._types.Kind`; its value as a string works too).
        blocks: (length, dtype name) of each block, as in :attr:`ProgramKey.blocks`.
        params: The kind's params (a reducing kind's first one is its reduce op name).
        platform: ``"cpu"`` or ``"tpu"``.
        size: Number of devices (group ranks).

    The rules, and why (measured: docs/decisions/0006-cpu-direct-exchanges.md, and
    tests/test_tpu_compile.py):

    * TPU, 64-bit or complex blocks: XLA:TPU emulates them with 32-bit words, and its
      collectives reject part of that (libtpu: docs/reference/libtpu.md): an all-reduce of
      float64/int64 supports only sums (``UNIMPLEMENTED: Supported lowering only of Sum all
      reduce``), so MAX/MIN become ``"gather_reduce"`` (``size`` times the input moves, on types
      rare in collectives); a reduce-scatter of float64 supports nothing (``Supported lowering
      only of Sum reduce-scatter``; complex: ``... not to contain X{64|128} element types
      ...``), so it is an ``"exchange"`` (the same bytes per rank). tests/test_tpu_compile.py
      compiles them.
    * CPU, reduce-scatter at every size: ``"exchange"``. XLA:CPU's reduce-scatter copies its
      input to a temporary and runs gloo's halving-doubling on it; an all-to-all sends each
      chunk straight to its owner (16 MiB: 2 ranks 13.6 vs 19.3 ms, 4 ranks 23.6 vs 38.2 ms).
    * CPU, all-reduce and all-gather up to :data:`DIRECT_EXCHANGE_MAX_BYTES` per rank:
      ``"exchange"``. A ring takes ``size - 1`` rounds of messages per pass, and on a busy
      host every round waits for a thread to be scheduled, while an all-to-all posts every
      message at once (160 KB all_reduce: 2 ranks 0.70 vs 1.12 ms, 4 ranks 3.2 vs 7.3 ms).
      Larger messages are bound by copies, where the ring wins (16 MiB, 2 ranks: 23.5 vs
      18.6 ms).
    * CPU, all-to-all of at least :data:`PERMUTE_MIN_BYTES` a rank: ``"permute"``. XLA:CPU's
      all-to-all of one block copies each peer's chunk out of it before sending and joins the
      chunks it receives into one result after (two copies of the data); one
      collective-permute per peer, on chunks the plan passes as blocks of their own (views of
      the tensor), moves the same bytes without them (2 ranks: 1 MiB 0.53 vs 1.04 ms, 16 MiB
      12.0 vs 24.6 ms, gloo 0.48 and 11.4; 4 ranks: 2 MiB 2.8 vs 4.1 ms, 16 MiB 27.3 vs
      34.2 ms, gloo 2.4 and 22.3; docs/decisions/0033-varying-sizes-and-memory.md).
      Smaller ones keep the all-to-all: one message round instead of ``size - 1``.
    * Otherwise XLA's own collective (``"xla"``; TPUs ride ICI with it), except for the
      reductions XLA does not have: an all-reduce with PRODUCT or a bitwise op is a
      ``"gather_reduce"``, a reduce-scatter with anything but a sum an ``"exchange"``.

    A group of one device always takes ``"xla"`` for its sums (there is nothing to exchange).
    """
    kind = Kind(kind)
    reduce_op = params[0] if kind.reduces and params else None
    if platform == "tpu" and kind.reduces and any(
        dtype in _TPU_EMULATED_DTYPES for _, dtype in blocks
    ):
        if kind == Kind.REDUCE_SCATTER:
            return "exchange"
        if reduce_op in ("MAX", "MIN"):
            return "gather_reduce"
    if platform == "cpu" and size >= 2:
        if kind == Kind.REDUCE_SCATTER:
            return "exchange"
        if kind == Kind.ALLTOALL and _bytes(blocks) >= PERMUTE_MIN_BYTES:
            return "permute"
        if kind in (Kind.ALLREDUCE, Kind.ALLGATHER) and blocks and min(n for n, _ in blocks) > 0:
            per_rank = sum(n * _itemsize(dtype) for n, dtype in blocks)
            if kind == Kind.ALLGATHER:
                per_rank *= size
            if per_rank <= DIRECT_EXCHANGE_MAX_BYTES:
                return "exchange"
    if kind == Kind.ALLREDUCE and reduce_op is not None and reduce_op not in _SUMS | {"MAX", "MIN"}:
        return "gather_reduce"
    if kind == Kind.REDUCE_SCATTER and reduce_op is not None and reduce_op not in _SUMS:
        return "exchange"
    return "xla"


def program_key(
    kind: str,
    device_ids: tuple[int, ...],
    blocks: tuple[tuple[int, str], ...],
    params: tuple,
    platform: str,
    family: tuple[tuple[int, ...], ...] = (),
    device_kind: str = "",
    algorithm: Algorithm | None = None,
) -> ProgramKey:
    """The :class:`ProgramKey` of ``kind`` over ``device_ids``, its algorithm chosen by
    :func:`choose_algorithm` (as the backend chooses it), or ``algorithm`` where the plan chose
    it already (a ``"permute"`` all-to-all's blocks are laid out for it).

    With a ``family`` (:attr:`GroupView.family`: the device ids of each of its groups, one of
    them ``device_ids``) of two or more groups of two or more devices, the key is the family
    program's: its devices are every group's, group after group, and ``groups`` their number.
    Every group of the family then has the same key. Where family programs are not used
    (:func:`uses_family_program`: TPU generations other than v5e and v6e) the key is the
    group's own.
    """
    size = len(device_ids)
    if algorithm is None:
        algorithm = choose_algorithm(kind, blocks, params, platform, size)
    grouped = len(family) >= 2 and size >= 2 and uses_family_program(platform, device_kind)
    if not grouped:
        return ProgramKey(kind, device_ids, blocks, params, algorithm)
    every = tuple(d for row in family for d in row)
    return ProgramKey(kind, every, blocks, params, algorithm, len(family))


def uses_family_program(platform: str, device_kind: str) -> bool:
    """Whether a family's groups run their collectives as family programs on these devices.

    * CPU: always (XLA:CPU makes one communicator per replica group, so only the group's own
      ranks take part, as with its own program; the CPU then runs what v5e and v6e run).
    * TPU generations whose compiler needs collectives to span the slice
      (``Generation.collectives_span_slice``: v5e, v6e), and TPU devices of a kind
      ``tpu_dist.mesh`` does not know: always.
    * Other TPU generations (v4, v5p, TPU7x): never. The group's own program compiles there for
      every kind at any scale, and the family program costs more for nothing: over
      ``tpu7x:16x16x16`` (8,192 devices) the family programs of the FSDP2 x TP example took
      25-52 s each to compile against 2-4 s for the groups' own, in the same run
      (docs/decisions/0020-family-programs.md). (A TPU7x program over a whole slice compiles
      only with the generation's compiler options, ``Generation.collective_compiler_options``:
      docs/decisions/0021-tpu7x-sparsecore-all-reduce-offload-off.md.)
    """
    if platform != "tpu":
        return True
    generation = generation_of_device_kind(device_kind)
    return generation is None or generation.collectives_span_slice


# -- blocks --------------------------------------------------------------------------------

#: torch dtype -> the JAX/numpy dtype name a block of it becomes (torch.float32 -> "float32").
DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in _checks.SUPPORTED_DTYPES}

_WORD_DTYPES = {1: torch.int8, 2: torch.int16}


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of ``tensor`` (a copy only when it is not contiguous)."""
    return tensor.contiguous().view(-1) if tensor.dim() != 1 or not tensor.is_contiguous() else tensor


def values(tensor: torch.Tensor) -> torch.Tensor:
    """The flat tensor as reduction operands: bool becomes uint8 0/1, complex its (real, imag)
    pairs (complex reductions, SUM/AVG/PREMUL_SUM with a real factor, act on each part alone;
    and XLA:TPU has no complex128 at all)."""
    block = flat(tensor)
    if block.dtype == torch.bool:
        return block.view(torch.uint8)
    if block.is_complex():
        return torch.view_as_real(block.resolve_conj()).view(-1)
    return block


def words(tensor: torch.Tensor) -> torch.Tensor:
    """The flat tensor as raw words: int8/int16 for 1/2-byte dtypes, else int32."""
    block = flat(tensor)
    return block.view(_WORD_DTYPES.get(block.element_size(), torch.int32))


def exchange_words(block: torch.Tensor, parts: int) -> torch.Tensor:
    """Raw words (:func:`words`' block) to move in ``parts`` equal parts (an all-to-all's
    chunks, one per peer), as 32-bit words when each part is a whole number of them.

    The same bytes; only the word width changes, and it depends only on the shape and dtype
    (so every rank picks the same program). libtpu (docs/reference/libtpu.md) compiles an
    all-to-all of 16- or
    8-bit words slowly and, from some size on, not at all, where 32-bit words of the same
    bytes take a fraction of a second: 32 MiB a rank over 4 devices, bf16 12-28 s on v5e, v6e
    and v5p and ``RET_CHECK ... async-update`` on TPU7x (int8 too), float32 0.3 s on each (and
    128 MiB 0.3 s on TPU7x) (docs/decisions/0023-all-to-alls-move-32-bit-words.md). The
    uneven all-to-all pads its rows
    to whole 32-bit words for the same reason.
    """
    ratio = _per_word32(block)
    if ratio == 1 or block.numel() % (ratio * parts):
        return block
    try:
        return block.view(torch.int32)
    except RuntimeError:  # a view at an offset that is no multiple of 4 bytes: an aligned copy
        return block.clone().view(torch.int32)


def _per_word32(block: torch.Tensor) -> int:
    """How many of ``block``'s words make one 32-bit word (1 for 32-bit words and wider)."""
    return max(1, 4 // block.element_size())


def word_count(tensor: torch.Tensor) -> int:
    """How many words :func:`words` makes of ``tensor``."""
    size = tensor.element_size()
    return tensor.numel() * (size // 4 if size >= 4 else 1)


def write(out: torch.Tensor, result: torch.Tensor) -> None:
    """Copy a flat result block (values or words) into ``out``, any layout."""
    if result.dtype != out.dtype:
        result = result.view(out.dtype)
    if result.shape != out.shape:
        result = result.view(out.shape)
    if _checks.shares_memory_within(out):
        # An expanded tensor of an in-place op: elements that share memory hold one value
        # (gloo accepts these too); write it once, through the first index of each such dim.
        for dim, (size, stride) in enumerate(zip(out.shape, out.stride())):
            if stride == 0 and size > 1:
                out, result = out.narrow(dim, 0, 1), result.narrow(dim, 0, 1)
    out.copy_(result)


def reduce_params(op_name: str, opts_op: dist.ReduceOp, dtype: torch.dtype) -> tuple:
    """The program params of a reduction: ``(op name,)``, or ``("PREMUL_SUM", factor)``.

    Raises:
        TypeError: ``opts_op`` is not defined for ``dtype``.
    """
    reduce_op = _checks.reduce_op_name(opts_op)
    _checks.check_reduce_op(op_name, reduce_op, dtype)
    if dtype == torch.bool:
        # On 0/1 bytes: SUM and BOR are "any", PRODUCT and BAND are "all".
        reduce_op = {"SUM": "MAX", "BOR": "MAX", "PRODUCT": "MIN", "BAND": "MIN"}.get(
            reduce_op, reduce_op
        )
    if reduce_op == "PREMUL_SUM":
        factor = opts_op.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return (reduce_op, float(factor))
    return (reduce_op,)


def _program(
    group: GroupView,
    op: str,
    kind: Kind,
    params: tuple,
    blocks: Sequence[torch.Tensor],
    finish: Finish,
    *,
    checks: int = 0,
    rejected: Exception | None = None,
    algorithm: Algorithm | None = None,
) -> Plan:
    """The plan of ``kind``'s program on ``blocks``, of which the last ``checks`` check the call
    (:attr:`Plan.checks`; never empty); ``rejected``: :attr:`Plan.rejected`; ``algorithm``:
    the one the blocks are laid out for, if the plan chose it (:func:`program_key`).

    Empty blocks stay out of the program (XLA refuses zero-length collectives) and get empty
    results back; with every block empty there is no program (every rank of the group sees the
    same empty shapes, so none runs one).
    """
    if all(b.numel() == 0 for b in blocks):
        empty = [b.new_empty(0) for b in blocks]
        return Plan(op, None, (), lambda results: finish(empty))
    if any(b.numel() == 0 for b in blocks):
        empties = [b.new_empty(0) if b.numel() == 0 else None for b in blocks]
        blocks = [b for b in blocks if b.numel()]
        whole = finish

        def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
            it = iter(results)
            return whole([e if e is not None else next(it) for e in empties])

    own = None  # the call's own blocks, where the program's may be padded (TPU only)
    if group.platform == "tpu" and kind in (Kind.ALLGATHER, Kind.REDUCE_SCATTER):
        own = tuple((b.numel(), DTYPE_NAMES[b.dtype]) for b in blocks)
        align = tpu_block_align(kind, group.device_kind)
        blocks, finish = _aligned_for_tpu(kind, group.size, blocks, finish, align)
    meta = tuple((b.numel(), DTYPE_NAMES[b.dtype]) for b in blocks)
    key = program_key(
        kind, group.device_ids, meta, params, group.platform, group.family, group.device_kind,
        algorithm,
    )
    data = (own if own is not None else meta)[: len(meta) - checks]
    return Plan(
        op, key, tuple(blocks), finish, data_blocks=data if data != meta else None,
        checks=checks, rejected=rejected,
    )


def tpu_block_align(kind: Kind, device_kind: str) -> int:
    """The multiple of elements each rank's part of a TPU all-gather or reduce-scatter is
    padded to on devices of ``device_kind``: :data:`TPU_BLOCK_ALIGN`, and for an all-gather
    also a multiple of the generation's ``all_gather_block_multiple``
    (``tpu_dist.mesh.Generation``: 1,024 on every generation in the table)."""
    generation = generation_of_device_kind(device_kind)
    if kind != Kind.ALLGATHER or generation is None:
        return TPU_BLOCK_ALIGN
    return math.lcm(TPU_BLOCK_ALIGN, generation.all_gather_block_multiple)


def _aligned_for_tpu(
    kind: Kind, size: int, blocks: Sequence[torch.Tensor], finish: Finish, align: int
) -> tuple[Sequence[torch.Tensor], Finish]:
    """``blocks`` with each rank's part padded with zeros to a multiple of ``align``
    elements (:func:`tpu_block_align`), and the finish step that drops the padding first.

    An all-gather's block is this rank's part (its result: ``size`` parts); a reduce-scatter's
    block is ``size`` parts (its result: one). The padded elements of a reduce-scatter reduce
    among themselves, whatever the op, and are dropped."""
    parts = []
    for b in blocks:
        n = b.numel() if kind == Kind.ALLGATHER else b.numel() // size
        parts.append((n, -(-n // align) * align))
    if all(n == m for n, m in parts):
        return blocks, finish
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
    whole = finish

    def unpadded(results: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for r, (n, m) in zip(results, parts):
            if n == m:
                out.append(r)
            elif kind == Kind.ALLGATHER:
                out.append(r.view(size, m)[:, :n].reshape(-1))
            else:
                out.append(r[:n])
        return whole(out)

    return padded, unpadded


def _completed(op: str, outputs: list[torch.Tensor]) -> Plan:
    """A plan with nothing to run whose outputs are ``outputs``."""
    return Plan(op, None, (), lambda results: outputs)


def _writes(outputs: Sequence[torch.Tensor]) -> Finish:
    """The finish step that writes result block ``i`` into ``outputs[i]``."""

    def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
        for out, result in zip(outputs, results):
            write(out, result)
        return list(outputs)

    return finish


def _one_kind(op: str, tensors: Sequence[torch.Tensor], reduce_op: dist.ReduceOp) -> tuple:
    """The one params tuple of a coalesced reduction; its dtypes must map ``reduce_op`` alike."""
    params = {reduce_params(op, reduce_op, t.dtype) for t in tensors}
    if len(params) != 1:
        raise TypeError(
            f"{op}: the tensors' dtypes {sorted({str(t.dtype) for t in tensors})} map "
            "ReduceOp to different operations; coalesce tensors of one kind "
            "(floating, integer or bool) per call."
        )
    return params.pop()


def _check_pair(
    op: str, group: GroupView, big: torch.Tensor, small: torch.Tensor, what: str
) -> None:
    """``big`` holds ``group.size`` times ``small``'s elements, of its dtype."""
    _checks.check_tensor(op, small, "input")
    _checks.check_tensor(op, big, what)
    _checks.check_same(op, small, big, what)
    _checks.check_numel(op, big, small.numel() * group.size, what)


def _check_coalesced_pairs(
    op: str,
    group: GroupView,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    outputs_are_big: bool,
) -> None:
    """One output per input, each pair a :func:`_check_pair` (the gathered side ``group.size``
    times the other: the outputs of an all-gather, the inputs of a reduce-scatter)."""
    if len(outputs) != len(inputs):
        raise ValueError(
            f"{op}: got {len(outputs)} outputs for {len(inputs)} inputs; pass one "
            "output per input."
        )
    for i, (out, inp) in enumerate(zip(outputs, inputs)):
        if outputs_are_big:
            _check_pair(op, group, out, inp, f"outputs[{i}]")
        else:
            _check_pair(op, group, inp, out, f"inputs[{i}]")
        _checks.check_output(op, out, f"outputs[{i}]")


def _check_outputs(
    op: str, reference: torch.Tensor, outputs: Sequence[torch.Tensor], what: str
) -> None:
    """Each of ``outputs`` can receive one rank's copy of ``reference``."""
    for i, out in enumerate(outputs):
        _checks.check_tensor(op, out, f"{what}[{i}]")
        _checks.check_same(op, reference, out, f"{what}[{i}]")
        _checks.check_numel(op, out, reference.numel(), f"{what}[{i}]")
        _checks.check_output(op, out, f"{what}[{i}]")


def _one_list(op: str, lists: Sequence, what: str) -> list:
    """The single list c10d wraps a per-rank tensor list in."""
    if len(lists) != 1:
        raise ValueError(
            f"{op}: expected one {what} (c10d passes [list]), got {len(lists)}; pass a single "
            "list with one tensor per rank."
        )
    return lists[0]


# -- calls rejected on some ranks only (Plan doc) ----------------------------------------------


def _one_sided(check: Callable[[], object]) -> tuple[object, Exception | None]:
    """Run ``check``, the checks of a call's arguments that may differ between ranks; returns
    what it returns and None, or None and the ``ValueError``/``TypeError`` it raised."""
    try:
        return check(), None
    except (ValueError, TypeError) as err:
        return None, err


def _verdict(rejected: Exception | None, slots: int = 1, slot: int = 0) -> torch.Tensor:
    """A rank's verdict on its part of a call: ``slots`` int32 words, ``slot`` set to 1 when
    ``rejected``. All-gathered (one slot) or summed (one slot per rank, this rank's set), the
    ranks' verdicts give every rank one word per rank (:func:`_raise_if_rejected`)."""
    verdict = torch.zeros(slots, dtype=torch.int32)
    if rejected is not None:
        verdict[slot] = 1
    return verdict


def _raise_if_rejected(group: GroupView, op: str, verdicts: Sequence[int]) -> None:
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


# -- all-reduce ----------------------------------------------------------------------------


def all_reduce(group: GroupView, tensors: Sequence[torch.Tensor], reduce_op: dist.ReduceOp) -> Plan:
    """``all_reduce``: every rank's tensor becomes the reduction over the group (in place)."""
    op = "all_reduce"
    tensor = _checks.check_single(op, tensors)
    params = reduce_params(op, reduce_op, tensor.dtype)
    return _program(group, op, Kind.ALLREDUCE, params, [values(tensor)], _writes([tensor]))


def all_reduce_coalesced(
    group: GroupView, tensors: Sequence[torch.Tensor], reduce_op: dist.ReduceOp
) -> Plan:
    """``all_reduce_coalesced``: each tensor all-reduced, in one program."""
    op = "all_reduce_coalesced"
    for i, t in enumerate(tensors):
        _checks.check_tensor(op, t, f"tensors[{i}]")
    if not tensors:
        return _completed(op, [])
    params = _one_kind(op, tensors, reduce_op)
    blocks = [values(t) for t in tensors]
    return _program(group, op, Kind.ALLREDUCE, params, blocks, _writes(tensors))


def reduce(
    group: GroupView, tensors: Sequence[torch.Tensor], root: int, reduce_op: dist.ReduceOp
) -> Plan:
    """``reduce``: the root's tensor becomes the reduction; the others' are left as they were.

    Every rank runs the all-reduce program (the reduction is computed everywhere); only the
    root's finish step writes.
    """
    op = "reduce"
    tensor = _checks.check_single(op, tensors)
    _checks.check_rank(op, root, group.size, "root")
    params = reduce_params(op, reduce_op, tensor.dtype)
    finish = _writes([tensor]) if group.rank == root else lambda results: [tensor]
    return _program(group, op, Kind.ALLREDUCE, params, [values(tensor)], finish)


# -- all-gather ----------------------------------------------------------------------------


def _scatter_rows(outputs: Sequence[torch.Tensor], size: int) -> Finish:
    """The finish step that writes row ``r`` of the gathered block into ``outputs[r]``."""

    def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
        for out, chunk in zip(outputs, results[0].chunk(size)):
            write(out, chunk)
        return list(outputs)

    return finish


def all_gather(
    group: GroupView,
    output_tensors: Sequence[Sequence[torch.Tensor]],
    input_tensors: Sequence[torch.Tensor],
) -> Plan:
    """``all_gather``: ``output_tensors[0][r]`` gets rank r's tensor, on every rank."""
    op = "all_gather"
    tensor = _checks.check_single(op, input_tensors)
    outputs = _one_list(op, output_tensors, "output list")
    _checks.check_list(op, outputs, group.size, "output tensor list")
    _check_outputs(op, tensor, outputs, "output_tensor_list")
    finish = _scatter_rows(outputs, group.size)
    return _program(group, op, Kind.ALLGATHER, (), [words(tensor)], finish)


def all_gather_into_tensor(
    group: GroupView, output: torch.Tensor, input: torch.Tensor
) -> Plan:
    """``all_gather_into_tensor``: ``output`` is every rank's ``input``, in rank order."""
    op = "all_gather_into_tensor"
    _check_pair(op, group, output, input, "output")
    _checks.check_output(op, output, "output")
    return _program(group, op, Kind.ALLGATHER, (), [words(input)], _writes([output]))


def all_gather_into_tensor_coalesced(
    group: GroupView, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> Plan:
    """``all_gather_into_tensor`` of each input into its output, in one program."""
    op = "all_gather_into_tensor_coalesced"
    _check_coalesced_pairs(op, group, outputs, inputs, outputs_are_big=True)
    if not inputs:
        return _completed(op, [])
    return _program(group, op, Kind.ALLGATHER, (), [words(t) for t in inputs], _writes(outputs))


def all_gather_coalesced(
    group: GroupView,
    output_lists: Sequence[Sequence[torch.Tensor]],
    input_tensors: Sequence[torch.Tensor],
) -> Plan:
    """``all_gather_coalesced``: ``output_lists[r][i]`` gets rank r's ``input_tensors[i]``."""
    op = "all_gather_coalesced"
    _checks.check_list(op, output_lists, group.size, "output_tensor_lists")
    for i, t in enumerate(input_tensors):
        _checks.check_tensor(op, t, f"input_tensor_list[{i}]")
    for r, outputs in enumerate(output_lists):
        if len(outputs) != len(input_tensors):
            raise ValueError(
                f"{op}: output_tensor_lists[{r}] has {len(outputs)} tensors for "
                f"{len(input_tensors)} inputs; pass one output per input for every rank."
            )
        for i, (out, inp) in enumerate(zip(outputs, input_tensors)):
            what = f"output_tensor_lists[{r}][{i}]"
            _checks.check_tensor(op, out, what)
            _checks.check_same(op, inp, out, what)
            _checks.check_numel(op, out, inp.numel(), what)
            _checks.check_output(op, out, what)
    if not input_tensors:
        return _completed(op, [])
    size = group.size

    def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
        for i, gathered in enumerate(results):
            for outputs, chunk in zip(output_lists, gathered.chunk(size)):
                write(outputs[i], chunk)
        return [out for outputs in output_lists for out in outputs]

    return _program(group, op, Kind.ALLGATHER, (), [words(t) for t in input_tensors], finish)


def gather(
    group: GroupView,
    output_tensors: Sequence[Sequence[torch.Tensor]],
    input_tensors: Sequence[torch.Tensor],
    root: int,
) -> Plan:
    """``gather``: the root's ``gather_list[r]`` gets rank r's tensor (an all-gather whose
    result only the root writes).

    Only the root reads ``gather_list`` (the others must pass none), so its checks can fail on
    some ranks only: every rank all-gathers a one-word verdict beside its tensor, and a call
    rejected anywhere fails on every rank (:class:`Plan`).
    """
    op = "gather"
    tensor = _checks.check_single(op, input_tensors)
    _checks.check_rank(op, root, group.size, "root")
    outputs, rejected = _one_sided(
        lambda: _gather_list(op, group, tensor, output_tensors, root)
    )
    write_rows = _scatter_rows(outputs or [], group.size)

    def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
        _raise_if_rejected(group, op, results[1].tolist())
        return write_rows(results[:1])

    blocks = [words(tensor), _verdict(rejected)]
    return _program(
        group, op, Kind.ALLGATHER, (), blocks, finish, checks=1, rejected=rejected
    )


def _gather_list(
    op: str,
    group: GroupView,
    tensor: torch.Tensor,
    output_tensors: Sequence[Sequence[torch.Tensor]],
    root: int,
) -> list[torch.Tensor]:
    """The root's checked ``gather_list`` ([] on the other ranks, which must pass none)."""
    if group.rank != root:
        if output_tensors and any(output_tensors):
            raise ValueError(
                f"{op}: gather_list must be empty or None on non-root rank {group.rank} "
                f"(root is {root})."
            )
        return []
    if len(output_tensors) != 1:
        raise ValueError(
            f"{op}: the root needs one gather_list, got {len(output_tensors)}; pass "
            "gather_list with one tensor per rank on the root."
        )
    outputs = list(output_tensors[0])
    _checks.check_list(op, outputs, group.size, "gather_list")
    _check_outputs(op, tensor, outputs, "gather_list")
    return outputs


# -- reduce-scatter ------------------------------------------------------------------------


def reduce_scatter(
    group: GroupView,
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[Sequence[torch.Tensor]],
    reduce_op: dist.ReduceOp,
) -> Plan:
    """``reduce_scatter``: rank r's output is the reduction of every rank's ``input_list[r]``."""
    op = "reduce_scatter"
    output = _checks.check_single(op, output_tensors)
    _checks.check_output(op, output, "output")
    inputs = _one_list(op, input_tensors, "input list")
    _checks.check_list(op, inputs, group.size, "input_list")
    for i, t in enumerate(inputs):
        _checks.check_tensor(op, t, f"input_list[{i}]")
        _checks.check_same(op, output, t, f"input_list[{i}]")
        _checks.check_numel(op, t, output.numel(), f"input_list[{i}]")
    params = reduce_params(op, reduce_op, output.dtype)
    stacked = values(torch.cat([flat(t) for t in inputs]))
    return _program(group, op, Kind.REDUCE_SCATTER, params, [stacked], _writes([output]))


def reduce_scatter_tensor(
    group: GroupView, output: torch.Tensor, input: torch.Tensor, reduce_op: dist.ReduceOp
) -> Plan:
    """``reduce_scatter_tensor``: rank r's output is the reduction of chunk r of every input."""
    op = "reduce_scatter_tensor"
    _check_pair(op, group, input, output, "input")
    _checks.check_output(op, output, "output")
    params = reduce_params(op, reduce_op, input.dtype)
    return _program(group, op, Kind.REDUCE_SCATTER, params, [values(input)], _writes([output]))


def reduce_scatter_tensor_coalesced(
    group: GroupView,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    reduce_op: dist.ReduceOp,
) -> Plan:
    """``reduce_scatter_tensor`` of each input into its output, in one program."""
    op = "reduce_scatter_tensor_coalesced"
    _check_coalesced_pairs(op, group, outputs, inputs, outputs_are_big=False)
    if not inputs:
        return _completed(op, [])
    params = _one_kind(op, inputs, reduce_op)
    blocks = [values(t) for t in inputs]
    return _program(group, op, Kind.REDUCE_SCATTER, params, blocks, _writes(outputs))


# -- broadcast and scatter -------------------------------------------------------------------


def broadcast(group: GroupView, tensors: Sequence[torch.Tensor], root: int) -> Plan:
    """``broadcast``: every rank's tensor becomes the root's.

    Every rank also adds ``(src + 1, (src + 1)**2)`` over the group in the same program (a
    second block, the header): both sums are ``size`` times this rank's values on every rank
    only if every rank passed the same src (equal mean and mean of squares: no spread). Ranks
    that disagree on src would otherwise get a sum of several ranks' data, silently; with the
    header every rank raises ``DistBackendError`` and leaves its tensor unchanged.
    """
    op = "broadcast"
    tensor = _checks.check_single(op, tensors)
    _checks.check_rank(op, root, group.size, "src")
    is_root = group.rank == root
    mark = root + 1
    header = torch.tensor([mark, mark * mark], dtype=torch.int32)
    size = group.size

    def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
        total, squares = results[1].tolist()
        if (total, squares) != (size * mark, size * mark * mark):
            raise dist.DistBackendError(
                f"tpu_dist: broadcast on rank {group.global_rank} of group {group.name!r}: "
                f"the ranks of the group passed different src values (this rank: "
                f"src={root}; the group's mean: {total / size - 1:g}). Every rank must pass "
                "the same src; the tensor was left unchanged."
            )
        if not is_root:
            write(tensor, results[0])
        return [tensor]

    blocks = [words(tensor), header]
    return _program(group, op, Kind.BROADCAST, (root, True), blocks, finish, checks=1)


def scatter(
    group: GroupView,
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[Sequence[torch.Tensor]],
    root: int,
) -> Plan:
    """``scatter``: rank r's output gets the root's ``scatter_list[r]``.

    Only the root reads ``scatter_list`` (the others must pass none), so its checks can fail on
    some ranks only: every rank adds its verdict (one word per rank) to the program, summed
    over the group, and a call rejected anywhere fails on every rank (:class:`Plan`).
    """
    op = "scatter"
    output = _checks.check_single(op, output_tensors)
    _checks.check_rank(op, root, group.size, "src")
    out_words = words(output)
    block, rejected = _one_sided(
        lambda: _scatter_block(op, group, output, input_tensors, root)
    )
    if block is None:
        block = out_words.new_zeros(out_words.numel() * group.size)
    write_output = _writes([output])

    def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
        _raise_if_rejected(group, op, results[-1].tolist())
        return write_output(results[:1])

    verdicts = _verdict(rejected, group.size, group.rank)
    return _program(
        group, op, Kind.SCATTER, (root, True), [block, verdicts], finish, checks=1,
        rejected=rejected,
    )


def _scatter_block(
    op: str,
    group: GroupView,
    output: torch.Tensor,
    input_tensors: Sequence[Sequence[torch.Tensor]],
    root: int,
) -> torch.Tensor:
    """This rank's block of a scatter (the root's ``scatter_list`` as words, zeros on the
    others, which must pass none), after the checks that may differ between ranks."""
    _checks.check_output(op, output, "output")
    if group.rank != root:
        if input_tensors and any(input_tensors):
            raise ValueError(
                f"{op}: scatter_list must be empty or None on non-root rank "
                f"{group.rank} (root is {root})."
            )
        out_words = words(output)
        return out_words.new_zeros(out_words.numel() * group.size)
    if len(input_tensors) != 1:
        raise ValueError(
            f"{op}: the root needs one scatter_list, got {len(input_tensors)}; pass "
            "scatter_list with one tensor per rank on the root."
        )
    inputs = input_tensors[0]
    _checks.check_list(op, inputs, group.size, "scatter_list")
    for i, t in enumerate(inputs):
        _checks.check_tensor(op, t, f"scatter_list[{i}]")
        _checks.check_same(op, output, t, f"scatter_list[{i}]")
        _checks.check_numel(op, t, output.numel(), f"scatter_list[{i}]")
    return words(torch.cat([flat(t) for t in inputs]))


# -- all-to-all ----------------------------------------------------------------------------


def all_to_all_single(
    group: GroupView,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
) -> Plan:
    """``all_to_all_single``: rank r's rows ``input_split_sizes[j]`` go to rank j, which puts
    them at its ``output_split_sizes[r]`` rows. Without split sizes, equal splits of dim 0.

    With split sizes every rank passes its own (and its own row counts), so their checks can
    fail on some ranks only: they fail the call on every rank (:func:`_uneven_all_to_all`).
    """
    op = "all_to_all_single"
    if input_split_sizes or output_split_sizes:
        parts, rejected = _one_sided(
            lambda: _single_parts(op, group, output, input, output_split_sizes,
                                  input_split_sizes)
        )
        if rejected is not None:
            return _uneven_all_to_all(group, op, [], [], lambda results: [], rejected)
        return _uneven_all_to_all(group, op, *parts)
    _checks.check_tensor(op, input, "input")
    _checks.check_tensor(op, output, "output")
    _checks.check_same(op, input, output, "output")
    _checks.check_output(op, output, "output")
    _check_a2a_shapes(op, output, input)
    _checks.check_splits(op, [], group.size, input.shape[0], "input")
    _checks.check_numel(op, output, input.numel(), "output")
    block = exchange_words(words(input), group.size)
    if _permutes(group, block):
        size, rank = group.size, group.rank
        chunks = list(block.view(size, -1))
        out_words = words(output) if output.is_contiguous() else None

        target = _as_words(out_words, block.dtype) if out_words is not None else None

        def finish(received: list[torch.Tensor]) -> list[torch.Tensor]:
            by_source = from_permutes(received, chunks[rank], rank)
            if target is not None:  # each chunk straight into its place in the output
                torch.cat(by_source, out=target)
            else:
                write(output, torch.cat(by_source))
            return [output]

        return _program(group, op, Kind.ALLTOALL, (), permute_blocks(chunks, rank), finish,
                        algorithm="permute")
    return _program(group, op, Kind.ALLTOALL, (), [block], _writes([output]))


def _as_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``tensor`` viewed as ``dtype`` words, or None where no view can (an offset that is no
    multiple of the wider word)."""
    try:
        return tensor.view(dtype)
    except RuntimeError:
        return None


def _permutes(group: GroupView, block: torch.Tensor) -> bool:
    """Whether an all-to-all of ``block`` (this rank's chunks, one per rank) runs as
    collective-permutes (:func:`choose_algorithm`)."""
    meta = ((block.numel(), DTYPE_NAMES[block.dtype]),)
    return choose_algorithm(Kind.ALLTOALL, meta, (), group.platform, group.size) == "permute"


def permute_blocks(chunks: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """The blocks of a ``"permute"`` all-to-all from this rank's chunks (``chunks[j]`` for
    rank ``j``, all of one length): block ``k - 1`` is the chunk for rank ``(rank + k) mod
    size``, ``k = 1 .. size - 1``, which the program's ``k``-th collective-permute sends there
    (every rank sends its ``k``-th block ``k`` ranks on). This rank's own chunk stays out of
    the program. On 3 ranks, rank 1 passes ``[chunks[2], chunks[0]]``."""
    size = len(chunks)
    return [chunks[(rank + k) % size] for k in range(1, size)]


def from_permutes(
    received: Sequence[torch.Tensor], own: torch.Tensor, rank: int
) -> list[torch.Tensor]:
    """A ``"permute"`` all-to-all's result blocks in source-rank order, ``own`` (this rank's
    chunk for itself) in its place: result block ``k - 1`` came from rank ``(rank - k) mod
    size``."""
    size = len(received) + 1
    by_source: list[torch.Tensor] = [own] * size
    for k, block in enumerate(received, 1):
        by_source[(rank - k) % size] = block
    return by_source


def _check_a2a_shapes(op: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """An all-to-all moves rows: dim 0 of each, the rest alike."""
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError(
            f"{op}: input and output need at least one dimension (got shapes "
            f"{tuple(input.shape)} and {tuple(output.shape)}); reshape scalars to (1,)."
        )
    if tuple(input.shape[1:]) != tuple(output.shape[1:]):
        raise ValueError(
            f"{op}: input shape {tuple(input.shape)} and output shape "
            f"{tuple(output.shape)} differ beyond dim 0."
        )


def _single_parts(
    op: str,
    group: GroupView,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
) -> tuple[list[torch.Tensor], list[int], Finish]:
    """An ``all_to_all_single`` with split sizes, checked: the chunks this rank sends, the
    words it receives from each rank, and the finish step that writes them into ``output``."""
    _checks.check_tensor(op, input, "input")
    _checks.check_tensor(op, output, "output")
    _checks.check_same(op, input, output, "output")
    _checks.check_output(op, output, "output")
    _check_a2a_shapes(op, output, input)
    size = group.size
    send = _checks.check_splits(op, input_split_sizes, size, input.shape[0], "input")
    recv = _checks.check_splits(op, output_split_sizes, size, output.shape[0], "output")
    row = word_count(input.new_empty(input.shape[1:]))  # words per row (0 rows: no input[0])
    send_chunks = list(words(input).split([s * row for s in send]))
    out_words = words(output) if output.is_contiguous() else None

    def finish(recv_chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        if out_words is not None:  # straight into the output: no output-sized temporary
            torch.cat(recv_chunks, out=out_words)
        else:
            write(output, torch.cat(recv_chunks))
        return [output]

    return send_chunks, [r * row for r in recv], finish


def all_to_all(
    group: GroupView,
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
) -> Plan:
    """``all_to_all``: rank r's ``input_tensor_list[j]`` becomes rank j's
    ``output_tensor_list[r]`` (tensors of any sizes; each rank checks its own lists, and a
    call rejected on some ranks fails on every rank: :func:`_uneven_all_to_all`)."""
    op = "all_to_all"
    parts, rejected = _one_sided(lambda: _list_parts(op, group, output_tensors, input_tensors))
    if rejected is not None:
        return _uneven_all_to_all(group, op, [], [], lambda results: [], rejected)
    return _uneven_all_to_all(group, op, *parts)


def _list_parts(
    op: str,
    group: GroupView,
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[int], Finish]:
    """An ``all_to_all`` of tensor lists, checked: the chunks this rank sends, the words it
    receives from each rank, and the finish step that writes them into the outputs."""
    size = group.size
    _checks.check_list(op, input_tensors, size, "input_tensor_list")
    _checks.check_list(op, output_tensors, size, "output_tensor_list")
    for i, t in enumerate(input_tensors):
        _checks.check_tensor(op, t, f"input_tensor_list[{i}]")
        _checks.check_same(op, input_tensors[0], t, f"input_tensor_list[{i}]")
    for i, t in enumerate(output_tensors):
        _checks.check_tensor(op, t, f"output_tensor_list[{i}]")
        _checks.check_same(op, input_tensors[0], t, f"output_tensor_list[{i}]")
        _checks.check_output(op, t, f"output_tensor_list[{i}]")
    send_chunks = [words(t) for t in input_tensors]
    recv_counts = [word_count(t) for t in output_tensors]
    return send_chunks, recv_counts, _writes(output_tensors)


def size_bucket(n: int) -> int:
    """``n`` rounded up to the next of 1, 2, ..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...:
    four sizes per doubling from 8 on (the three leading bits of ``n - 1`` kept, the rest
    rounded up), so sizes from 1 to ``N`` fall in at most ``4 * log2(N)`` buckets and the
    padding adds at most a quarter (5 for 4 + 1 after 4, an eighth on average).

    An uneven all-to-all's chunk width (:func:`_uneven_all_to_all`) follows the data (the
    tokens a router sends to each expert, packed sequences), and each new width would be a new
    program: a mixture of experts compiled 61 programs in 10 steps (issue 51); with widths
    bucketed it compiles a few per all-to-all shape
    (docs/decisions/0033-varying-sizes-and-memory.md).
    """
    if n <= 8:
        return n
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def _uneven_all_to_all(
    group: GroupView,
    op: str,
    send_chunks: list[torch.Tensor],
    recv_counts: list[int],
    finish: Finish,
    rejected: Exception | None = None,
) -> Plan:
    """All-to-all of chunks of any length: every chunk padded to the group's largest.

    Two programs: a MAX all-reduce of (this rank's largest chunk, its verdict) agrees on the
    largest chunk (so every rank compiles the same padded program) and on whether any rank
    rejected its arguments (then every rank fails the call there, :class:`Plan`; the verdict
    is the rejecting group rank + 1, so the highest one is named), then the padded all-to-all
    (:attr:`Plan.then`). The agreed width is rounded up to its :func:`size_bucket`, so that
    widths that follow the data reuse a few programs.

    On TPU too this padded exchange, not XLA's ragged all-to-all
    (``jax.lax.ragged_all_to_all``, which would move only the rows and serve every split with
    one program of a bucketed capacity): libtpu 0.0.52 compiles it, but XLA:CPU refuses it, so
    its numbers could not be checked against gloo here as this exchange's are, and a wrong
    offset would move wrong rows silently. The padding moves at most a quarter more than the
    widest chunk times the group size (balanced routing: 1.2x the rows;
    docs/decisions/0033-varying-sizes-and-memory.md measures it with skewed routing too).
    """
    size = group.size
    local_max = max([c.numel() for c in send_chunks] + recv_counts) if send_chunks else 0
    agreed = torch.tensor([local_max, 0 if rejected is None else group.rank + 1])

    def check(results: list[torch.Tensor]) -> list[torch.Tensor]:
        width, verdict = results[0].tolist()
        if verdict:
            verdicts = [int(r == verdict - 1) for r in range(size)]
            _raise_if_rejected(group, op, verdicts)
        return [agreed.copy_(results[0])]

    def padded(outputs: list[torch.Tensor]) -> Plan:
        width = int(outputs[0][0])
        if width == 0:
            return _completed(op, finish([c.new_empty(0) for c in send_chunks]))
        # Rows of whole 32-bit words where the words are narrower (exchange_words): at most 3
        # bytes more padding a chunk, decided by the agreed width and the dtype alone.
        word = send_chunks[0].dtype
        ratio = _per_word32(send_chunks[0])
        width = -(-size_bucket(width) // ratio) * ratio
        rank = group.rank
        meta = ((size * width, DTYPE_NAMES[word]),)
        if choose_algorithm(Kind.ALLTOALL, meta, (), group.platform, size) == "permute":
            # One block per peer (this rank's own chunk stays here): a chunk of the whole
            # width is passed as it is, a shorter one padded.
            peers = permute_blocks(send_chunks, rank)
            blocks = [exchange_words(_padded(c, width), 1) for c in peers]

            def unpermute(results: list[torch.Tensor]) -> list[torch.Tensor]:
                got = from_permutes([r.view(word) for r in results], send_chunks[rank], rank)
                return finish([got[peer][: recv_counts[peer]] for peer in range(size)])

            return _program(group, op, Kind.ALLTOALL, (), blocks, unpermute,
                            algorithm="permute")
        rows = send_chunks[0].new_zeros(size, width)
        for peer, chunk in enumerate(send_chunks):
            rows[peer, : chunk.numel()] = chunk

        def unpad(results: list[torch.Tensor]) -> list[torch.Tensor]:
            received = results[0].view(word).view(size, width)
            return finish([received[peer, : recv_counts[peer]] for peer in range(size)])

        block = exchange_words(rows.view(-1), size)
        return _program(group, op, Kind.ALLTOALL, (), [block], unpad)

    agree = _program(group, op, Kind.ALLREDUCE, ("MAX",), [agreed], check)
    return Plan(
        agree.op, agree.key, agree.blocks, agree.finish, then=padded, rejected=rejected
    )


def _padded(chunk: torch.Tensor, width: int) -> torch.Tensor:
    """``chunk`` as a block of ``width`` words: itself when it is that long, else a copy
    with zeros after it."""
    if chunk.numel() == width:
        return chunk
    block = chunk.new_zeros(width)
    block[: chunk.numel()] = chunk
    return block


# -- barrier and point to point -------------------------------------------------------------


def barrier(group: GroupView) -> Plan:
    """``barrier``: a one-word sum over the group; returns no tensors."""
    token = torch.zeros(1, dtype=torch.int32)
    return _program(group, "barrier", Kind.BARRIER, (), [token], lambda results: [])


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
    finish = (lambda results: [tensor]) if is_send else _writes([tensor])
    return P2PPlan(
        op, f"{op} (peer {peer}, tag {tag})", key,
        permute_key(devices, P2P_HEADER_WORDS, "int32", upward), group.name, tensor, block,
        finish, other, int(tag), (low, high), ranks,
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
