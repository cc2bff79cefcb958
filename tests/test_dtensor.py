"""DTensor on the "tpu" backend, 8 ranks: redistribute, ops, and the JAX interop.

Meshes used (torch's ``init_device_mesh("cpu", ...)``, ranks in row-major order):
    1-D (8,)       one group of all 8 ranks
    2-D (2, 4)     dim 0 groups {0, 4} {1, 5} {2, 6} {3, 7}; dim 1 groups {0..3} {4..7}
    3-D (2, 2, 2)  dim 0 {r, r+4}; dim 1 {r, r+2}; dim 2 {r, r+1} (r with that bit clear)

The reference is independent of DTensor: a full tensor with integer values (so every sum is
exact), torch.chunk semantics for ``Shard`` (chunks of ceil(n/k); trailing ones may be empty:
the shapes below are uneven on purpose), and for ``Partial`` local values built so that their
sum / mean / max over the axis is the full value. Every redistribution is checked exactly.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

from tests.harness import World

WORLD_SIZE = 8


@pytest.fixture(scope="module")
def world() -> World:
    with World(WORLD_SIZE, backend="tpu", timeout=240.0) as w:
        yield w


# -- the reference -------------------------------------------------------------------------


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(-50, 50, shape, generator=g).float()


def _chunk(n: int, k: int, c: int) -> slice:
    """torch.chunk(n, k)'s c-th piece as a slice (empty past the last chunk)."""
    size = -(-n // k) if n else 0
    return slice(min(c * size, n), min((c + 1) * size, n))


def _partial_piece(value: torch.Tensor, op: str, n: int, c: int, salt: int) -> torch.Tensor:
    """Coordinate c's value of a Partial(op) over n ranks whose reduction is ``value``."""
    g = torch.Generator().manual_seed(salt)
    noise = [torch.randint(1, 9, value.shape, generator=g).float() for _ in range(n)]
    if op == "sum":
        return value - sum(noise[1:]) if c == 0 else noise[c]
    if op == "avg":
        return n * value - sum(noise[1:]) if c == 0 else noise[c]
    if op == "max":
        return value if c == 0 else value - noise[c]
    raise ValueError(op)


def _local(full: torch.Tensor, placements, sizes, coord) -> torch.Tensor:
    """What the rank at ``coord`` holds for ``full`` laid out as ``placements``."""
    value = full
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            value = _partial_piece(value, p.reduce_op, sizes[m], coord[m], 100 + m)
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):  # (sf, n, rest) along the dim: column coord[m]
            value = value.unflatten(p.dim, (p.split_factor, sizes[m], -1))
            value = value.select(p.dim + 1, coord[m]).flatten(p.dim, p.dim + 1)
        elif isinstance(p, Shard):
            index = [slice(None)] * full.dim()
            index[p.dim] = _chunk(value.shape[p.dim], sizes[m], coord[m])
            value = value[tuple(index)]
    return value.contiguous()


_NAMES = {"R": Replicate(), "P": Partial("sum"), "Pavg": Partial("avg"), "Pmax": Partial("max")}


def _placement(code: str):
    return Shard(int(code[1:])) if code.startswith("S") else _NAMES[code]


def _check_pairs(mesh, shape, pairs, use_ext: bool) -> list[str]:
    from tpu_dist.dtensor_ext import redistribute

    full = _full(shape)
    sizes = tuple(mesh.shape)
    coord = mesh.get_coordinate()
    problems = []
    for src_codes, dst_codes in pairs:
        src = tuple(_placement(c) for c in src_codes)
        dst = tuple(_placement(c) for c in dst_codes)
        x = DTensor.from_local(
            _local(full, src, sizes, coord), mesh, src, shape=full.shape, stride=full.stride()
        )
        try:
            y = redistribute(x, mesh, dst) if use_ext else x.redistribute(mesh, dst)
        except Exception as err:  # noqa: BLE001 (reported per pair)
            problems.append(f"{src_codes}->{dst_codes}: {type(err).__name__}: {err}"[:300])
            continue
        if y.placements != dst or y.shape != full.shape:
            problems.append(f"{src_codes}->{dst_codes}: got {y.placements} {y.shape}")
        elif any(p.is_partial() for p in dst):
            want_shape = _local(full, [p if p.is_shard() else Replicate() for p in dst], sizes, coord)
            if y.to_local().shape != want_shape.shape or not torch.equal(y.full_tensor(), full):
                problems.append(f"{src_codes}->{dst_codes}: partial result does not reduce to x")
        elif not torch.equal(y.to_local(), _local(full, dst, sizes, coord)):
            problems.append(f"{src_codes}->{dst_codes}: wrong local shard")
    return problems




