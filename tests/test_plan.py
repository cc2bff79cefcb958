"""The plan stage in one process: blocks, program keys, algorithms, finish steps, bad input.

No JAX device runs anything here: a plan is made from a call's arguments and a
:class:`GroupView`, so each op is checked against expectations written out by hand (the bytes a
block must hold, the key every rank must agree on, what a finish step writes).

Groups used below:
    CPU2   2 ranks on CPU devices (10, 11), this process is group rank 0 (global rank 4 of (4, 6))
    CPU4   4 ranks on CPU devices (0, 1, 2, 3), this process is group rank 1
    TPU4   4 ranks on TPU devices (0, 1, 2, 3), this process is group rank 2
    FAM_A  group [0, 1] of the family [[0, 1], [2, 3]] on CPU devices 0-3, group rank 1
    FAM_B  group [2, 3] of the same family, group rank 0
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tpu_dist.collectives import (
    ProgramKey,
    _lowering,
    _plan,
    _plan_algorithms,
    _plan_all_to_all,
    _plan_blocks,
    _plan_collectives,
    _plan_p2p,
)
from tpu_dist.collectives._plan import GroupView
from tpu_dist.collectives._plan_algorithms import choose_algorithm

CPU2 = GroupView(0, 2, (10, 11), "cpu", (4, 6), "g2")
CPU4 = GroupView(1, 4, (0, 1, 2, 3), "cpu")
TPU4 = GroupView(2, 4, (0, 1, 2, 3), "tpu")
FAM_A = GroupView(1, 2, (0, 1), "cpu", (0, 1), family=((0, 1), (2, 3)))
FAM_B = GroupView(0, 2, (2, 3), "cpu", (2, 3), family=((0, 1), (2, 3)))

SUM, MAX, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG

LIMIT = 256 * 1024  # bytes per rank up to which small CPU all-reduces/all-gathers exchange


def _shares(block: torch.Tensor, tensor: torch.Tensor) -> bool:
    return block.data_ptr() == tensor.data_ptr()


# -- blocks and keys ------------------------------------------------------------------------


def test_all_reduce_block_is_the_tensor_and_finish_writes_it() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    plan = _plan_collectives.all_reduce(CPU2, [t], SUM)
    assert plan.op == "all_reduce"
    assert plan.key == ProgramKey("allreduce", (10, 11), ((6, "float32"),), ("SUM",), "exchange")
    (block,) = plan.blocks
    assert _shares(block, t) and block.shape == (6,)
    result = torch.tensor([10.0, 11, 12, 13, 14, 15])
    assert plan.finish([result]) == [t]
    assert t.tolist() == [[10, 11, 12], [13, 14, 15]]


def test_reduction_blocks_by_dtype() -> None:
    # bool: 0/1 bytes, SUM is "any" (a MAX); complex: (real, imag) pairs of its real dtype.
    flags = torch.tensor([True, False, True])
    plan = _plan_collectives.all_reduce(CPU2, [flags], SUM)
    assert plan.key.blocks == ((3, "uint8"),) and plan.key.params == ("MAX",)
    assert plan.blocks[0].tolist() == [1, 0, 1]
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    plan = _plan_collectives.all_reduce(CPU2, [z], AVG)
    assert plan.key.blocks == ((4, "float32"),) and plan.key.params == ("AVG",)
    assert plan.blocks[0].tolist() == [1.0, 2.0, 3.0, -4.0]
    plan = _plan_collectives.all_reduce(CPU2, [torch.ones(3)], dist._make_nccl_premul_sum(0.25))
    assert plan.key.params == ("PREMUL_SUM", 0.25)


def test_data_movement_moves_words() -> None:
    # bfloat16 -> int16 words, float64 -> two int32 words per element, int8 stays int8.
    x = torch.arange(5, dtype=torch.bfloat16)
    out = torch.empty(20, dtype=torch.bfloat16)
    plan = _plan_collectives.all_gather_into_tensor(CPU4, out, x)
    assert plan.key == ProgramKey("allgather", (0, 1, 2, 3), ((5, "int16"),), (), "exchange")
    assert _shares(plan.blocks[0], x)
    gathered = torch.arange(20, dtype=torch.bfloat16).view(torch.int16)
    plan.finish([gathered])
    assert out.tolist() == list(range(20))
    d = torch.zeros(3, dtype=torch.float64)
    plan = _plan_collectives.broadcast(CPU4, [d], 0)
    assert plan.key.blocks == ((6, "int32"), (2, "int32"))


def test_all_gather_lists_get_one_row_each() -> None:
    outs = [torch.empty(2, dtype=torch.int32) for _ in range(4)]
    plan = _plan_collectives.all_gather(CPU4, [outs], [torch.tensor([7, 8], dtype=torch.int32)])
    assert plan.key.kind == "allgather" and plan.key.blocks == ((2, "int32"),)
    plan.finish([torch.arange(8, dtype=torch.int32)])
    assert [o.tolist() for o in outs] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_reduce_writes_only_on_the_root() -> None:
    t = torch.ones(2)
    plan = _plan_collectives.reduce(CPU4, [t], 3, SUM)  # this process is rank 1, the root is 3
    assert plan.key.kind == "allreduce"
    plan.finish([torch.full((2,), 4.0)])
    assert t.tolist() == [1.0, 1.0]
    plan = _plan_collectives.reduce(CPU4, [t], 1, SUM)
    plan.finish([torch.full((2,), 4.0)])
    assert t.tolist() == [4.0, 4.0]


def test_reduce_scatter_tensor_block_and_key() -> None:
    full = torch.arange(8, dtype=torch.float32)
    chunk = torch.empty(2)
    plan = _plan_collectives.reduce_scatter_tensor(CPU4, chunk, full, SUM)
    assert plan.key == ProgramKey("reduce_scatter", (0, 1, 2, 3), ((8, "float32"),), ("SUM",),
                                  "exchange")
    assert _shares(plan.blocks[0], full)
    plan.finish([torch.tensor([5.0, 6.0])])
    assert chunk.tolist() == [5.0, 6.0]
    # the list form stacks input_list[r] in rank order
    inputs = [torch.full((2,), float(r)) for r in range(4)]
    plan = _plan_collectives.reduce_scatter(CPU4, [chunk], [inputs], SUM)
    assert plan.blocks[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_broadcast_header_checks_every_rank_passed_the_same_src() -> None:
    t = torch.tensor([1.0, 2.0])
    plan = _plan_collectives.broadcast(CPU2, [t], 1)
    assert plan.key.kind == "broadcast" and plan.key.params == (1, True)
    assert plan.blocks[1].tolist() == [2, 4]  # (src + 1, (src + 1)**2)
    root_data = torch.tensor([5.0, 6.0]).view(torch.int32)
    plan.finish([root_data, torch.tensor([4, 8], dtype=torch.int32)])  # 2 ranks agreed on src 1
    assert t.tolist() == [5.0, 6.0]
    # rank 1 said src=0: the sums are (2 + 1, 4 + 1), not (4, 8)
    t = torch.tensor([1.0, 2.0])
    plan = _plan_collectives.broadcast(CPU2, [t], 1)
    with pytest.raises(dist.DistBackendError) as info:
        plan.finish([root_data, torch.tensor([3, 5], dtype=torch.int32)])
    message = str(info.value)
    assert "rank 4 of group 'g2'" in message and "src=1" in message
    assert "Every rank must pass the same src" in message
    assert t.tolist() == [1.0, 2.0]


def test_scatter_blocks_on_root_and_elsewhere() -> None:
    out = torch.empty(2, dtype=torch.int32)
    parts = [torch.full((2,), r, dtype=torch.int32) for r in range(4)]
    plan = _plan_collectives.scatter(CPU4, [out], [parts], 1)  # this process is the root
    # The rows, then the verdicts: a word per rank, summed over the group (all 0: accepted).
    blocks = ((8, "int32"), (4, "int32"))
    assert plan.key == ProgramKey("scatter", (0, 1, 2, 3), blocks, (1, True), "xla")
    assert plan.blocks[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert plan.blocks[1].tolist() == [0] * 4 and plan.rejected is None
    assert plan.checks == 1 and plan.data_blocks == ((8, "int32"),)
    plan = _plan_collectives.scatter(CPU4, [out], [], 0)
    assert plan.blocks[0].tolist() == [0] * 8


def test_even_all_to_all_is_one_program() -> None:
    x = torch.arange(8, dtype=torch.int16).reshape(4, 2)
    out = torch.empty(4, 2, dtype=torch.int16)
    plan = _plan_all_to_all.all_to_all_single(CPU4, out, x, [], [])
    assert plan.then is None
    # Each peer's chunk is two int16s: one 32-bit word (exchange_words), the same bytes.
    assert plan.key == ProgramKey("alltoall", (0, 1, 2, 3), ((4, "int32"),), (), "xla")
    assert torch.equal(plan.blocks[0].view(torch.int16), x.view(-1))
    plan.finish([torch.arange(100, 108, dtype=torch.int16).view(torch.int32)])
    assert out.view(-1).tolist() == list(range(100, 108))


@pytest.mark.parametrize(("dtype", "rows", "word"), [
    (torch.bfloat16, 8, "int32"), (torch.bfloat16, 24, "int32"), (torch.bfloat16, 12, "int16"),
    (torch.bfloat16, 4, "int16"), (torch.int8, 16, "int32"), (torch.uint8, 8, "int8"),
    (torch.bool, 4, "int8"),
    (torch.float32, 4, "int32"), (torch.float64, 4, "int32"),
])
def test_even_all_to_all_moves_32_bit_words_where_each_chunk_is_whole_ones(
    dtype: torch.dtype, rows: int, word: str
) -> None:
    # 4 peers: a chunk is rows / 4 elements; narrower words only when a chunk is no whole
    # number of 32-bit words. The program's blocks hold the tensor's own bytes.
    x = (torch.arange(rows) % 7 + 1).to(dtype)
    plan = _plan_all_to_all.all_to_all_single(CPU4, torch.empty_like(x), x, [], [])
    ((length, name),) = plan.key.blocks
    assert name == word and length * plan.blocks[0].element_size() == x.numel() * x.element_size()
    assert plan.blocks[0].view(torch.uint8).tolist() == x.view(torch.uint8).tolist()


def test_uneven_all_to_all_agrees_on_the_widest_chunk_first() -> None:
    # rank 0 of 2 sends 1 row to itself and 3 to rank 1, and receives 1 and 2 rows.
    x = torch.arange(4, dtype=torch.int32)
    out = torch.zeros(3, dtype=torch.int32)
    plan = _plan_all_to_all.all_to_all_single(CPU2, out, x, [1, 2], [1, 3])
    # (the widest chunk, the verdict: 0 as this rank accepted its arguments)
    assert plan.key == ProgramKey("allreduce", (10, 11), ((2, "int64"),), ("MAX",), "exchange")
    assert plan.blocks[0].tolist() == [3, 0]
    agreed = plan.finish([torch.tensor([3, 0])])
    padded = plan.then(agreed)
    # a row per peer: width 3, then the row's length in 4 words (one used: 16 bytes keep every
    # row aligned for 8- and 16-byte elements)
    assert padded.key == ProgramKey("alltoall", (10, 11), ((14, "int32"),), (), "xla")
    assert padded.blocks[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 2, 3, 3, 0, 0, 0]
    # rank 0 got [0 . . | 1] from itself, [7 8 . | 2] from rank 1
    padded.finish([torch.tensor([0, 0, 0, 1, 0, 0, 0, 7, 8, 0, 2, 0, 0, 0], dtype=torch.int32)])
    assert out.tolist() == [0, 7, 8]
    # group rank 1 (global 6) says it sent 3 rows where this rank expects 2: an error naming
    # both (global ranks), out unchanged
    with pytest.raises(dist.DistBackendError, match=r"rank 6 sent 3 rows, this rank expected 2"):
        padded.finish([torch.tensor([5, 0, 0, 1, 0, 0, 0, 7, 8, 9, 3, 0, 0, 0], dtype=torch.int32)])
    assert out.tolist() == [0, 7, 8]
    # nothing to move anywhere: no second program
    empty = _plan_all_to_all.all_to_all_single(CPU2, torch.zeros(0), torch.zeros(0), [0, 0], [0, 0])
    assert empty.then([torch.tensor([0, 0])]).key is None


def test_size_buckets_are_few_and_pad_by_at_most_a_quarter() -> None:
    assert [_plan_all_to_all.size_bucket(n) for n in range(1, 18)] == [
        1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20]
    sizes = range(1, 1 << 16)
    buckets = {_plan_all_to_all.size_bucket(n) for n in sizes}
    assert len(buckets) <= 4 * 16
    assert all(n <= _plan_all_to_all.size_bucket(n) <= 1.25 * n for n in sizes)
    assert all(_plan_all_to_all.size_bucket(b) == b for b in buckets)  # a bucket is its own bucket


def test_uneven_all_to_all_pads_the_agreed_width_to_its_bucket() -> None:
    # rank 0 of 2 sends 9 rows to rank 1 and 2 to itself; the widest chunk agreed is 11
    # (another rank's), padded to 12: every width from 11 to 12 runs one program.
    x = torch.arange(11, dtype=torch.int32)
    out = torch.zeros(5, dtype=torch.int32)
    plan = _plan_all_to_all.all_to_all_single(CPU2, out, x, [2, 3], [2, 9])
    padded = plan.then(plan.finish([torch.tensor([11, 0])]))
    assert padded.key == ProgramKey("alltoall", (10, 11), ((32, "int32"),), (), "xla")
    rows = padded.blocks[0].view(2, 16)  # 12 words, then the length in 4
    assert rows[0].tolist() == [0, 1] + [0] * 10 + [2, 0, 0, 0]
    assert rows[1].tolist() == list(range(2, 11)) + [0] * 3 + [9, 0, 0, 0]
    got = torch.zeros(2, 16, dtype=torch.int32)
    got[0, :2] = torch.tensor([0, 1])
    got[0, 12] = 2
    got[1, :3] = torch.tensor([20, 21, 22])
    got[1, 12] = 3
    padded.finish([got.view(-1)])
    assert out.tolist() == [0, 1, 20, 21, 22]


def test_a_large_cpu_all_to_all_is_one_permute_per_peer() -> None:
    # 4 ranks, 64 KiB a rank (_plan_algorithms.PERMUTE_MIN_BYTES): rank 1 passes its chunks for ranks 2,
    # 3 and 0 as blocks of their own (views of its tensor); result block k came from rank
    # 1 - k, and its own chunk goes straight from its input to its output.
    n = _plan_algorithms.PERMUTE_MIN_BYTES // 4 // 4
    x = torch.arange(4 * n, dtype=torch.float32)
    out = torch.zeros(4 * n)
    plan = _plan_all_to_all.all_to_all_single(CPU4, out, x, [], [])
    assert plan.key == ProgramKey("alltoall", (0, 1, 2, 3), ((n, "int32"),) * 3, (), "permute")
    chunks = _plan_blocks.words(x).view(4, n)
    assert [b.data_ptr() for b in plan.blocks] == [chunks[j].data_ptr() for j in (2, 3, 0)]
    got = [torch.full((n,), 100 * src, dtype=torch.float32).view(torch.int32) for src in (0, 3, 2)]
    plan.finish(got)
    want = torch.cat([torch.full((n,), 0.0), x[n:2 * n], torch.full((n,), 200.0),
                      torch.full((n,), 300.0)])
    assert torch.equal(out, want)
    # Below the threshold: XLA's all-to-all of one block.
    small = _plan_all_to_all.all_to_all_single(CPU4, torch.zeros(8), torch.zeros(8), [], [])
    assert small.key.algorithm == "xla" and len(small.key.blocks) == 1
    # On TPU, always XLA's all-to-all (it rides ICI).
    tpu = dataclasses.replace(CPU4, platform="tpu")
    assert _plan_all_to_all.all_to_all_single(tpu, out, x, [], []).key.algorithm == "xla"


def test_a_large_uneven_cpu_all_to_all_pads_each_chunk_and_appends_its_length() -> None:
    # 2 ranks: rank 0 sends 3 rows to itself and the agreed width (a bucket) to rank 1, as one
    # collective-permute; each chunk is followed by its length (4 words, the first used), which
    # the receiver checks.
    width = _plan_all_to_all.size_bucket(_plan_algorithms.PERMUTE_MIN_BYTES // 4)
    x = torch.arange(3 + width, dtype=torch.int32)
    out = torch.zeros(3 + 5, dtype=torch.int32)
    plan = _plan_all_to_all.all_to_all_single(CPU2, out, x, [3, 5], [3, width])
    padded = plan.then(plan.finish([torch.tensor([width, 0])]))
    assert padded.key == ProgramKey("alltoall", (10, 11), ((width + 4, "int32"),), (), "permute")
    assert torch.equal(padded.blocks[0][:width], x[3:])
    assert padded.blocks[0][width:].tolist() == [width, 0, 0, 0]
    from_peer = torch.zeros(width + 4, dtype=torch.int32)
    from_peer[:5] = torch.tensor([9, 8, 7, 6, 5])
    from_peer[width] = 5
    padded.finish([from_peer])
    assert out.tolist() == [0, 1, 2, 9, 8, 7, 6, 5]


def test_uneven_all_to_all_of_bf16_pads_its_rows_to_32_bit_words() -> None:
    # rank 0 of 2 sends 1 element to itself and 2 to rank 1; the widest chunk agreed is 3
    # elements, padded to 4 (two 32-bit words a row), then the row's length in one more 32-bit
    # word; rank 1 sent it 3.
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    out = torch.zeros(4, dtype=torch.bfloat16)
    plan = _plan_all_to_all.all_to_all_single(CPU2, out, x, [1, 3], [1, 2])
    padded = plan.then(plan.finish([torch.tensor([3, 0])]))
    assert padded.key == ProgramKey("alltoall", (10, 11), ((6, "int32"),), (), "xla")
    rows = padded.blocks[0].view(torch.bfloat16).view(2, 6)
    assert rows[:, :4].tolist() == [[1.0, 0.0, 0.0, 0.0], [2.0, 3.0, 0.0, 0.0]]
    assert padded.blocks[0].view(2, 3)[:, 2].tolist() == [1, 2]  # the lengths, in elements
    # what rank 0 gets back: its own row 0, then rank 1's row for it (7, 8, 9)
    got = torch.zeros(2, 6, dtype=torch.bfloat16)
    got[0, 0], got[1, :3] = 1.0, torch.tensor([7.0, 8.0, 9.0])
    got = got.view(-1).view(torch.int32).view(2, 3)
    got[0, 2], got[1, 2] = 1, 3
    padded.finish([got.reshape(-1)])
    assert out.tolist() == [1.0, 7.0, 8.0, 9.0]


def test_empty_blocks_stay_out_of_the_program() -> None:
    t = torch.empty(0, 3)
    plan = _plan_collectives.all_reduce(CPU2, [t], SUM)
    assert plan.key is None and plan.blocks == ()
    assert plan.finish([]) == [t]
    a, b = torch.empty(0), torch.ones(2)
    plan = _plan_collectives.all_reduce_coalesced(CPU2, [a, b], SUM)
    assert plan.key.blocks == ((2, "float32"),)
    assert plan.finish([torch.tensor([3.0, 4.0])]) == [a, b] and b.tolist() == [3.0, 4.0]


def test_barrier_and_p2p_keys() -> None:
    assert _plan_collectives.barrier(CPU4).key == ProgramKey("barrier", (0, 1, 2, 3), ((1, "int32"),), (),
                                                 "xla")
    # CPU2 is global ranks (4, 6) on devices (10, 11); this process is global rank 4.
    send = _plan_p2p.p2p(CPU2, "send", [torch.ones(3)], 1, 7)
    assert send.key == ProgramKey("permute", (10, 11), ((3, "int32"),), ((0, 1),), "xla")
    assert (send.peer, send.pair, send.tag, send.group) == (6, (4, 6), 7, CPU2.name)
    # Every message first moves its header (group, tag, size), the same way.
    assert send.header == ProgramKey(
        "permute", (10, 11), ((_plan.P2P_HEADER_WORDS, "int32"),), ((0, 1),), "xla"
    )
    recv = _plan_p2p.p2p(CPU2, "recv", [torch.ones(3)], 1, 7)
    assert recv.key.params == ((1, 0),)  # the higher rank sends
    view = GroupView(1, 2, (10, 11), "cpu", (4, 6))  # global rank 6 sends to 4
    assert _plan_p2p.p2p(view, "send", [torch.ones(3)], 0, 0).key.params == ((1, 0),)
    empty = _plan_p2p.p2p(CPU2, "send", [torch.ones(0)], 1, 0)
    assert empty.key is None and empty.header.params == ((0, 1),)  # only the header moves


def test_receive_from_any_source_is_a_plain_receive_once_the_source_is_known() -> None:
    # CPU4, group rank 1 (devices 0..3, global ranks = group ranks): any of 0, 2, 3 may send.
    out = torch.zeros(3)
    plan = _plan_p2p.recv_any_source(CPU4, [out], 5)
    assert (plan.peers, plan.tag, plan.description) == ((0, 2, 3), 5, "recv (any source, tag 5)")
    from_3 = plan.from_source(3)
    direct = _plan_p2p.p2p(CPU4, "recv", [out], 3, 5)
    assert (from_3.key, from_3.pair, from_3.peer_group_rank, from_3.description) == (
        direct.key, direct.pair, 3, direct.description
    )
    assert from_3.key == ProgramKey("permute", (1, 3), ((3, "int32"),), ((1, 0),), "xla")
    from_3.finish([torch.tensor([1.0, 2.0, 3.0]).view(torch.int32)])
    assert out.tolist() == [1.0, 2.0, 3.0]
    # In a group of two the sender can only be the other rank; on CPU2 (global ranks 4, 6) the
    # received-from count is kept by group rank.
    two = _plan_p2p.recv_any_source(CPU2, [torch.zeros(2)], 0)
    assert two.peers == (1,) and two.from_source(1).peer_group_rank == 1
    with pytest.raises(ValueError, match="itself"):
        plan.from_source(1)
    with pytest.raises(ValueError, match="one tensor per call"):
        _plan_p2p.recv_any_source(CPU4, [torch.zeros(2), torch.zeros(2)], 0)


# -- algorithms --------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "itemsize", "dtype"), [(2, 4, "float32"), (4, 4, "float32"), (2, 2, "bfloat16")])
def test_small_cpu_all_reduces_exchange_up_to_the_limit(size: int, itemsize: int, dtype: str) -> None:
    at = LIMIT // itemsize
    assert choose_algorithm("allreduce", ((at, dtype),), ("SUM",), "cpu", size) == "exchange"
    assert choose_algorithm("allreduce", ((at + 1, dtype),), ("SUM",), "cpu", size) == "xla"
    # a coalesced call counts the bytes of all its blocks
    half = ((at // 2, dtype), (at // 2 + 1, dtype))
    assert choose_algorithm("allreduce", half, ("SUM",), "cpu", size) == "xla"


def test_small_cpu_all_gathers_count_their_output() -> None:
    # 4 ranks of int32: the output holds 4 blocks, so the limit is a quarter as many words.
    at = LIMIT // (4 * 4)
    assert choose_algorithm("allgather", ((at, "int32"),), (), "cpu", 4) == "exchange"
    assert choose_algorithm("allgather", ((at + 1, "int32"),), (), "cpu", 4) == "xla"


def test_algorithm_rules() -> None:
    big = ((10**7, "float32"),)
    assert choose_algorithm("reduce_scatter", big, ("SUM",), "cpu", 2) == "exchange"
    assert choose_algorithm("reduce_scatter", big, ("SUM",), "tpu", 2) == "xla"
    assert choose_algorithm("reduce_scatter", big, ("MAX",), "tpu", 2) == "exchange"
    assert choose_algorithm("allreduce", big, ("PRODUCT",), "cpu", 2) == "gather_reduce"
    assert choose_algorithm("allreduce", ((8, "int32"),), ("BXOR",), "tpu", 4) == "gather_reduce"
    assert choose_algorithm("allreduce", ((8, "float32"),), ("MAX",), "tpu", 4) == "xla"
    # XLA:TPU emulates 64-bit types: no max/min all-reduce, no reduce-scatter at all
    wide = ((8, "float64"),)
    assert choose_algorithm("allreduce", wide, ("MAX",), "tpu", 4) == "gather_reduce"
    assert choose_algorithm("allreduce", wide, ("SUM",), "tpu", 4) == "xla"
    assert choose_algorithm("reduce_scatter", wide, ("SUM",), "tpu", 4) == "exchange"
    # one device: nothing to exchange; data movement keeps XLA's own
    assert choose_algorithm("allreduce", ((8, "float32"),), ("SUM",), "cpu", 1) == "xla"
    assert choose_algorithm("alltoall", ((8, "int32"),), (), "cpu", 4) == "xla"
    assert choose_algorithm("broadcast", ((8, "int32"), (2, "int32")), (0, True), "cpu", 4) == "xla"


def test_a_familys_groups_share_one_family_program() -> None:
    # Each group of the family plans the same key: every device of the family, group after
    # group, and the number of groups; the body is the group's (2 ranks).
    t = torch.ones(3)
    a, b = _plan_collectives.all_reduce(FAM_A, [t], SUM).key, _plan_collectives.all_reduce(FAM_B, [t], SUM).key
    assert a == b == ProgramKey("allreduce", (0, 1, 2, 3), ((3, "float32"),), ("SUM",),
                                "exchange", 2)
    assert a.group_size == 2
    out = torch.empty(6)
    gathered = _plan_collectives.all_gather_into_tensor(FAM_A, out, torch.ones(3)).key
    assert gathered == ProgramKey("allgather", (0, 1, 2, 3), ((3, "int32"),), (), "exchange", 2)
    # The pair of a send keeps its own program; so does a group of one (nothing to exchange).
    assert _plan_p2p.p2p(FAM_A, "send", [t], 0, 0).key.groups == 1
    single = GroupView(0, 1, (5,), "cpu", (5,), family=((4,), (5,)))
    assert _plan_collectives.all_reduce(single, [t], SUM).key == ProgramKey(
        "allreduce", (5,), ((3, "float32"),), ("SUM",), "xla"
    )


def test_family_programs_on_cpu_v5e_and_v6e_only() -> None:
    # The CPU, and the TPU generations that compile collectives over part of a slice only in a
    # whole-slice program (v5e, v6e), run family programs; v4, v5p and TPU7x keep each group's
    # own (it compiles there, and faster); a TPU device kind tpu_dist does not know gets the
    # family program.
    family = ((0, 1), (2, 3))
    f32 = ((8, "float32"),)
    for platform, kind, groups in (
        ("cpu", "cpu", 2), ("tpu", "TPU v5 lite", 2), ("tpu", "TPU v6 lite", 2),
        ("tpu", "TPU v5", 1), ("tpu", "TPU v4", 1), ("tpu", "TPU7x", 1), ("tpu", "TPU v9", 2),
    ):
        for op, params in (("allgather", ()), ("allreduce", ("SUM",)), ("alltoall", ())):
            key = _plan_algorithms.program_key(op, (0, 1), f32, params, platform, family, kind)
            assert key.groups == groups, (kind, op, key)
            assert key.devices == ((0, 1, 2, 3) if groups == 2 else (0, 1)), key


@pytest.fixture
def generation_registry():
    """Put the process's generation registry back as it was after the test."""
    from tpu_dist.mesh import _generations as reg

    saved = [dict(table) for table in (reg._GENERATIONS, reg._BY_ALIAS, reg._BY_DEVICE_KIND)]
    yield reg
    for table, old in zip((reg._GENERATIONS, reg._BY_ALIAS, reg._BY_DEVICE_KIND), saved):
        table.clear()
        table.update(old)


