"""init_device_mesh, mesh_to_jax and DTensor on the planned mesh, on 4 "tpu" ranks.

One world of 4 ranks on the "tpu" backend (starting a world costs tens of seconds on a
2-core machine); the 8-rank case (two emulated v5p-8 slices) is left to the examples.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.harness import World


def _two_d_mesh_and_dtensor(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tpu_dist.mesh import current_topology, init_device_mesh, plan_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    expected = plan_mesh(current_topology(), (2, 2))
    assert mesh.mesh.tolist() == expected.tolist()

    # Each axis's process group holds exactly the ranks of this rank's group on that axis.
    tp = torch.tensor([float(rank)])
    dist.all_reduce(tp, group=mesh.get_group("tp"))
    dp = torch.tensor([float(rank)])
    dist.all_reduce(dp, group=mesh.get_group("dp"))

    full = torch.arange(32.0).reshape(4, 8)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    i, j = mesh.get_coordinate()
    assert torch.equal(dt.to_local(), full.chunk(2, 0)[i].chunk(2, 1)[j])
    assert torch.equal(dt.full_tensor(), full)
    moved = dt.redistribute(mesh, [Replicate(), Shard(0)])
    assert torch.equal(moved.to_local(), full.chunk(2, 0)[j])
    # A tensor-parallel matmul: x replicated, w sharded by columns over tp.
    x = distribute_tensor(torch.ones(3, 4), mesh, [Replicate(), Replicate()])
    w = distribute_tensor(full, mesh, [Replicate(), Shard(1)])
    y = (x @ w).full_tensor()
    assert torch.equal(y, torch.ones(3, 4) @ full)

    # The same layout as a JAX mesh over the backend's devices (rank r owns device r).
    from tpu_dist.collectives import global_devices
    from tpu_dist.mesh import mesh_to_jax

    devices = global_devices()
    jax_mesh = mesh_to_jax(mesh)
    ids = [[devices.index(d) for d in row] for row in jax_mesh.devices]
    sub = mesh_to_jax(mesh["tp"])
    sub_ids = [devices.index(d) for d in sub.devices.flat]
    return {
        "mesh": mesh.mesh.tolist(),
        "coordinate": list(mesh.get_coordinate()),
        "tp_sum": tp.item(),
        "dp_sum": dp.item(),
        "jax_ids": ids,
        "jax_axes": jax_mesh.axis_names,
        "jax_sub": (sub_ids, sub.axis_names),
    }


def _three_d_mesh_over_slices(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tpu_dist.mesh import current_topology, init_device_mesh, plan_mesh

    # Emulate 4 single-chip v5e slices joined by DCN (what tpu-launch --emulate would set).
    os.environ.update({"TPU_DIST_TOPOLOGY": "v5litepod-1", "TPU_DIST_NUM_SLICES": "4"})
    try:
        topo = current_topology()
        mesh = init_device_mesh((2, 1, 2), mesh_dim_names=("dp", "fsdp", "tp"))
        assert mesh.mesh.tolist() == plan_mesh(topo, (2, 1, 2)).tolist()
    finally:
        del os.environ["TPU_DIST_TOPOLOGY"], os.environ["TPU_DIST_NUM_SLICES"]

    full = torch.arange(16.0).reshape(4, 4)
    dt = distribute_tensor(full, mesh, [Shard(0), Replicate(), Shard(1)])
    a, _, c = mesh.get_coordinate()
    assert torch.equal(dt.to_local(), full.chunk(2, 0)[a].chunk(2, 1)[c])
    assert torch.equal(dt.full_tensor(), full)
    return {"num_slices": topo.num_slices, "mesh": mesh.mesh.tolist()}


TPU4 = pytest.param({"world_size": 4, "backend": "tpu"}, id="tpu4")


@pytest.mark.parametrize("world", [TPU4], indirect=True)
def test_init_device_mesh_2d(world: World) -> None:
    results = world.run(_two_d_mesh_and_dtensor, timeout=180)
    # Default topology for 4 ranks: v5p 2x2x1 (one host); ranks 0 1 2 3 at (0,0) (1,0) (0,1)
    # (1,1). The 2-way tp axis takes x: tp groups [0, 1] and [2, 3]; dp takes y: [0, 2], [1, 3].
    assert [r["mesh"] for r in results] == [[[0, 1], [2, 3]]] * 4
    assert [r["coordinate"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [r["tp_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["dp_sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    # The JAX mesh agrees rank for rank (device index = rank), with the same axis names.
    assert all(r["jax_ids"] == [[0, 1], [2, 3]] for r in results)
    assert all(r["jax_axes"] == ("dp", "tp") for r in results)
    assert [r["jax_sub"] for r in results] == [([0, 1], ("tp",))] * 2 + [([2, 3], ("tp",))] * 2


@pytest.mark.parametrize("world", [TPU4], indirect=True)
def test_init_device_mesh_3d_over_emulated_slices(world: World) -> None:
    results = world.run(_three_d_mesh_over_slices, timeout=180)
    # 4 slices of one chip: the slices split off the outer axes, dcn (2, 1, 2) x ici (1, 1, 1);
    # slice s is rank s, at block unravel(s, (2, 1, 2)).
    assert all(r["num_slices"] == 4 for r in results)
    assert [r["mesh"] for r in results] == [[[[0, 1]], [[2, 3]]]] * 4


def test_init_device_mesh_needs_a_process_group() -> None:
    from tpu_dist.mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a default process group exists in this test process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        init_device_mesh((2, 2))
