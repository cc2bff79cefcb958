"""Tensors as the 1-D blocks a program takes, and result blocks written back (plan stage).

Reductions act on values (:func:`values`: bool as 0/1 bytes, complex as (real, imag) pairs),
data movement on raw words (:func:`words`: int8/int16/int32 by the dtype's size), so one
program serves every dtype of a size. Each function returns a view where the layout allows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpu_dist.collectives import _checks

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
    ratio = per_word32(block)
    if ratio == 1 or block.numel() % (ratio * parts):
        return block
    try:
        return block.view(torch.int32)
    except RuntimeError:  # a view at an offset that is no multiple of 4 bytes: an aligned copy
        return block.clone().view(torch.int32)


def per_word32(block: torch.Tensor) -> int:
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


def as_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``tensor`` viewed as ``dtype`` words, or None where no view can (an offset that is no
    multiple of the wider word)."""
    try:
        return tensor.view(dtype)
    except RuntimeError:
        return None


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
