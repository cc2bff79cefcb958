"""Which program runs a planned call: its algorithm and its :class:`~._types.ProgramKey`.

:func:`choose_algorithm` picks how a kind is carried out on a platform (measured rules, in its
docstring); :func:`program_key` makes the key every rank of the group computes alike (a
family's program where the group is one of a family, :func:`uses_family_program`);
:func:`tpu_block_align` is how far a TPU all-gather's or reduce-scatter's blocks are padded.
Pure functions of their arguments (plan stage).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

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
  (:func:`._plan_blocks.permute_blocks`; CPU only).
"""

PERMUTE_MIN_BYTES = 64 * 1024
"""On CPU, all-to-alls of at least this many bytes a rank run as collective-permutes
(:func:`._plan_blocks.permute_blocks`, the ``"permute"`` algorithm), not as XLA's all-to-all."""


DIRECT_EXCHANGE_MAX_BYTES = 256 * 1024
"""On CPU, all-reduces and all-gathers of at most this many bytes per rank (summed over a
call's blocks; all-gather: its output) exchange chunks directly (:func:`choose_algorithm`)."""


_TPU_EMULATED_DTYPES = frozenset({"float64", "int64", "uint64", "complex64", "complex128"})
"""Dtypes the TPU has no native type for: XLA:TPU rewrites them into 32-bit words, and its
collectives then support only part of them (see :func:`choose_algorithm`)."""


_SUMS = frozenset({"SUM", "AVG", "PREMUL_SUM"})

_HALF_FLOATS = frozenset({"bfloat16", "float16"})
"""16-bit floats: XLA:CPU's own all-reduce of them does not add as gloo's ring does (its
sums of 3 or more ranks differ from gloo's in the last bit; float32's are equal), so on CPU
they take the ``"exchange"``, which does, at every size (:func:`choose_algorithm`)."""


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
    * CPU, sums of 16-bit floats over 3 or more ranks: ``"exchange"`` at every size, whose
      sums have gloo's bits (the chunks and order of gloo's ring: ``_lowering.gloo_chunk``);
      XLA:CPU's own all-reduce of them does not (its float32 sums do).
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
        if (kind == Kind.ALLREDUCE and size >= 3 and reduce_op in _SUMS
                and blocks and min(n for n, _ in blocks) > 0
                and any(dtype in _HALF_FLOATS for _, dtype in blocks)):
            return "exchange"
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


def tpu_block_align(kind: Kind, device_kind: str) -> int:
    """The multiple of elements each rank's part of a TPU all-gather or reduce-scatter is
    padded to on devices of ``device_kind``: :data:`TPU_BLOCK_ALIGN`, and for an all-gather
    also a multiple of the generation's ``all_gather_block_multiple``
    (``tpu_dist.mesh.Generation``: 1,024 on every generation in the table)."""
    generation = generation_of_device_kind(device_kind)
    if kind != Kind.ALLGATHER or generation is None:
        return TPU_BLOCK_ALIGN
    return math.lcm(TPU_BLOCK_ALIGN, generation.all_gather_block_multiple)
