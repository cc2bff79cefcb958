"""Every collective program the "tpu" backend builds, compiled by libtpu's TPU compiler.

libtpu's compile-only devices stand in for a TPU (no TPU here). Each program kind, with every
reduce op and every dtype the backend sends (reductions on the values; data movement on
int8/int16/int32 words, see ``_plan_blocks.words``), is compiled with the lowering TPUs run, and
the compiled TPU HLO is read back: its collective ops must be the ones expected for the kind and
their replica groups exactly the group's devices. Groups: a whole v5p 4x4x4 slice, one ICI axis
of a ``plan_mesh`` layout of two such slices, and a ``plan_mesh`` DCN group spanning both; and
FSDP's all-gather and reduce-scatter over every device of a TPU7x slice (128 and 512 devices),
which compile only with the generation's compiler options (``_lowering.compiler_options``).

XLA rewrites op names (a reduce-scatter becomes all-reduce + dynamic-slice, an all-gather on a
v5p cube may become an all-reduce), so each kind lists the ops it may become.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("libtpu")

from tpu_dist.collectives import (  # noqa: E402
    ProgramKey,
    _lowering,
    _plan,
    _plan_all_to_all,
    _plan_blocks,
    _plan_collectives,
)
from tpu_dist.collectives.compile_only import (  # noqa: E402
    CompiledCollective,
    compile_collective,
    hlo_collectives,
    topology_devices,
)
from tpu_dist.mesh import Topology, get_generation, plan_mesh  # noqa: E402

_FLOATS = ("float32", "float64", "bfloat16", "float16", "complex64")
_INTS = ("int8", "int16", "int32", "int64", "uint8")  # uint8 also carries bool (as MAX/MIN)
_WORDS = ("int8", "int16", "int32")


# Every op on the dtypes where lowerings differ (32-bit native; 64-bit and complex emulated by
# XLA:TPU, see _plan_algorithms.choose_algorithm); a sum and a max on the other dtypes.
_ALL_OPS_DTYPES = ("float32", "int32", "float64", "int64", "complex64")


def _reduce_cases(kind: str) -> list[tuple[str, tuple]]:
    cases = []
    for dtype in _FLOATS + _INTS:
        complex_ = dtype.startswith("complex")
        if dtype in _ALL_OPS_DTYPES and (kind == "allreduce" or dtype.startswith("float")):
            ops = ["SUM", "AVG", "PRODUCT"]
            if not complex_:
                ops += ["MAX", "MIN"]
            ops += ["BAND", "BOR", "BXOR"] if dtype in _INTS else ["PREMUL_SUM"]
        else:
            ops = ["SUM", "PRODUCT" if complex_ else "MAX"]
        cases += [(kind, dtype, (op, 0.5) if op == "PREMUL_SUM" else (op,)) for op in ops]
    return cases


# kind -> HLO ops its program may compile to (inside one slice).
_MAY_BECOME = {
    "allreduce": {"all-reduce", "all-gather", "all-to-all"},  # all-gather: PRODUCT, bitwise ops
    "reduce_scatter": {"all-reduce", "reduce-scatter", "all-to-all"},
    "allgather": {"all-gather", "all-reduce", "all-to-all"},
    "alltoall": {"all-to-all"},
    "scatter": {"all-to-all"},
    "broadcast": {"all-reduce"},
    "barrier": {"all-reduce"},
    "permute": {"collective-permute"},
}

# One program of each kind (and the TPU-specific wide-dtype reductions) for the large groups.
_KINDS = [
    ("allreduce", "bfloat16", ("AVG",)),
    ("allreduce", "float64", ("MAX",)),
    ("reduce_scatter", "float32", ("PREMUL_SUM", 0.25)),
    ("reduce_scatter", "float64", ("SUM",)),
    ("allgather", "uint8", ()),  # the call check's all-gather of call descriptions
    ("alltoall", "int32", ()),
    ("broadcast", "int8", (3,)),
    ("scatter", "int32", (0,)),
    ("barrier", "int32", ()),
]


@pytest.fixture(scope="module")
def small_slice() -> list:
    """One v5p-8 host (2x2x1 chips): cheap compiles for the whole op x dtype matrix."""
    return topology_devices(Topology.create("v5p", "2x2x1"))


@pytest.fixture(scope="module")
def two_slices() -> tuple[Topology, list]:
    topo = Topology.create("v5p", "4x4x4", num_slices=2)
    return topo, topology_devices(topo)


def _compile(kind: str, dtype: str, params: tuple, devices: list) -> CompiledCollective:
    # 8 elements a rank: small blocks, a multiple of the group size where ops split them.
    length = 8 * len(devices) if kind in ("reduce_scatter", "alltoall", "scatter") else 8
    key = ProgramKey(kind, tuple(d.id for d in devices), ((length, dtype),), params)
    return compile_collective(key, devices)


def _check_in_slice(result: CompiledCollective, kind: str, size: int) -> None:
    """Collectives of ``kind``'s ops only, each partitioning program positions 0..size-1."""
    ops = [c for c in result.collectives if c.op != "megascale-send"]
    assert ops, result.hlo_text
    assert {c.op for c in ops} <= _MAY_BECOME[kind], [c.op for c in ops]
    for c in ops:
        members = [i for group in c.replica_groups for i in group]
        if c.op == "collective-permute":
            continue
        assert sorted(members) == list(range(size)), (c.op, c.replica_groups)