def _codes(tensor_ndim: int) -> list[str]:
    return [f"S{d}" for d in range(tensor_ndim)] + ["R", "P"]


def _unsupported(src: tuple[str, ...], dst: tuple[str, ...]) -> bool:
    """Pairs DTensor.redistribute refuses on every backend: making a new Partial
    ("redistributing to Partial is for internal use only"; only DTensor ops create Partial)."""
    return any(d.startswith("P") and s != d for s, d in zip(src, dst))


def _has_shard_to_shard(src: tuple[str, ...], dst: tuple[str, ...]) -> bool:
    return any(a.startswith("S") and b.startswith("S") and a != b for a, b in zip(src, dst))


# -- redistribute ----------------------------------------------------------------------------


def _redistribute_1d(rank: int, world_size: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world_size,))
    codes = ["S0", "S1", "R", "P", "Pavg", "Pmax"]
    pairs = [((s,), (d,)) for s in codes for d in codes if not _unsupported((s,), (d,))]
    # (6, 10) on 8 ranks: chunks of 1 and 2 rows/cols, the last 2 and 3 ranks hold nothing
    problems = _check_pairs(mesh, (6, 10), pairs, use_ext=False)
    problems += _check_pairs(mesh, (6, 10), [(s, d) for s, d in pairs if _has_shard_to_shard(s, d)], use_ext=True)
    problems += _check_pairs(mesh, (8, 16), [(("S0",), ("S1",)), (("S1",), ("S0",))], use_ext=True)
    return problems


def _redistribute_2d(rank: int, world_size: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    placements = list(itertools.product(_codes(2), repeat=2))
    pairs = [(s, d) for s in placements for d in placements if not _unsupported(s, d)]
    # (8, 10): dim 1 over tp (4) is uneven (3, 3, 3, 1), over dp x tp (5 -> 2, 2, 1, 0)
    problems = _check_pairs(mesh, (8, 10), pairs, use_ext=False)
    shard_to_shard = [(s, d) for s, d in pairs if _has_shard_to_shard(s, d)]
    problems += _check_pairs(mesh, (8, 10), shard_to_shard, use_ext=True)
    return problems


def _redistribute_3d(rank: int, world_size: int, count: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2, 2))
    placements = list(itertools.product(_codes(3), repeat=3))
    everything = ("R", "R", "R")
    pairs = [(s, everything) for s in placements]
    pairs += [(everything, d) for d in placements if not _unsupported(everything, d)]
    rng = random.Random(7)
    extra = []
    while len(extra) < count:
        s, d = rng.choice(placements), rng.choice(placements)
        if not _unsupported(s, d):
            extra.append((s, d))
    # (4, 6, 8): dim 0 is uneven over 8 ranks, dim 1 over 4, dim 2 is even everywhere
    problems = _check_pairs(mesh, (4, 6, 8), pairs + extra, use_ext=False)
    shard_to_shard = [(s, d) for s, d in extra if _has_shard_to_shard(s, d)]
    problems += _check_pairs(mesh, (4, 6, 8), shard_to_shard, use_ext=True)
    return problems


def test_redistribute_every_pair_1d(world: World) -> None:
    assert world.run(_redistribute_1d) == [[]] * WORLD_SIZE


def test_redistribute_every_pair_2d(world: World) -> None:
    assert world.run(_redistribute_2d) == [[]] * WORLD_SIZE


