"""The plans of the all-to-alls: ``all_to_all_single`` and ``all_to_all`` (plan stage).

An even ``all_to_all_single`` is one program: XLA's all-to-all, or on CPU from
:data:`~._plan_algorithms.PERMUTE_MIN_BYTES` one collective-permute per peer (each chunk its
own block, :func:`~._plan_blocks.permute_blocks`). Split sizes and tensor lists of any sizes
make an *uneven* all-to-all (:func:`uneven_all_to_all`): a first program agrees on the widest
chunk (and on whether a rank rejected its own arguments), then every chunk is padded to it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from tpu_dist.collectives import _checks
from tpu_dist.collectives._plan import GroupView, Plan, Step, run_steps
from tpu_dist.collectives._plan_algorithms import choose_algorithm
from tpu_dist.collectives._plan_blocks import (
    DTYPE_NAMES,
    as_words,
    exchange_words,
    per_word32,
    permute_blocks,
    word_count,
    words,
)
from tpu_dist.collectives._plan_build import build_plan, completed, one_sided
from tpu_dist.collectives._plan_finish import (
    CheckSentLengths,
    FromPermutes,
    JoinInto,
    KeepOutputs,
    SplitRows,
    TakeAgreedWidth,
    TrimChunks,
    WriteOutputs,
)
from tpu_dist.collectives._types import Kind

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
    fail on some ranks only: they fail the call on every rank (:func:`uneven_all_to_all`).
    """
    op = "all_to_all_single"
    if input_split_sizes or output_split_sizes:
        parts, rejected = one_sided(
            lambda: _single_parts(op, group, output, input, output_split_sizes,
                                  input_split_sizes)
        )
        if rejected is not None:
            return uneven_all_to_all(group, op, [], [], [KeepOutputs(())], rejected)
        *parts, row = parts
        return uneven_all_to_all(group, op, *parts, unit=(max(row, 1), "rows"))
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
        # Each chunk straight into its place in the output, where the output's words allow.
        target = as_words(out_words, block.dtype) if out_words is not None else None
        steps = [FromPermutes(chunks[rank], rank), JoinInto(output, target)]
        return build_plan(group, op, Kind.ALLTOALL, (), permute_blocks(chunks, rank), steps,
                          algorithm="permute")
    return build_plan(group, op, Kind.ALLTOALL, (), [block], [WriteOutputs((output,))])


def _permutes(group: GroupView, block: torch.Tensor) -> bool:
    """Whether an all-to-all of ``block`` (this rank's chunks, one per rank) runs as
    collective-permutes (:func:`~._plan_algorithms.choose_algorithm`)."""
    meta = ((block.numel(), DTYPE_NAMES[block.dtype]),)
    return choose_algorithm(Kind.ALLTOALL, meta, (), group.platform, group.size) == "permute"


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
) -> tuple[list[torch.Tensor], list[int], list[Step]]:
    """An ``all_to_all_single`` with split sizes, checked: the chunks this rank sends, the
    words it receives from each rank, the finish steps that write them into ``output``, and
    the words a row."""
    _checks.check_tensor(op, input, "input")
    _checks.check_tensor(op, output, "output")
    _checks.check_same(op, input, output, "output")
    _checks.check_output(op, output, "output")
    _check_a2a_shapes(op, output, input)
    size = group.size
    send = _checks.check_splits(op, input_split_sizes, size, input.shape[0], "input")
    recv = _checks.check_splits(op, output_split_sizes, size, output.shape[0], "output")
    rank = group.rank
    if send[rank] != recv[rank]:
        raise ValueError(
            f"{op}: this rank (group rank {rank}) sends itself {send[rank]} rows "
            f"(input_split_sizes[{rank}]) but expects {recv[rank]} from itself "
            f"(output_split_sizes[{rank}]); they must be equal."
        )
    row = word_count(input.new_empty(input.shape[1:]))  # words per row (0 rows: no input[0])
    send_chunks = list(words(input).split([s * row for s in send]))
    out_words = words(output) if output.is_contiguous() else None
    return send_chunks, [r * row for r in recv], [JoinInto(output, out_words)], row