@pytest.mark.parametrize(
    ("kind", "dtype", "params"), _reduce_cases("allreduce") + _reduce_cases("reduce_scatter")
)
def test_every_reduction_compiles(small_slice: list, kind: str, dtype: str, params: tuple) -> None:
    result = _compile(kind, dtype, params, small_slice)
    _check_in_slice(result, kind, len(small_slice))


@pytest.mark.parametrize("dtype", _WORDS)
@pytest.mark.parametrize(
    ("kind", "params"),
    [("allgather", ()), ("alltoall", ()), ("broadcast", (1,)), ("scatter", (2,))],
)
def test_every_data_movement_compiles(
    small_slice: list, kind: str, params: tuple, dtype: str
) -> None:
    result = _compile(kind, dtype, params, small_slice)
    _check_in_slice(result, kind, len(small_slice))


def test_complex128_is_a_clear_error_not_a_compiler_crash(small_slice: list) -> None:
    # libtpu's compiler segfaults the process on any complex128 program (docs/reference/libtpu.md).
    with pytest.raises(TypeError, match="complex128 collectives cannot be compiled for TPU"):
        _compile("allreduce", "complex128", ("SUM",), small_slice)


@pytest.mark.parametrize(("kind", "dtype", "params"), _KINDS)
def test_whole_slice(two_slices: tuple, kind: str, dtype: str, params: tuple) -> None:
    topo, devices = two_slices
    group = devices[: topo.devices_per_slice]  # slice 0, 64 chips
    _check_in_slice(_compile(kind, dtype, params, group), kind, len(group))


@pytest.mark.parametrize(("kind", "dtype", "params"), _KINDS)
def test_plan_mesh_ici_axis(two_slices: tuple, kind: str, dtype: str, params: tuple) -> None:
    # (dp, fsdp, tp) = (2, 8, 8): dp across the two slices, fsdp x tp inside each. The tp group
    # of rank 0 is 8 chips of slice 0, each one ICI hop from the next.
    topo, devices = two_slices
    ranks = plan_mesh(topo, (1, 8, 8), (2, 1, 1))
    group_ranks = ranks[0, 0, :].tolist()
    assert set(topo.slice_of(group_ranks).tolist()) == {0}
    group = [devices[r] for r in group_ranks]
    result = _compile(kind, dtype, params, group)
    _check_in_slice(result, kind, len(group))
    assert not [c for c in result.collectives if c.op == "megascale-send"]


