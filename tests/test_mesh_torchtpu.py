"""tpu_dist's topology-aware layout for TorchTPU users, on libtpu's compile-only TPU devices.

A TorchTPU job has one rank per TPU device; ``Topology.from_devices`` of the rank-ordered devices
and ``plan_mesh`` give the layout for ``DeviceMesh("tpu", ranks)``. TorchTPU's own
``topology_aware_mesh`` (read from torch-tpu 0.2.0's ``_internal/distributed/device_mesh.py``,
not run: it needs a TPU) is JAX's ``mesh_utils.create_device_mesh`` over the devices in id order
(its ``device_utils`` is a copy of JAX's ``mesh_utils``), mapped back to ranks; JAX's is used as
the stand-in here. The ICI hop counts are computed from the devices' coordinates, independently
of both.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("libtpu")
# Compile-only devices do not use the TPU, but libtpu still takes /tmp/libtpu_lockfile unless told.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from jax.experimental import mesh_utils, topologies  # noqa: E402

from tpu_dist.mesh import Topology, plan_mesh  # noqa: E402


def _devices(name: str) -> list:
    kwargs = {"chip_config_name": "megacore"} if name.startswith("v4") else {}
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices)


def _layouts(name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, list]:
    devices = _devices(name)  # rank r drives devices[r]
    ours = plan_mesh(Topology.from_devices(devices), shape)
    rank_of = {d.id: r for r, d in enumerate(devices)}
    arranged = mesh_utils.create_device_mesh(shape, devices=sorted(devices, key=lambda d: d.id))
    theirs = np.vectorize(lambda d: rank_of[d.id])(arranged)
    return ours, theirs, devices


def _groups(mesh: np.ndarray, axis: int) -> set[frozenset[int]]:
    return {frozenset(g) for g in np.moveaxis(mesh, axis, -1).reshape(-1, mesh.shape[axis]).tolist()}


def _hops(a, b, dims: tuple[int, ...]) -> int:
    """ICI hops between two chips of a torus with wraparound (from the devices' coordinates)."""
    return sum(min(abs(x - y), n - abs(x - y)) for x, y, n in zip(a.coords, b.coords, dims))


@pytest.mark.parametrize(("name", "shape"), [
    ("v4:2x2x2", (2, 4)), ("v4:2x2x2", (2, 2, 2)), ("v4:4x4x4", (4, 16)),
    ("v4:4x4x4", (16, 4)), ("v6e:4x4", (4, 4)),
])
def test_whole_axis_layouts_have_torchtpus_groups(name: str, shape: tuple[int, ...]) -> None:
    ours, theirs, _ = _layouts(name, shape)
    assert sorted(ours.reshape(-1).tolist()) == list(range(ours.size))
    for axis in range(len(shape)):
        assert _groups(ours, axis) == _groups(theirs, axis), (name, shape, axis)


def test_ring_order_on_a_2x2x2_torus() -> None:
    # One axis over all 8 chips of a 2x2x2 torus: both layouts hold every rank, but only
    # tpu_dist's visits them as a ring of one-hop steps (the order torch keeps with
    # DeviceMesh.from_group over new_group(ranks, sort_ranks=False)).
    ours, theirs, devices = _layouts("v4:2x2x2", (8,))
    assert sorted(ours.tolist()) == sorted(theirs.tolist()) == list(range(8))

    def ring_hops(order: list[int]) -> list[int]:
        return [_hops(devices[a], devices[b], (2, 2, 2))
                for a, b in zip(order, order[1:] + order[:1])]

    assert ring_hops(ours.tolist()) == [1] * 8
    assert max(ring_hops(theirs.tolist())) > 1