def test_a_generation_registered_later_is_seen_by_the_plan(generation_registry) -> None:
    # A device kind nobody registered plans family programs; once a generation that compiles
    # group programs registers that kind, the next plan sees it (an earlier answer is not kept).
    import dataclasses

    from tpu_dist.mesh import (
        generation_of_device_kind,
        get_generation,
        register_generation,
    )

    family, f32 = ((0, 1), (2, 3)), ((8, "float32"),)
    assert _plan_algorithms.program_key("allreduce", (0, 1), f32, ("SUM",), "tpu", family, "TPU v99").groups == 2
    v99 = dataclasses.replace(get_generation("v5p"), name="v99", device_kind="TPU v99", other_device_kinds=(),
                              accelerator_prefix="v99", aliases=())
    register_generation(v99)
    assert generation_of_device_kind("TPU v99") is v99
    assert _plan_algorithms.program_key("allreduce", (0, 1), f32, ("SUM",), "tpu", family, "TPU v99").groups == 1
    # A device kind names one generation.
    with pytest.raises(ValueError, match="device kind 'TPU v99' of v100 is already v99's"):
        register_generation(dataclasses.replace(v99, name="v100", accelerator_prefix="v100"))
    assert generation_of_device_kind("TPU v99") is v99


def test_plans_carry_the_algorithm_of_their_platform() -> None:
    t = torch.ones(4, dtype=torch.float64)
    assert _plan_collectives.all_reduce(CPU4, [t], MAX).key.algorithm == "exchange"
    assert _plan_collectives.all_reduce(TPU4, [t], MAX).key.algorithm == "gather_reduce"
    assert _plan_collectives.all_reduce(TPU4, [t], SUM).key.algorithm == "xla"