def all_to_all(
    group: GroupView,
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
) -> Plan:
    """``all_to_all``: rank r's ``input_tensor_list[j]`` becomes rank j's
    ``output_tensor_list[r]`` (tensors of any sizes; each rank checks its own lists, and a
    call rejected on some ranks fails on every rank: :func:`uneven_all_to_all`)."""
    op = "all_to_all"
    parts, rejected = one_sided(lambda: _list_parts(op, group, output_tensors, input_tensors))
    if rejected is not None:
        return uneven_all_to_all(group, op, [], [], [KeepOutputs(())], rejected)
    per_element = max(1, input_tensors[0].element_size() // 4)
    return uneven_all_to_all(group, op, *parts, unit=(per_element, "elements"))


def _list_parts(
    op: str,
    group: GroupView,
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[int], list[Step]]:
    """An ``all_to_all`` of tensor lists, checked: the chunks this rank sends, the words it
    receives from each rank, and the finish steps that write them into the outputs."""
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
    rank = group.rank
    if input_tensors[rank].numel() != output_tensors[rank].numel():
        raise ValueError(
            f"{op}: this rank (group rank {rank}) sends itself "
            f"{input_tensors[rank].numel()} elements (input_tensor_list[{rank}]) but expects "
            f"{output_tensors[rank].numel()} (output_tensor_list[{rank}]); they must be equal."
        )
    send_chunks = [words(t) for t in input_tensors]
    recv_counts = [word_count(t) for t in output_tensors]
    return send_chunks, recv_counts, [WriteOutputs(tuple(output_tensors))]


def size_bucket(n: int) -> int:
    """``n`` rounded up to the next of 1, 2, ..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...:
    four sizes per doubling from 8 on (the three leading bits of ``n - 1`` kept, the rest
    rounded up), so sizes from 1 to ``N`` fall in at most ``4 * log2(N)`` buckets and the
    padding adds at most a quarter (5 for 4 + 1 after 4, an eighth on average).

    An uneven all-to-all's chunk width (:func:`uneven_all_to_all`) follows the data (the
    tokens a router sends to each expert, packed sequences), and each new width would be a new
    program: a mixture of experts compiled 61 programs in 10 steps (issue 51); with widths
    bucketed it compiles a few per all-to-all shape
    (docs/decisions/0033-varying-sizes-and-memory.md).
    """
    if n <= 8:
        return n
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def uneven_all_to_all(
    group: GroupView,
    op: str,
    send_chunks: list[torch.Tensor],
    recv_counts: list[int],
    steps: Sequence[Step],
    rejected: Exception | None = None,
    unit: tuple[int, str] = (1, "words"),
) -> Plan:
    """All-to-all of chunks of any length: every chunk padded to the group's largest.

    Two programs: a MAX all-reduce of (this rank's largest chunk, its verdict) agrees on the
    largest chunk (so every rank compiles the same padded program) and on whether any rank
    rejected its arguments (then every rank fails the call there, :class:`~._plan.Plan`; the
    verdict is the rejecting group rank + 1, so the highest one is named), then the padded
    all-to-all (:attr:`~._plan.Plan.then`: :func:`_padded_all_to_all`), finished by its own
    steps and then ``steps``, which write the chunks received from each rank. The agreed width
    is rounded up to its :func:`size_bucket`, so that widths that follow the data reuse a few
    programs.

    Each padded chunk ends in one 32-bit word holding its sender's length of it: the receiver
    checks it against the words it expects from that rank (:class:`~._plan_finish.
    CheckSentLengths`; ``unit``, (words a unit, its name), words the message), so ranks whose
    split sizes disagree fail with an error instead of reading padding as data.

    On TPU too this padded exchange, not XLA's ragged all-to-all
    (``jax.lax.ragged_all_to_all``, which would move only the rows and serve every split with
    one program of a bucketed capacity): libtpu 0.0.52 compiles it, but XLA:CPU refuses it, so
    its numbers could not be checked against gloo here as this exchange's are, and a wrong
    offset would move wrong rows silently. The padding moves at most a quarter more than the
    widest chunk times the group size (balanced routing: 1.2x the rows;
    docs/decisions/0033-varying-sizes-and-memory.md measures it with skewed routing too).
    """
    local_max = max([c.numel() for c in send_chunks] + recv_counts) if send_chunks else 0
    agreed = torch.tensor([local_max, 0 if rejected is None else group.rank + 1])
    agree = build_plan(
        group, op, Kind.ALLREDUCE, ("MAX",), [agreed], [TakeAgreedWidth(group, op, agreed)]
    )
    padded = functools.partial(
        _padded_all_to_all, group, op, send_chunks, recv_counts, tuple(steps), unit
    )
    return dataclasses.replace(agree, then=padded, rejected=rejected)


def _padded_all_to_all(
    group: GroupView,
    op: str,
    send_chunks: list[torch.Tensor],
    recv_counts: list[int],
    steps: tuple[Step, ...],
    unit: tuple[int, str],
    agreed: list[torch.Tensor],
) -> Plan:
    """The second program of :func:`uneven_all_to_all`, once the ranks ``agreed`` on the
    widest chunk: every chunk padded to its bucket, its length in a word after it."""
    size = group.size
    width = int(agreed[0][0])
    if width == 0:
        return completed(op, run_steps(steps, [c.new_empty(0) for c in send_chunks]))
    # Rows of whole 32-bit words where the words are narrower (exchange_words): at most 3
    # bytes more padding a chunk, decided by the agreed width and the dtype alone.
    word = send_chunks[0].dtype
    ratio = per_word32(send_chunks[0])
    width = -(-size_bucket(width) // ratio) * ratio
    rank = group.rank
    # Each chunk's length in one 32-bit word (``ratio`` words of the chunk's type) after it;
    # 32-bit words take four (16 bytes), so that every row starts where an element of any
    # width may (a complex128 is four words).
    full = width + (4 if ratio == 1 else ratio)
    lengths = torch.tensor([c.numel() for c in send_chunks], dtype=torch.int32)
    lengths = lengths.view(word).view(size, ratio)

    def fill(row: torch.Tensor, peer: int) -> torch.Tensor:
        """``row`` (``full`` zeroed words) with the chunk for ``peer`` and its length."""
        chunk = send_chunks[peer]
        row[: chunk.numel()] = chunk
        row[width : width + ratio] = lengths[peer]
        return row

    meta = ((size * full, DTYPE_NAMES[word]),)
    expected = list(recv_counts)
    expected[rank] = send_chunks[rank].numel()  # its own chunk is checked when planned
    check = CheckSentLengths(group, op, tuple(expected), width, ratio, unit)
    trim = TrimChunks(tuple(recv_counts))
    if choose_algorithm(Kind.ALLTOALL, meta, (), group.platform, size) == "permute":
        # One block per peer (this rank's own chunk stays here).
        padded = [fill(send_chunks[0].new_zeros(full), peer) for peer in range(size)]
        blocks = [exchange_words(b, 1) for b in permute_blocks(padded, rank)]
        return build_plan(
            group, op, Kind.ALLTOALL, (), blocks,
            [FromPermutes(padded[rank], rank), check, trim, *steps], algorithm="permute",
        )
    rows = send_chunks[0].new_zeros(size, full)
    for peer in range(size):
        fill(rows[peer], peer)
    block = exchange_words(rows.view(-1), size)
    return build_plan(
        group, op, Kind.ALLTOALL, (), [block],
        [SplitRows(word, size, full), check, trim, *steps],
    )