@pytest.mark.parametrize(("kind", "dtype", "params"), _KINDS)
def test_group_spanning_two_slices(two_slices: tuple, kind: str, dtype: str, params: tuple) -> None:
    # The (dp, fsdp) = (2, 8) group of rank 0 in the layout above: 8 chips in each slice. XLA
    # runs the ICI part over each slice's 8 program devices (positions 0..7) and hands the rest
    # to the multi-slice runtime: sends whose target is exactly the group's devices.
    topo, devices = two_slices
    ranks = plan_mesh(topo, (1, 8, 8), (2, 1, 1))
    group_ranks = ranks[:, :, 0].reshape(-1).tolist()
    assert topo.slice_of(group_ranks).tolist() == [0] * 8 + [1] * 8
    group = [devices[r] for r in group_ranks]
    result = _compile(kind, dtype, params, group)
    dcn = [c for c in result.collectives if c.op == "megascale-send"]
    assert dcn, result.hlo_text
    for c in dcn:
        assert sorted(c.megascale_devices()) == sorted(d.id for d in group), c.megascale_target
    for c in result.collectives:
        if c.op != "megascale-send":
            members = sorted(i for g in c.replica_groups for i in g)
            assert members == list(range(8)), (c.op, c.replica_groups)


@pytest.mark.parametrize("across", [False, True], ids=["ici", "dcn"])
def test_point_to_point(two_slices: tuple, across: bool) -> None:
    # send/recv: a two-device permute program (lower device first, as the backend builds it).
    topo, devices = two_slices
    peer = topo.devices_per_slice if across else 1
    result = _compile("permute", "int32", ((0, 1),), [devices[0], devices[peer]])
    ops = [c.op for c in result.collectives]
    assert ops == (["megascale-send"] if across else ["collective-permute"]), result.hlo_text
    for c in result.collectives:
        if across:  # one-to-one from the first device to the second, over DCN
            assert c.megascale_transfer == "ONE_TO_ONE"
            assert c.megascale_devices() == (devices[0].id, devices[peer].id)
        else:
            assert c.replica_groups == ((0, 1),)


def test_hlo_collectives_reads_both_group_spellings() -> None:
    text = (
        "  %a = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=1, replica_groups={{0,2},{1,3}}, "
        "use_global_device_ids=true, to_apply=%add\n"
        "  %b = f32[8]{0} all-gather-start(f32[4]{0} %y), replica_groups=[2,2]<=[2,2]T(1,0), "
        "dimensions={0}\n"
        "  %c = f32[8]{0} all-gather-done(%b)\n"
        "  %d = s32[4]{0} collective-permute(s32[4]{0} %z), source_target_pairs={{0,1},{1,0}}\n"
    )
    found = hlo_collectives(text)
    assert [(c.op, c.replica_groups) for c in found] == [
        ("all-reduce", ((0, 2), (1, 3))),
        ("all-gather", ((0, 2), (1, 3))),
        ("collective-permute", ((0, 1), (1, 0))),
    ]


# -- whole TPU7x slices (issue 31) -------------------------------------------------------------

_TPU7X: dict[str, list] = {}


def _tpu7x(shape: str) -> list:
    if shape not in _TPU7X:
        _TPU7X[shape] = topology_devices(Topology.create("tpu7x", shape))
    return _TPU7X[shape]


def _whole_slice_plan(devices: list, op: str, dtype: torch.dtype, block: int) -> _plan.Plan:
    """The "tpu" backend's plan of an FSDP collective over every device of the slice: an
    ``all_gather_into_tensor`` of ``block`` elements a rank, or a ``reduce_scatter_tensor``
    (SUM) whose output is ``block`` elements a rank."""
    n = len(devices)
    view = _plan.GroupView(
        0, n, tuple(d.id for d in devices), "tpu", tuple(range(n)),
        device_kind=devices[0].device_kind,
    )
    if op == "all_gather":
        return _plan_collectives.all_gather_into_tensor(
            view, torch.empty(block * n, dtype=dtype), torch.ones(block, dtype=dtype)
        )
    return _plan_collectives.reduce_scatter_tensor(
        view, torch.empty(block, dtype=dtype), torch.ones(block * n, dtype=dtype),
        dist.ReduceOp.SUM,
    )