def test_lowering_follows_the_key_and_refuses_no_algorithm() -> None:
    devices = [object(), object()]
    key = ProgramKey("allreduce", (0, 1), ((4, "float32"),), ("SUM",))
    assert key.algorithm is None
    with pytest.raises(ValueError, match="no program for algorithm None"):
        _lowering.body_for(key, devices)
    with pytest.raises(ValueError, match="alltoall: no program for algorithm 'exchange'"):
        _lowering.body_for(ProgramKey("alltoall", (0, 1), ((4, "int32"),), (), "exchange"),
                           devices)


# -- validation: the op, the values, what to do ------------------------------------------------


def _message(error: type[Exception], call, *args) -> str:
    with pytest.raises(error) as info:
        call(*args)
    return str(info.value)


def _rejection(error: type[Exception], call, *args) -> str:
    """The message of a call rejected on this rank for a reason the other ranks may not see:
    the plan is made, with the error to raise once every rank has run the program."""
    plan = call(*args)
    assert isinstance(plan.rejected, error), plan.rejected
    return str(plan.rejected)


def test_wrong_output_size() -> None:
    msg = _message(ValueError, _plan_collectives.all_gather_into_tensor, CPU4, torch.empty(7),
                   torch.empty(2))
    assert msg.startswith("all_gather_into_tensor: output has 7 elements")
    assert "expected 8" in msg and "pass a tensor of 8 elements" in msg