def test_redistribute_3d(world: World) -> None:
    assert world.run(_redistribute_3d, 24) == [[]] * WORLD_SIZE


def _all_to_all_fast_path(rank: int, world_size: int) -> dict:
    """Which collectives each redistribution runs, and gradients through the fast path."""
    from tpu_dist.dtensor_ext import redistribute

    counts = {}
    mesh2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    mesh3 = init_device_mesh("cpu", (2, 2, 2))
    cases = {
        "1d S0->S1": (init_device_mesh("cpu", (8,)), ("S0",), ("S1",)),
        "2d (R,S0)->(R,S1)": (mesh2, ("R", "S0"), ("R", "S1")),
        "2d (S1,R)->(S0,R)": (mesh2, ("S1", "R"), ("S0", "R")),
        "2d (S0,S1)->(S1,S0)": (mesh2, ("S0", "S1"), ("S1", "S0")),
        "3d (S0,S1,S2)->(S0,S1,S0)": (mesh3, ("S0", "S1", "S2"), ("S0", "S1", "S0")),
    }
    full = _full((8, 8, 8))
    for name, (mesh, src_codes, dst_codes) in cases.items():
        src = tuple(_placement(c) for c in src_codes)
        dst = tuple(_placement(c) for c in dst_codes)
        t = full if mesh.ndim == 3 else full[0]
        local = _local(t, src, tuple(mesh.shape), mesh.get_coordinate())
        x = DTensor.from_local(local.requires_grad_(), mesh, src, shape=t.shape, stride=t.stride())
        with CommDebugMode() as fast:
            y = redistribute(x, mesh, dst)
        with CommDebugMode() as plain:
            z = x.redistribute(mesh, dst)
        weight = _full(tuple(t.shape)) % 7
        w = DTensor.from_local(_local(weight, dst, tuple(mesh.shape), mesh.get_coordinate()),
                               mesh, dst, shape=t.shape, stride=t.stride())
        (y * w).sum().backward()
        grad = local.grad  # the leaf: this rank's part of d(sum(y * w))/dx = w
        counts[name] = {
            "fast": {str(k).split(".")[-1]: v for k, v in fast.get_comm_counts().items()},
            "plain": {str(k).split(".")[-1]: v for k, v in plain.get_comm_counts().items()},
            "equal": torch.equal(y.to_local(), z.to_local())
            and torch.equal(y.to_local(), _local(t, dst, tuple(mesh.shape), mesh.get_coordinate())),
            "grad": torch.equal(grad, _local(weight, src, tuple(mesh.shape), mesh.get_coordinate())),
        }
    return counts


def test_shard_to_shard_fast_path_uses_all_to_all(world: World) -> None:
    results = world.run(_all_to_all_fast_path)
    assert all(r == results[0] for r in results)
    got = results[0]
    for name, case in got.items():
        assert case["equal"] and case["grad"], (name, case)
        # DTensor itself all-gathers the whole dim (the mesh's device type is "cpu")
        assert case["plain"].get("all_gather_into_tensor", 0) >= 1, (name, case)
    assert got["1d S0->S1"]["fast"] == {"all_to_all_single": 1}
    assert got["2d (R,S0)->(R,S1)"]["fast"] == {"all_to_all_single": 1}
    assert got["2d (S1,R)->(S0,R)"]["fast"] == {"all_to_all_single": 1}
    assert got["3d (S0,S1,S2)->(S0,S1,S0)"]["fast"] == {"all_to_all_single": 1}
    # swapping two axes: the tp step is an all-to-all, the dp step is left to DTensor
    assert got["2d (S0,S1)->(S1,S0)"]["fast"].get("all_to_all_single") == 1


# -- distribute_tensor, full_tensor, ops -------------------------------------------------------