# Blocks libtpu (docs/reference/libtpu.md) refused over a whole TPU7x slice without the generation's
# compiler options (docs/decisions/0021-tpu7x-sparsecore-all-reduce-offload-off.md): 128 and 1,024
# elements a rank (issue 31's MaxText programs), and a large bf16 block.
_WHOLE_SLICE = [
    ("all_gather", torch.float32, 128),
    ("all_gather", torch.bfloat16, 1024),
    ("all_gather", torch.bfloat16, 65536),
    ("reduce_scatter", torch.float32, 1024),
    ("reduce_scatter", torch.bfloat16, 65536),
]


@pytest.mark.parametrize(("op", "dtype", "block"), _WHOLE_SLICE)
def test_whole_tpu7x_slice_all_gather_and_reduce_scatter_compile(
    op: str, dtype: torch.dtype, block: int
) -> None:
    # A pure-FSDP job over a whole TPU7x slice (MaxText's layout): XLA:TPU makes each of these
    # one all-reduce over the whole slice, which libtpu's SparseCore offload then failed on
    # ("async-update instruction should have 1 operands but sees 2").
    devices = _tpu7x("4x4x4")
    key = _whole_slice_plan(devices, op, dtype, block).key
    assert key.devices == tuple(d.id for d in devices) and key.algorithm == "xla"
    result = compile_collective(key, devices)
    ops = [c for c in result.collectives if c.op != "megascale-send"]
    assert [c.op for c in ops] in (["all-reduce"], ["all-gather"], ["reduce-scatter"]), [
        c.op for c in ops
    ]
    assert ops[0].replica_groups == (tuple(range(len(devices))),), ops[0].replica_groups


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_whole_512_device_tpu7x_slice_compiles(op: str) -> None:
    # The slice of MaxText's TPU7x recipes (tpu7x:4x8x8, 512 devices), bf16 blocks of 4,096.
    devices = _tpu7x("4x8x8")
    key = _whole_slice_plan(devices, op, torch.bfloat16, 4096).key
    (found,) = [c for c in compile_collective(key, devices).collectives]
    assert found.op in ("all-reduce", "all-gather", "reduce-scatter"), found.op
    assert found.replica_groups == (tuple(range(512)),)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_large_narrow_all_to_all_compiles_on_tpu7x(dtype: torch.dtype) -> None:
    # all_to_all_single of 32 MiB a rank over 4 TPU7x devices: as 16- or 8-bit words libtpu
    # (docs/reference/libtpu.md) refused it ("async-update instruction should have 1 operands
    # but sees 2"); the plan moves the same bytes as 32-bit words (_plan_blocks.exchange_words), which
    # compile.
    devices = _tpu7x("4x4x4")[:4]
    view = _plan.GroupView(0, 4, tuple(d.id for d in devices), "tpu", tuple(range(4)),
                           device_kind=devices[0].device_kind)
    n = (32 << 20) // dtype.itemsize
    key = _plan_all_to_all.all_to_all_single(
        view, torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype), [], []
    ).key
    (found,) = compile_collective(key, devices).collectives
    assert found.op == "all-to-all" and found.replica_groups == ((0, 1, 2, 3),)
    assert key.blocks == ((8 << 20, "int32"),), key.blocks


def test_a_routed_all_to_all_compiles_once_per_width_bucket(small_slice: list) -> None:
    # A mixture of experts' token exchange (bf16 rows of 256, splits from the router) as the
    # backend plans it for TPU: the MAX agreement on the widest chunk, then every chunk padded
    # to that width's size bucket. Widest chunks of 1,000 to 1,299 rows (a routing's spread
    # around a balanced 1,024) are 3 programs, not 300; each compiles to one all-to-all over
    # the group (no ragged all-to-all: docs/decisions/0033-varying-sizes-and-memory.md, says why).
    devices = small_slice
    size = len(devices)
    view = _plan.GroupView(0, size, tuple(d.id for d in devices), "tpu", tuple(range(size)),
                           device_kind=devices[0].device_kind)
    dim, mine = 256, [1000] * size
    keys = set()
    for widest in range(1000, 1300):
        x = torch.empty(sum(mine), dim, dtype=torch.bfloat16)
        plan = _plan_all_to_all.all_to_all_single(view, torch.empty_like(x), x, mine, mine)
        agreement = plan.key
        padded = plan.then(plan.finish([torch.tensor([widest * dim, 0])]))
        keys.add(padded.key)
    assert len(keys) == 3, sorted(k.blocks for k in keys)
    (found,) = compile_collective(agreement, devices).collectives
    assert found.op in _MAY_BECOME["allreduce"], found.op
    for key in sorted(keys, key=lambda k: k.blocks):
        (length, word), = key.blocks
        assert word == "int32" and length % size == 0, key.blocks
        (found,) = compile_collective(key, devices).collectives
        assert found.op == "all-to-all" and found.replica_groups == (tuple(range(size)),)