def test_reduce_op_not_defined_for_dtype() -> None:
    msg = _message(TypeError, _plan_collectives.all_reduce, CPU2, [torch.ones(2, dtype=torch.int32)], AVG)
    assert msg.startswith("all_reduce: ReduceOp.AVG is not supported for dtype torch.int32")
    assert "SUM and divide afterwards" in msg
    msg = _message(TypeError, _plan_collectives.reduce_scatter_tensor, CPU2, torch.ones(2),
                   torch.ones(4), dist.ReduceOp.BAND)
    assert "reduce_scatter_tensor: ReduceOp.BAND" in msg and "integer or bool" in msg


def test_bad_roots_and_peers() -> None:
    msg = _message(ValueError, _plan_collectives.broadcast, CPU2, [torch.ones(2)], 2)
    assert msg.startswith("broadcast: src 2 is not a rank of this group (group ranks are 0..1)")
    assert "pass a rank of the group" in msg
    msg = _message(ValueError, _plan_p2p.p2p, CPU2, "send", [torch.ones(2)], 0, 0)
    assert "send: rank 0 cannot send to itself" in msg and "copy the tensor locally" in msg
    msg = _rejection(ValueError, _plan_collectives.gather, CPU4, [[torch.empty(1)] * 4], [torch.ones(1)], 0)
    assert "gather_list must be empty or None on non-root rank 1 (root is 0)" in msg


