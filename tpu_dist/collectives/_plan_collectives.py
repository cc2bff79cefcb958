"""The plans of the collectives that are one program: all-reduce, all-gather, reduce-scatter,
broadcast, scatter, gather and barrier (plan stage; all-to-alls: :mod:`._plan_all_to_all`).

Each function checks the call (``ValueError``/``TypeError`` before anything is sent), makes the
blocks (:mod:`._plan_blocks`) and the op's finish steps (:mod:`._plan_finish`), and returns
:func:`~._plan_build.build_plan`'s plan of them. Rooted ops whose arguments only some ranks
read (gather, scatter) carry every rank's verdict in the program (:class:`~._plan.Plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tpu_dist.collectives import _checks
from tpu_dist.collectives._plan import GroupView, Plan
from tpu_dist.collectives._plan_blocks import flat, values, words
from tpu_dist.collectives._plan_build import build_plan, completed, one_sided, verdict
from tpu_dist.collectives._plan_finish import (
    CheckBroadcastSource,
    KeepOutputs,
    RaiseIfRejected,
    WriteGatheredLists,
    WriteOutputs,
    WriteRows,
)
from tpu_dist.collectives._types import Kind

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


# -- all-reduce ----------------------------------------------------------------------------


def all_reduce(group: GroupView, tensors: Sequence[torch.Tensor], reduce_op: dist.ReduceOp) -> Plan:
    """``all_reduce``: every rank's tensor becomes the reduction over the group (in place)."""
    op = "all_reduce"
    tensor = _checks.check_single(op, tensors)
    params = reduce_params(op, reduce_op, tensor.dtype)
    return build_plan(group, op, Kind.ALLREDUCE, params, [values(tensor)], [WriteOutputs((tensor,))])


def all_reduce_coalesced(
    group: GroupView, tensors: Sequence[torch.Tensor], reduce_op: dist.ReduceOp
) -> Plan:
    """``all_reduce_coalesced``: each tensor all-reduced, in one program."""
    op = "all_reduce_coalesced"
    for i, t in enumerate(tensors):
        _checks.check_tensor(op, t, f"tensors[{i}]")
    if not tensors:
        return completed(op, [])
    params = _one_kind(op, tensors, reduce_op)
    blocks = [values(t) for t in tensors]
    return build_plan(group, op, Kind.ALLREDUCE, params, blocks, [WriteOutputs(tuple(tensors))])


def reduce(
    group: GroupView, tensors: Sequence[torch.Tensor], root: int, reduce_op: dist.ReduceOp
) -> Plan:
    """``reduce``: the root's tensor becomes the reduction; the others' are left as they were.

    Every rank runs the all-reduce program (the reduction is computed everywhere); only the
    root's finish writes.
    """
    op = "reduce"
    tensor = _checks.check_single(op, tensors)
    _checks.check_rank(op, root, group.size, "root")
    params = reduce_params(op, reduce_op, tensor.dtype)
    last = WriteOutputs((tensor,)) if group.rank == root else KeepOutputs((tensor,))
    return build_plan(group, op, Kind.ALLREDUCE, params, [values(tensor)], [last])


# -- all-gather ----------------------------------------------------------------------------


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
    steps = [WriteRows(tuple(outputs), group.size)]
    return build_plan(group, op, Kind.ALLGATHER, (), [words(tensor)], steps)


def all_gather_into_tensor(
    group: GroupView, output: torch.Tensor, input: torch.Tensor
) -> Plan:
    """``all_gather_into_tensor``: ``output`` is every rank's ``input``, in rank order."""
    op = "all_gather_into_tensor"
    _check_pair(op, group, output, input, "output")
    _checks.check_output(op, output, "output")
    return build_plan(group, op, Kind.ALLGATHER, (), [words(input)], [WriteOutputs((output,))])


def all_gather_into_tensor_coalesced(
    group: GroupView, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> Plan:
    """``all_gather_into_tensor`` of each input into its output, in one program."""
    op = "all_gather_into_tensor_coalesced"
    _check_coalesced_pairs(op, group, outputs, inputs, outputs_are_big=True)
    if not inputs:
        return completed(op, [])
    blocks = [words(t) for t in inputs]
    return build_plan(group, op, Kind.ALLGATHER, (), blocks, [WriteOutputs(tuple(outputs))])


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
        return completed(op, [])
    blocks = [words(t) for t in input_tensors]
    steps = [WriteGatheredLists(tuple(output_lists), group.size)]
    return build_plan(group, op, Kind.ALLGATHER, (), blocks, steps)


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
    outputs, rejected = one_sided(
        lambda: _gather_list(op, group, tensor, output_tensors, root)
    )
    steps = [RaiseIfRejected(group, op), WriteRows(tuple(outputs or ()), group.size)]
    blocks = [words(tensor), verdict(rejected)]
    return build_plan(
        group, op, Kind.ALLGATHER, (), blocks, steps, checks=1, rejected=rejected
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
    return build_plan(
        group, op, Kind.REDUCE_SCATTER, params, [stacked], [WriteOutputs((output,))]
    )


def reduce_scatter_tensor(
    group: GroupView, output: torch.Tensor, input: torch.Tensor, reduce_op: dist.ReduceOp
) -> Plan:
    """``reduce_scatter_tensor``: rank r's output is the reduction of chunk r of every input."""
    op = "reduce_scatter_tensor"
    _check_pair(op, group, input, output, "input")
    _checks.check_output(op, output, "output")
    params = reduce_params(op, reduce_op, input.dtype)
    return build_plan(
        group, op, Kind.REDUCE_SCATTER, params, [values(input)], [WriteOutputs((output,))]
    )


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
        return completed(op, [])
    params = _one_kind(op, inputs, reduce_op)
    blocks = [values(t) for t in inputs]
    return build_plan(
        group, op, Kind.REDUCE_SCATTER, params, blocks, [WriteOutputs(tuple(outputs))]
    )


# -- broadcast, scatter and barrier ----------------------------------------------------------


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
    mark = root + 1
    header = torch.tensor([mark, mark * mark], dtype=torch.int32)
    last = KeepOutputs((tensor,)) if group.rank == root else WriteOutputs((tensor,))
    steps = [CheckBroadcastSource(group, root), last]
    blocks = [words(tensor), header]
    return build_plan(group, op, Kind.BROADCAST, (root, True), blocks, steps, checks=1)


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
    block, rejected = one_sided(
        lambda: _scatter_block(op, group, output, input_tensors, root)
    )
    if block is None:
        block = out_words.new_zeros(out_words.numel() * group.size)
    steps = [RaiseIfRejected(group, op), WriteOutputs((output,))]
    verdicts = verdict(rejected, group.size, group.rank)
    return build_plan(
        group, op, Kind.SCATTER, (root, True), [block, verdicts], steps, checks=1,
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


def barrier(group: GroupView) -> Plan:
    """``barrier``: a one-word sum over the group; returns no tensors."""
    token = torch.zeros(1, dtype=torch.int32)
    return build_plan(group, "barrier", Kind.BARRIER, (), [token], [KeepOutputs(())])