def test_compiler_options_come_from_the_generation() -> None:
    # TPU7x programs get the generation's options; other TPUs and the CPU get none, however
    # small the program (small CPU programs' own options: tests/test_compile_options.py).
    small = ProgramKey("allreduce", (0, 1), ((4, "float32"),), ("SUM", None))
    tpu7x = _tpu7x("4x4x4")
    for key in (None, small):
        assert _lowering.compiler_options(tpu7x[:2], key) == {
            "xla_tpu_enable_sparse_core_collective_offload_all_reduce": False
        }
    assert dict(get_generation("v7x").collective_compiler_options) == (
        _lowering.compiler_options(tpu7x)
    )
    v5p = topology_devices(Topology.create("v5p", "2x2x1"))
    assert _lowering.compiler_options(v5p) == {} == _lowering.compiler_options(v5p[:2], small)
    import jax

    assert _lowering.compiler_options(jax.devices("cpu")) == {}


def test_tpu7x_all_gather_blocks_are_padded_to_whole_tiles_and_unpadded() -> None:
    # TPU7x: each rank's all-gather block is padded to a multiple of 1,024 words (not only of
    # _plan_algorithms.TPU_BLOCK_ALIGN, 128: 1,100 -> 2,048, not 1,152); the output is every rank's
    # unpadded block, in rank order. CPU plans are not padded.
    n, size = 1100, 4
    inputs = [torch.arange(n, dtype=torch.bfloat16) + 1000 * r for r in range(size)]
    for platform, kind, expected in (("tpu", "TPU7x", 2048), ("cpu", "cpu", n)):
        view = _plan.GroupView(0, size, (0, 2, 4, 6), platform, device_kind=kind)
        out = torch.empty(size * n, dtype=torch.bfloat16)
        plan = _plan_collectives.all_gather_into_tensor(view, out, inputs[0])
        assert plan.key.blocks == ((expected, "int16"),)
        assert torch.equal(plan.blocks[0][:n], _plan_blocks.words(inputs[0]))
        assert not plan.blocks[0][n:].any()
        # What the program returns: every rank's (padded) block, in rank order.
        gathered = torch.cat([
            torch.nn.functional.pad(_plan_blocks.words(t), (0, expected - n)) for t in inputs
        ])
        (written,) = plan.finish([gathered])
        assert written is out and torch.equal(out, torch.cat(inputs))


def test_an_unaligned_tpu7x_all_gather_stays_a_native_all_gather() -> None:
    # The FSDP all-gather of Qwen3-32B's small layout: one core of each chip of tpu7x:2x2x1
    # (4 devices), bf16 blocks not a multiple of 1,024 words. Unpadded (or padded to 128 only),
    # libtpu compiles it slowly with scratch (4,000,000 words, a multiple of 128: 31 s, 61 MiB;
    # 30,000,000: 126 s, 801 MiB) or into an all-reduce (1,000,000); padded to 1,024, into a
    # native all-gather with no scratch in about a second.
    devices = topology_devices(Topology.create("tpu7x", "2x2x1"))[::2]
    view = _plan.GroupView(
        0, 4, tuple(d.id for d in devices), "tpu", device_kind=devices[0].device_kind
    )
    n = 4_000_000
    plan = _plan_collectives.all_gather_into_tensor(
        view, torch.empty(4 * n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    )
    assert plan.key.blocks == ((4_000_768, "int16"),)
    result = compile_collective(plan.key, devices)
    assert [(c.op, c.replica_groups) for c in result.collectives] == [
        ("all-gather", ((0, 1, 2, 3),))
    ], result.hlo_text[-2000:]
    assert result.temp_bytes == 0