def test_bad_lists_and_splits() -> None:
    msg = _message(ValueError, _plan_collectives.all_gather, CPU4, [[torch.empty(2)] * 3], [torch.ones(2)])
    assert "all_gather: output tensor list has 3 tensors" in msg
    assert "group size 4" in msg and "pass a list of 4 tensors" in msg
    msg = _rejection(ValueError, _plan_all_to_all.all_to_all_single, CPU2, torch.empty(3), torch.empty(4),
                     [1, 2], [1, 2])
    assert "all_to_all_single: input split sizes [1, 2] sum to 3" in msg
    assert "must add up to 4" in msg
    msg = _message(ValueError, _plan_all_to_all.all_to_all_single, CPU4, torch.empty(3), torch.empty(3),
                   [], [])
    assert "3 rows in dim 0, which does not split evenly over 4 ranks" in msg
    assert "pass explicit split sizes" in msg


def test_mixed_dtypes() -> None:
    msg = _message(TypeError, _plan_collectives.all_gather_into_tensor, CPU2,
                   torch.empty(4, dtype=torch.float16), torch.ones(2))
    assert "output has dtype torch.float16, expected torch.float32" in msg
    assert "t.to(torch.float32)" in msg
    msg = _message(TypeError, _plan_collectives.all_reduce_coalesced, CPU2,
                   [torch.ones(2), torch.ones(2, dtype=torch.bool)], SUM)
    assert "all_reduce_coalesced" in msg and "coalesce tensors of one kind" in msg


