"""Calls rejected on some ranks only (issue 48, item 1), on "tpu" beside gloo.

Some arguments are read by one rank only, or differ between ranks by design: the root's
``scatter_list`` and ``gather_list``, each rank's own split sizes and tensor lists of an
all-to-all, ``scatter_object_list``'s objects on the source. Their checks can fail on some ranks
while the others' calls are valid. Before the fix the other ranks' programs ran, and the
rejecting rank's next call met them: wrong numbers with no error (an all_reduce of ``rank + 1``
on 2 ranks gave ``[1, 1, 2]``), or a process aborted by gloo's size check.

Each scenario runs on a fresh group with a short timeout, then an all_reduce of ``rank + 1`` on
the same group. What each rank reports: how the bad call ended, and what the next all_reduce
gave. gloo is the floor: its ranks fail the bad call (the others when the group's timeout
expires) and never return wrong numbers. On "tpu" every rank fails the bad call at once (the
rejecting ranks with their ``ValueError``, the others with a ``DistBackendError`` naming them)
and the group stays in step: the next all_reduce is right on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import World

W = 2
GLOO_TIMEOUT_S = 3  # the gloo group's timeout: its non-rejecting ranks wait this long


def _bad_call(case: str, rank: int, group: dist.ProcessGroup) -> None:
    """The call of ``case``: valid on some ranks only (rank 0 or 1, as each case says)."""
    out = torch.zeros(3)
    t = torch.ones(3)
    if case == "scatter_list_short_on_root":
        dist.scatter(out, [t] * (W - 1) if rank == 0 else None, src=0, group=group)
    elif case == "gather_list_long_on_root":
        dist.gather(t, [torch.zeros(3) for _ in range(W + 1)] if rank == 0 else None,
                    dst=0, group=group)
    elif case == "split_sizes_wrong_on_rank_1":
        splits = [1, 1] if rank == 0 else [3, 1]  # rank 1's do not add up to its 2 rows
        dist.all_to_all_single(torch.zeros(2), torch.arange(2.0), [1, 1], splits, group=group)
    elif case == "own_split_mismatch_on_rank_1":
        # rank 1 sends itself 1 row but expects 2 from itself (each split list is valid alone)
        recv = [1, 1] if rank == 0 else [1, 2]
        dist.all_to_all_single(torch.zeros(sum(recv)), torch.arange(2.0), recv, [1, 1], group=group)
    elif case == "tensor_list_long_on_rank_1":
        outs = [torch.zeros(1) for _ in range(W + rank)]
        dist.all_to_all(outs, [torch.full((1,), float(rank)) for _ in range(W)], group=group)
    elif case == "scatter_object_list_short_on_src":
        received = [None]
        dist.scatter_object_list(received, ["a"] * (W - 1) if rank == 0 else None, src=0,
                                 group=group)
    else:
        raise AssertionError(case)


def _rejected_then_all_reduce(rank: int, world_size: int, case: str) -> dict:
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    outcome: dict = {}
    try:
        _bad_call(case, rank, group)
        outcome["call"] = "returned"
    except Exception as err:  # noqa: BLE001 - the outcome is the point
        outcome["call"] = type(err).__name__
        outcome["message"] = str(err)
    try:
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x, group=group)
        outcome["next"] = x.tolist()
    except Exception as err:  # noqa: BLE001
        outcome["next"] = type(err).__name__
    dist.destroy_process_group(group)
    return outcome


CASES = [
    # (case, the ranks whose own check rejects the call)
    ("scatter_list_short_on_root", [0]),
    ("gather_list_long_on_root", [0]),
    ("split_sizes_wrong_on_rank_1", [1]),
    ("own_split_mismatch_on_rank_1", [1]),
    ("tensor_list_long_on_rank_1", [1]),
    ("scatter_object_list_short_on_src", [0]),
]
RIGHT = [float(W * (W + 1) // 2)] * 3


@pytest.mark.parametrize(("case", "rejecting"), CASES)
def test_call_rejected_on_some_ranks_fails_on_every_rank_and_keeps_them_in_step(
    worlds: Callable[..., World], case: str, rejecting: list[int]
) -> None:
    results = worlds(W, backend="tpu").run(_rejected_then_all_reduce, case)
    for rank, outcome in enumerate(results):
        if rank in rejecting:
            assert outcome["call"] == "ValueError", outcome
        else:
            assert outcome["call"] == "DistBackendError", outcome
            assert f"rank(s) {rejecting} rejected their arguments" in outcome["message"], outcome
        assert outcome["next"] == RIGHT, outcome  # in step: the group is usable, numbers right


@pytest.mark.parametrize(("case", "rejecting"), CASES[:3])
def test_gloo_beside_it_never_returns_wrong_numbers(
    worlds: Callable[..., World], case: str, rejecting: list[int]
) -> None:
    # gloo, the floor: every rank fails the call (the others after the group's timeout) or
    # later fails, and no rank returns wrong numbers. Its group is broken afterwards.
    results = worlds(W, backend="gloo").run(_rejected_then_all_reduce, case, timeout=60)
    for outcome in results:
        assert outcome["call"] != "returned", outcome
        assert outcome["next"] == RIGHT or isinstance(outcome["next"], str), outcome


def _splits_disagree_then_all_reduce(rank: int, world_size: int, rows: int) -> dict:
    """Rank 0 sends rank 1 two rows of ``rows`` floats; rank 1 expects three from it (each
    rank's own splits are valid: the disagreement is between ranks). Then an all_reduce."""
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    send = [1, 2] if rank == 0 else [1, 1]
    recv = [1, 1] if rank == 0 else [3, 1]
    x = torch.arange(float(sum(send) * rows)).view(-1, rows) + 100 * rank
    out = torch.full((sum(recv), rows), -1.0)
    outcome: dict = {}
    try:
        dist.all_to_all_single(out, x, recv, send, group=group)
        outcome["call"] = "returned"
    except Exception as err:  # noqa: BLE001 - the outcome is the point
        outcome["call"] = type(err).__name__
        outcome["message"] = str(err)
    outcome["out"] = out[:, 0].tolist()
    y = torch.full((3,), float(rank + 1))
    dist.all_reduce(y, group=group)
    outcome["next"] = y.tolist()
    dist.destroy_process_group(group)
    return outcome


@pytest.mark.parametrize("rows", [3, 20_000])  # 20,000 floats a row: the permute programs
def test_split_sizes_that_disagree_between_ranks_fail_the_receiver(
    worlds: Callable[..., World], rows: int
) -> None:
    """Each chunk of an uneven all-to-all carries its sender's length: the rank that expects
    other than it was sent fails with an error naming both counts, its output untouched,
    instead of reading padding as rows; the sender's call is right; both stay in step. gloo
    beside it returns on both ranks with rank 1's third row never written (measured: -1.0
    there, no error)."""
    tpu = worlds(W, backend="tpu").run(_splits_disagree_then_all_reduce, rows)
    assert tpu[0]["call"] == "returned" and tpu[0]["out"] == [0.0, 100.0], tpu[0]
    assert tpu[1]["call"] == "DistBackendError", tpu[1]
    assert "split sizes disagree (rank 0 sent 2 rows, this rank expected 3)" in tpu[1]["message"]
    assert tpu[1]["out"] == [-1.0] * 4  # left unchanged
    assert tpu[0]["next"] == tpu[1]["next"] == RIGHT
    gloo = worlds(W, backend="gloo").run(_splits_disagree_then_all_reduce, rows, timeout=60)
    assert gloo[1]["call"] != "returned" or -1.0 in gloo[1]["out"], gloo  # an error, or a row unwritten