def _distribute_and_ops(rank: int, world_size: int) -> list[str]:
    import torch.nn.functional as F

    problems = []
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    sizes, coord = tuple(mesh.shape), mesh.get_coordinate()
    full = _full((8, 12))
    # distribute_tensor takes rank 0's data (src_data_rank=0): others pass something else
    mine = full if rank == 0 else full + 1000 * rank
    for codes in itertools.product(["S0", "S1", "R"], repeat=2):
        placements = tuple(_placement(c) for c in codes)
        x = distribute_tensor(mine, mesh, placements)
        if not torch.equal(x.to_local(), _local(full, placements, sizes, coord)):
            problems.append(f"distribute_tensor {codes}: wrong local shard")
        if not torch.equal(x.full_tensor(), full):
            problems.append(f"full_tensor {codes}: wrong")
    # matmul over every combination of these layouts; integer values: results are exact
    a_full, b_full = _full((8, 12)), _full((12, 16)) % 5
    layouts = [(("S0", "R"), ("R", "R")), (("R", "S1"), ("R", "S0")), (("S0", "S1"), ("R", "S0")),
               (("R", "R"), ("R", "S1")), (("S1", "S0"), ("S0", "S1")), (("S0", "S0"), ("R", "R")),
               (("R", "S1"), ("S0", "S1"))]
    for a_codes, b_codes in layouts:
        a = distribute_tensor(a_full, mesh, [_placement(c) for c in a_codes])
        b = distribute_tensor(b_full, mesh, [_placement(c) for c in b_codes])
        c = a @ b
        if not torch.equal(c.full_tensor(), a_full @ b_full):
            problems.append(f"matmul {a_codes} @ {b_codes} -> {c.placements}: wrong")
    # the ops of a transformer block on a (batch, seq, dim) activation, dim sharded on tp
    g = torch.Generator().manual_seed(5)
    h_full = torch.randn(2, 8, 16, generator=g)
    w_full = torch.randn(16, 16, generator=g)
    h = distribute_tensor(h_full, mesh, [Shard(0), Shard(2)])
    w = distribute_tensor(w_full, mesh, [Replicate(), Shard(0)])
    rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    q = rms @ w  # contraction over the tp-sharded dim: Partial, reduced when needed
    scores = (q @ q.transpose(-2, -1)) / 4.0
    causal = torch.triu(torch.full((8, 8), float("-inf")), 1)
    probs = F.softmax(scores + DTensor.from_local(causal, mesh, [Replicate(), Replicate()]), dim=-1)
    out = F.silu(probs @ q) * torch.sigmoid(q)
    loss = out.sum() / out.numel()
    ref_rms = h_full * torch.rsqrt(h_full.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref_q = ref_rms @ w_full
    ref_probs = F.softmax((ref_q @ ref_q.transpose(-2, -1)) / 4.0 + causal, dim=-1)
    ref_out = F.silu(ref_probs @ ref_q) * torch.sigmoid(ref_q)
    if not torch.allclose(out.full_tensor(), ref_out, rtol=1e-5, atol=1e-5):
        problems.append(f"transformer ops: max error {(out.full_tensor() - ref_out).abs().max()}")
    if not torch.allclose(loss.full_tensor(), ref_out.mean(), rtol=1e-5, atol=1e-6):
        problems.append("transformer ops: wrong mean")
    return problems


def test_distribute_tensor_full_tensor_matmul_and_transformer_ops(world: World) -> None:
    assert world.run(_distribute_and_ops) == [[]] * WORLD_SIZE


# -- DTensor <-> jax.Array --------------------------------------------------------------------


def _jax_interop(rank: int, world_size: int) -> list[str]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tpu_dist.dtensor_ext import from_jax, to_jax
    from tpu_dist.mesh import mesh_to_jax

    problems = []
    mesh2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    mesh3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("x", "y", "z"))
    full = _full((8, 16))
    cases = [
        (mesh2, (Shard(0), Shard(1)), P("dp", "tp")),
        (mesh2, (Shard(1), Shard(0)), P("tp", "dp")),
        (mesh2, (Shard(0), Shard(0)), P(("dp", "tp"), None)),
        (mesh2, (Replicate(), Shard(1)), P(None, "tp")),
        (mesh2, (Replicate(), Replicate()), P(None, None)),
        (mesh2, (_StridedShard(0, split_factor=4), Shard(0)), P(("tp", "dp"), None)),
        (mesh3, (Shard(1), Shard(0), Shard(1)), P("y", ("x", "z"))),
        (mesh3, (Replicate(), Shard(1), Replicate()), P(None, "y")),
    ]
    for mesh, placements, spec in cases:
        sizes, coord = tuple(mesh.shape), mesh.get_coordinate()
        local = _local(full, placements, sizes, coord)
        x = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
        arr = to_jax(x)
        name = f"{placements} on {sizes}"
        if arr.shape != tuple(full.shape) or arr.sharding.spec != spec:
            problems.append(f"{name}: got {arr.shape} {arr.sharding.spec}")
        if arr.sharding.mesh != mesh_to_jax(mesh):
            problems.append(f"{name}: array mesh differs from mesh_to_jax")
        shard = arr.addressable_shards[0]
        if shard.data.unsafe_buffer_pointer() != local.data_ptr():
            problems.append(f"{name}: the local shard was copied")
        # JAX's own account of which part of the global array this device holds
        if not torch.equal(full[shard.index], local):
            problems.append(f"{name}: jax says this shard is {shard.index}")
        back = from_jax(arr, mesh)
        if back.placements != placements or back.to_local().data_ptr() != local.data_ptr():
            problems.append(f"{name}: from_jax gave {back.placements}, or copied")
        if len(placements) == 3 or placements[1] == Shard(0):
            # a jitted function on the global array; the result comes back as a DTensor
            y = jax.jit(lambda a: jnp.tanh(a / 50) * 2 + a.sum(axis=1, keepdims=True))(arr)
            got = from_jax(y, mesh).full_tensor()
            want = torch.tanh(full / 50) * 2 + full.sum(1, keepdim=True)
            if not torch.allclose(got, want, rtol=1e-6, atol=1e-5):
                problems.append(f"{name}: jitted result differs by {(got - want).abs().max()}")
    # out_shardings decide the layout that comes back
    jmesh = mesh_to_jax(mesh2)
    x = distribute_tensor(full, mesh2, [Shard(0), Replicate()])
    y = jax.jit(lambda a: a.T @ a, out_shardings=NamedSharding(jmesh, P(None, ("dp", "tp"))))(to_jax(x))
    back = from_jax(y, mesh2)
    if back.placements != (Shard(1), Shard(1)) or not torch.equal(back.full_tensor(), full.T @ full):
        problems.append(f"out_shardings: {back.placements}")
    # the same devices under other axis names: read by position
    renamed = Mesh(jmesh.devices, ("rows", "cols"))
    z = jax.device_put(to_jax(x), NamedSharding(renamed, P("rows")))
    if from_jax(z, mesh2).placements != (Shard(0), Replicate()):
        problems.append("renamed axes were not read by position")
    transposed = Mesh(jmesh.devices.T, ("tp", "dp"))
    try:
        from_jax(jax.device_put(to_jax(x), NamedSharding(transposed, P("dp"))), mesh2)
        problems.append("an array on another device layout was accepted")
    except ValueError as err:
        if "reshard" not in str(err):
            problems.append(f"layout error message: {err}")
    # dtypes: 64-bit stays 64-bit (the user's jax_enable_x64 is off), bf16 zero-copy
    for dtype in (torch.bfloat16, torch.int64, torch.float64, torch.int32, torch.bool):
        t = (full % 3).to(dtype)
        x = distribute_tensor(t, mesh2, [Shard(0), Shard(1)])
        arr = to_jax(x)
        back = from_jax(arr, mesh2)
        if str(arr.dtype) != str(t.dtype).split(".")[-1] or back.dtype != dtype:
            problems.append(f"{dtype}: became {arr.dtype} / {back.dtype}")
        if not torch.equal(back.full_tensor(), t):
            problems.append(f"{dtype}: values changed")
        if back.to_local().data_ptr() != x.to_local().data_ptr():
            problems.append(f"{dtype}: copied")
    if jax.config.jax_enable_x64:
        problems.append("to_jax changed the user's jax_enable_x64")
    # copy=True gives the DTensor its own memory
    x = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
    if from_jax(to_jax(x), mesh2, copy=True).to_local().data_ptr() == x.to_local().data_ptr():
        problems.append("copy=True did not copy")
    # Partial: a clear error, or an all-reduce when asked
    p = DTensor.from_local(_local(full, (Partial(), Shard(1)), (2, 4), mesh2.get_coordinate()),
                           mesh2, (Partial(), Shard(1)), shape=full.shape, stride=full.stride())
    try:
        to_jax(p)
        problems.append("Partial was accepted")
    except ValueError as err:
        if "reduce_partial=True" not in str(err):
            problems.append(f"Partial message: {err}")
    arr = to_jax(p, reduce_partial=True)
    shard = arr.addressable_shards[0]
    if arr.sharding.spec != P(None, "tp") or not torch.equal(
        torch.from_dlpack(shard.data), full[shard.index]
    ):
        problems.append("reduce_partial=True gave the wrong array")
    # uneven sharding has no NamedSharding
    try:
        to_jax(distribute_tensor(_full((6, 10)), mesh2, [Replicate(), Shard(1)]))
        problems.append("uneven sharding was accepted")
    except ValueError as err:
        if "unevenly" not in str(err) and "pad" not in str(err):
            problems.append(f"uneven message: {err}")
    return problems