def test_bad_tensors() -> None:
    msg = _message(TypeError, _plan_collectives.all_reduce, CPU2, [torch.ones(2, dtype=torch.uint16)], SUM)
    assert "all_reduce: dtype torch.uint16 of tensor is not supported" in msg
    assert "supported: float32" in msg
    msg = _message(ValueError, _plan_collectives.all_reduce, CPU2, [torch.ones(2), torch.ones(2)], SUM)
    assert "takes one tensor per call, got 2" in msg and "_coalesced" in msg
    expanded = torch.zeros(1).expand(4)
    msg = _message(ValueError, _plan_collectives.all_gather_into_tensor, CPU2, expanded, torch.ones(2))
    assert "share memory" in msg and "torch.empty_like" in msg


# -- TPU block alignment ---------------------------------------------------------------------


def _tpu_group(rank: int) -> GroupView:
    return GroupView(rank, 4, (0, 1, 2, 3), "tpu")


@pytest.mark.parametrize("n", [1000, 1024, 1, 129])
def test_tpu_all_gather_pads_each_rank_to_128_elements(n: int) -> None:
    """On TPU, each rank's all-gather block is padded to a multiple of 128 elements
    (docs/decisions/0022-tpu-block-alignment.md: an unaligned cross-slice all-gather did not
    compile in 8 GiB); the program's gathered result is ``size`` padded parts, and the finish
    writes the unpadded ones: rank r's input, in order. Checked against torch.cat of the inputs,
    the result assembled as XLA would."""
    inputs = [torch.arange(n, dtype=torch.float32) * (r + 1) + r for r in range(4)]
    plans = [_plan_collectives.all_gather_into_tensor(_tpu_group(r), torch.empty(4 * n), inputs[r])
             for r in range(4)]
    padded = -(-n // 128) * 128
    assert {p.key.blocks for p in plans} == {((padded, "int32"),)}
    # what the call itself moves (compile-only reports count this, not the padding)
    assert plans[0].data_blocks == (((n, "int32"),) if n % 128 else None)
    gathered = torch.cat([p.blocks[0] for p in plans])  # what the all-gather returns everywhere
    assert gathered.numel() == 4 * padded
    for p in plans:
        (out,) = p.finish([gathered.clone()])
        assert torch.equal(out, torch.cat(inputs))
    if n % 128:  # the padding is zeros, after the rank's own words
        assert torch.equal(plans[1].blocks[0][n:], torch.zeros(padded - n, dtype=torch.int32))
    assert _plan_collectives.all_gather_into_tensor(CPU4, torch.empty(4 * n), inputs[1]).key.blocks == (
        (n, "int32"),)  # CPU: unchanged


@pytest.mark.parametrize("n", [1000, 256])
def test_tpu_reduce_scatter_pads_each_part_to_128_elements(n: int) -> None:
    """On TPU, each of the ``size`` parts of a reduce-scatter's input is padded to a multiple
    of 128 elements; rank r's result (the sum of every rank's padded part r, computed here as
    XLA would) comes back unpadded: the sum of part r of every input (numpy reference)."""
    import numpy as np

    rng = np.random.default_rng(0)
    inputs = [torch.from_numpy(rng.standard_normal(4 * n).astype(np.float32)) for _ in range(4)]
    plans = [_plan_collectives.reduce_scatter_tensor(_tpu_group(r), torch.empty(n), inputs[r], SUM)
             for r in range(4)]
    padded = -(-n // 128) * 128
    assert {p.key.blocks for p in plans} == {((4 * padded, "float32"),)}
    total = sum(p.blocks[0] for p in plans)  # the reduction over ranks
    want = sum(t.numpy() for t in inputs).reshape(4, n)
    for r, p in enumerate(plans):
        (out,) = p.finish([total.view(4, padded)[r].clone()])
        np.testing.assert_allclose(out.numpy(), want[r], rtol=1e-6)


def test_tpu_coalesced_all_gather_pads_each_block_on_its_own() -> None:
    """Blocks of a coalesced all-gather are padded each (an aligned one is left as it is)."""
    a, b = torch.arange(100, dtype=torch.float32), torch.arange(256, dtype=torch.float32)
    outs = [torch.empty(400), torch.empty(1024)]
    plan = _plan_collectives.all_gather_into_tensor_coalesced(TPU4, outs, [a, b])
    assert plan.key.blocks == ((128, "int32"), (256, "int32"))
    pa = torch.cat([plan.blocks[0]] * 4)
    pb = torch.cat([plan.blocks[1]] * 4)
    got = plan.finish([pa, pb])
    assert torch.equal(got[0], a.repeat(4)) and torch.equal(got[1], b.repeat(4))


def test_gloo_chunk_worked_by_hand() -> None:
    """gloo's ring chunks (decision 0035), by hand. 16,387 float32 on 4 ranks: 65,548 bytes, 8
    segments (twice the ranks), ceil(65,548 / 8) = 8,194 bytes rounded up to whole elements,
    8,196 = 2,049 elements; two a rank: 4,098. 3,003 float32 on 3 ranks: 12,012 bytes, 6
    segments of 2,002 -> 2,004 bytes = 501 elements, two a rank: 1,002 (a rank's reduce-scatter
    part of 1,001 straddles two). 4 Mi + 5 float32 on 4 ranks: 16,777,236 bytes, 17 segments of
    1 MiB rounded up to 20 (a multiple of 4) of ceil(16,777,236 / 20) = 838,862 -> 838,864
    bytes = 209,716 elements, five a rank: 1,048,580. 7 float32 on 4 ranks: 8 segments of 4
    bytes, 2 elements a rank (the last rank's chunk empty)."""
    from tpu_dist.collectives._lowering import gloo_chunk

    assert gloo_chunk(16_387, 4, 4) == 4_098
    assert gloo_chunk(3_003, 4, 3) == 1_002
    assert gloo_chunk((1 << 22) + 5, 4, 4) == 1_048_580
    assert gloo_chunk(7, 4, 4) == 2


def test_sixteen_bit_float_sums_take_the_exchange_on_three_ranks_and_more() -> None:
    """XLA:CPU's own all-reduce of bfloat16 does not add as gloo does (decision 0035): above the
    direct-exchange size a bfloat16 sum on 3 ranks still takes the exchange; on 2 ranks (one
    order) and for float32 (XLA's ring is gloo's) it keeps XLA's."""
    big = ((1 << 20, "bfloat16"),)
    assert choose_algorithm("allreduce", big, ("SUM",), "cpu", 3) == "exchange"
    assert choose_algorithm("allreduce", big, ("SUM",), "cpu", 2) == "xla"
    assert choose_algorithm("allreduce", ((1 << 20, "float32"),), ("SUM",), "cpu", 3) == "xla"
    assert choose_algorithm("allreduce", big, ("MAX",), "cpu", 3) == "xla"