def test_to_jax_from_jax(world: World) -> None:
    assert world.run(_jax_interop) == [[]] * WORLD_SIZE


def _fsdp_tp_param_to_jax(rank: int, world_size: int) -> list[str]:
    """A real FSDP2-over-TP parameter (placements with _StridedShard) as a jax.Array."""
    import torch.nn as nn
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tpu_dist.dtensor_ext import to_jax

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False))
    want = model[0].weight.detach().clone()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    weight = model[0].weight
    arr = to_jax(weight)
    problems = []
    if arr.sharding.spec != P(("tp", "dp"), None):
        problems.append(f"placements {weight.placements} gave {arr.sharding.spec}")
    # the whole array, gathered by JAX (an XLA program of its own), is the parameter
    gathered = torch.from_numpy(multihost_utils.process_allgather(arr, tiled=True).copy())
    if not torch.equal(gathered, want) or not torch.equal(weight.full_tensor(), want):
        problems.append("the array is not the parameter")
    return problems


def test_fsdp_over_tp_parameter_to_jax(world: World) -> None:
    assert world.run(_fsdp_tp_param_to_jax) == [[]] * WORLD_SIZE


# -- tpu_dist.mesh.init_device_mesh on 8 ranks -------------------------------------------------


def _planned_meshes_8(rank: int, world_size: int) -> dict:
    """tpu_dist's topology-aware meshes on 8 ranks: layout, JAX agreement, DTensor on them.

    The 2-D and the two-slice meshes list each tp group in ring order ([0, 2, 3, 1]), not
    sorted: the redistribution [Shard(0), Shard(1)] -> [Replicate(), Shard(0)] returns wrong
    values there unless the axis groups keep that order (torch's DeviceMesh sorts them).
    """
    import os

    import torch.distributed as dist

    from torch.distributed.tensor import Replicate, Shard

    from tpu_dist.collectives import global_devices
    from tpu_dist.mesh import current_topology, init_device_mesh, mesh_to_jax, plan_mesh

    def layout(mesh) -> dict:
        devices = global_devices()
        jax_ids = [devices.index(d) for d in mesh_to_jax(mesh).devices.flat]
        # DTensor takes a rank's coordinate on an axis as its rank in the axis's group.
        groups_agree = all(
            dist.get_process_group_ranks(mesh.get_group(name)) == mesh[name].mesh.tolist()
            for name in mesh.mesh_dim_names
        )
        return {
            "mesh": mesh.mesh.tolist(),
            "jax_agrees": jax_ids == mesh.mesh.flatten().tolist(),
            "groups_agree": groups_agree,
        }

    def dtensor_problems(mesh, placements, shape) -> list[str]:
        full = _full(shape)
        dt = distribute_tensor(full, mesh, placements)
        problems = []
        if not torch.equal(dt.full_tensor(), full):
            problems.append(f"{placements}: full_tensor differs")
        flipped = dt.redistribute(mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)])
        if not torch.equal(flipped.full_tensor(), full):
            problems.append(f"{placements} -> (R.., S(0)): wrong values")
        column_sharded = [Replicate()] * (mesh.ndim - 1) + [Shard(1)]
        w = distribute_tensor(full.T.contiguous(), mesh, column_sharded)
        if not torch.equal((dt @ w).full_tensor(), full @ full.T):
            problems.append(f"{placements}: matmul differs")
        return problems

    # Default topology for 8 ranks: v5p 2x2x2 (two hosts of 2x2 chips), one slice.
    topo = current_topology()
    two_d = init_device_mesh((2, 4), mesh_dim_names=("dp", "tp"))
    three_d = init_device_mesh((2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    problems = []
    if two_d.mesh.tolist() != plan_mesh(topo, (2, 4)).tolist():
        problems.append("2-D mesh is not the plan")
    if three_d.mesh.tolist() != plan_mesh(topo, (2, 2, 2)).tolist():
        problems.append("3-D mesh is not the plan")
    problems += dtensor_problems(two_d, [Shard(0), Shard(1)], (8, 8))
    problems += dtensor_problems(three_d, [Shard(0), Replicate(), Shard(1)], (8, 8))

    # Two emulated v5p slices of 2x2x1 joined by DCN: tp inside a slice, dp across.
    os.environ.update({"TPU_DIST_TOPOLOGY": "v5p:2x2x1", "TPU_DIST_NUM_SLICES": "2"})
    try:
        sliced_topo = current_topology()
        sliced = init_device_mesh((1, 4), mesh_dim_names=("dp", "tp"), dcn_mesh_shape=(2, 1))
    finally:
        del os.environ["TPU_DIST_TOPOLOGY"], os.environ["TPU_DIST_NUM_SLICES"]
    if sliced.mesh.tolist() != plan_mesh(sliced_topo, (1, 4), (2, 1)).tolist():
        problems.append("2-slice mesh is not the plan")
    problems += dtensor_problems(sliced, [Shard(1), Shard(0)], (8, 4))
    return {
        "topology": (topo.generation.name, topo.shape, topo.num_slices),
        "two_d": layout(two_d),
        "three_d": layout(three_d),
        "sliced": layout(sliced),
        "slice_of_tp_group": sorted({sliced_topo.chips[r].slice_index
                                     for r in sliced["tp"].mesh.tolist()}),
        "problems": problems,
    }


def test_planned_meshes_on_8_ranks(world: World) -> None:
    results = world.run(_planned_meshes_8)
    assert all(r["problems"] == [] for r in results), [r["problems"] for r in results]
    same = [{k: v for k, v in r.items() if k != "slice_of_tp_group"} for r in results]
    assert all(r == same[0] for r in same), "ranks disagree on a mesh"
    first = results[0]
    assert first["topology"] == ("v5p", (2, 2, 2), 1)
    # Layouts checked by hand (tpu_dist.mesh.init_device_mesh's docstring draws the 2-D one):
    # each tp group is a ring over one host's 2x2 chips (0,0) (0,1) (1,1) (1,0); dp pairs the
    # two hosts along z.
    assert first["two_d"]["mesh"] == [[0, 2, 3, 1], [4, 6, 7, 5]]
    # 3-D: tp pairs x-neighbours, fsdp y-neighbours, dp the two hosts along z.
    assert first["three_d"]["mesh"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # Two slices: a row is one slice (ranks are slice-major), the same ring inside each, so
    # every tp group stays in its slice and dp crosses DCN.
    assert first["sliced"]["mesh"] == [[0, 2, 3, 1], [4, 6, 7, 5]]
    assert [r["slice_of_tp_group"] for r in results] == [[0]] * 4 + [[1]] * 4
    for r in results:
        for name in ("two_d", "three_d", "sliced"):
            assert r[name]["jax_agrees"] and r[name]["groups_agree"], (name, r[name])
