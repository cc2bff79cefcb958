"""Pure-logic tests of tpu_dist.mesh's topology model: generations, shapes, hosts, rank order."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tpu_dist.mesh import Topology, current_topology, generations, get_generation
from tpu_dist.mesh._device_mesh import topology_from_env

# (accelerator type, generation, per-slice grid, chips, devices per chip, hosts)
ACCELERATOR_TYPES = [
    ("v4-8", "v4", (2, 2, 1), 4, 1, 1),
    ("v4-128", "v4", (4, 4, 4), 64, 1, 16),
    ("v4-4096", "v4", (8, 16, 16), 2048, 1, 512),
    ("v5litepod-1", "v5e", (1, 1), 1, 1, 1),
    ("v5litepod-16", "v5e", (4, 4), 16, 1, 4),  # 2x2 hosts (ct5lp-hightpu-4t)
    ("v5litepod-8", "v5e", (2, 4), 8, 1, 1),  # one 2x4 host (ct5lp-hightpu-8t)
    ("v5e-256", "v5e", (16, 16), 256, 1, 64),
    ("v5p-8", "v5p", (2, 2, 1), 4, 1, 1),
    ("v5p-32", "v5p", (2, 2, 4), 16, 1, 4),
    ("v5p-128", "v5p", (4, 4, 4), 64, 1, 16),
    ("v5p-256", "v5p", (4, 4, 8), 128, 1, 32),
    ("v5p-12288", "v5p", (16, 16, 24), 6144, 1, 1536),
    ("v6e-8", "v6e", (2, 4), 8, 1, 1),
    ("v6e-64", "v6e", (8, 8), 64, 1, 16),
    ("tpu7x-8", "v7x", (2, 2, 1), 4, 2, 1),
    ("tpu7x-128", "v7x", (4, 4, 4), 64, 2, 16),
]


@pytest.mark.parametrize(
    ("accelerator_type", "gen", "shape", "chips", "per_chip", "hosts"), ACCELERATOR_TYPES
)
def test_from_accelerator_type(
    accelerator_type: str, gen: str, shape: tuple[int, ...], chips: int, per_chip: int, hosts: int
) -> None:
    topo = Topology.from_accelerator_type(accelerator_type)
    assert topo.generation.name == gen
    assert topo.shape == shape
    assert (topo.num_chips, topo.devices_per_chip, topo.num_hosts) == (chips, per_chip, hosts)
    assert topo.num_devices == len(topo.chips) == chips * per_chip
    # The canonical accelerator type round-trips (v5e-256 is written v5litepod-256).
    assert Topology.from_accelerator_type(topo.accelerator_type) == topo
    assert Topology.parse(topo.spec) == topo


def test_create_multislice_and_aliases() -> None:
    topo = Topology.create("v5p", "16x16x24", num_slices=2)
    assert (topo.num_chips, topo.shape, topo.num_slices) == (12288, (16, 16, 24), 2)
    assert topo.num_hosts == 3072 and topo.hosts_per_slice == 1536
    assert Topology.from_accelerator_type("v5litepod-16", num_slices=2) == Topology.create(
        "v5e", (4, 4), 2
    )
    assert Topology.from_accelerator_type("v5e-16") == Topology.create("v5litepod", "4x4")
    assert get_generation("TPU7X") is get_generation("ironwood") is get_generation("v7x")
    assert set(generations()) == {"v4", "v5e", "v5p", "v6e", "v7x"}


@pytest.mark.parametrize("accelerator_type", [a[0] for a in ACCELERATOR_TYPES])
def test_rank_order_slice_host_local(accelerator_type: str) -> None:
    """Ranks run slice-major, then host, then local index; every device of the grid once."""
    topo = Topology.from_accelerator_type(accelerator_type, num_slices=2)
    chips = topo.chips
    keys = [(c.slice_index, c.host, c.local_index) for c in chips]
    assert keys == sorted(keys)
    assert [c.rank for c in chips] == list(range(topo.num_devices))
    per_host = topo.devices_per_slice // topo.hosts_per_slice
    assert all(c.local_index == c.rank % per_host for c in chips)
    assert all(c.host == c.rank // per_host for c in chips)
    seen = {(c.slice_index, c.coords, c.core) for c in chips}
    assert len(seen) == topo.num_devices
    assert all(all(0 <= x < s for x, s in zip(c.coords, topo.shape)) for c in chips)
    assert all(len(c.coords) == topo.generation.torus_ndim for c in chips)
    grid = topo.rank_grid()
    for c in chips[:: max(1, len(chips) // 97)]:
        assert grid[(c.slice_index, *c.coords, c.core)] == c.rank


@pytest.mark.parametrize("accelerator_type", ["v5p-128", "v5litepod-16", "v6e-256", "tpu7x-16"])
def test_hosts_are_contiguous_blocks(accelerator_type: str) -> None:
    topo = Topology.from_accelerator_type(accelerator_type)
    gen = topo.generation
    for host in range(topo.num_hosts):
        mine = [c for c in topo.chips if c.host == host]
        coords = np.array([c.coords for c in mine])
        span = tuple(int(v) for v in coords.max(axis=0) - coords.min(axis=0) + 1)
        assert span == gen.host_block(topo.shape)
        assert len(mine) == gen.chips_per_host * gen.devices_per_chip


def test_hand_checked_rank_layouts() -> None:
    # v5p-16 (2x2x2): two hosts, one per z plane; in a host, x fastest, then y.
    topo = Topology.from_accelerator_type("v5p-16")
    assert [c.coords for c in topo.chips] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0),  # host 0
        (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1),  # host 1
    ]
    # v5e 4x4: four hosts of 2x2 chips (x fastest over host blocks), host 1 holds x = 2, 3 of
    # y = 0, 1 (libtpu lays it out so; tests/test_libtpu_topology.py compares every device).
    topo = Topology.create("v5e", "4x4")
    assert [c.coords for c in topo.chips[2:8]] == [(0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert [c.host for c in topo.chips[2:8]] == [0, 0, 1, 1, 1, 1]
    # v5e 2x4 (v5litepod-8): one host of 8 chips, x fastest.
    topo = Topology.create("v5e", "2x4")
    assert topo.num_hosts == 1
    assert [c.coords for c in topo.chips[:4]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # v7x: two devices (cores) per chip, the core fastest.
    topo = Topology.from_accelerator_type("tpu7x-8")
    assert [(c.coords, c.core) for c in topo.chips[:4]] == [
        ((0, 0, 0), 0), ((0, 0, 0), 1), ((1, 0, 0), 0), ((1, 0, 0), 1)
    ]


@pytest.mark.parametrize(
    ("spec", "wrap"),
    [
        ("v5p:2x4x4", (False, False, False)),  # less than a cube: a 3-D mesh
        ("v5p:4x4x4", (True, True, True)),  # whole cubes: a full 3-D torus
        ("v4:4x8x8", (True, True, True)),
        ("v7x:2x2x2", (False, False, False)),
        ("v5e:4x4", (False, False)),
        ("v5e:8x16", (False, True)),  # spans the pod's 16-chip side along y only
        ("v6e:16x16", (True, True)),
    ],
)
def test_wraparound(spec: str, wrap: tuple[bool, ...]) -> None:
    assert Topology.parse(spec).wraparound == wrap


def test_ici_hops() -> None:
    topo = Topology.create("v5p", "4x4x4", num_slices=2)
    grid = topo.rank_grid()
    a, b, c = grid[0, 0, 0, 0, 0], grid[0, 3, 0, 0, 0], grid[0, 2, 2, 1, 0]
    assert topo.ici_hops(a, b) == 1  # wraparound
    assert topo.ici_hops(a, c) == 5
    assert topo.ici_hops(a, grid[1, 0, 0, 0, 0]) == -1  # another slice: DCN
    mesh = Topology.create("v5p", "2x4x4")
    g = mesh.rank_grid()
    assert mesh.ici_hops(g[0, 0, 0, 0, 0], g[0, 0, 3, 0, 0]) == 3  # no wraparound
    v7 = Topology.from_accelerator_type("tpu7x-8")
    assert v7.ici_hops(0, 1) == 0  # two cores of one chip


def test_shape_rules_per_generation() -> None:
    v5p = get_generation("v5p")
    assert v5p.shapes_with_chips(64) == [(4, 4, 4)]
    assert v5p.shapes_with_chips(128) == [(4, 4, 8)]
    assert v5p.default_shape(6144) == (16, 16, 24)
    assert v5p.is_valid_shape((12, 12, 24)) and not v5p.is_valid_shape((8, 4, 4))
    assert not v5p.is_valid_shape((16, 16, 28))  # 7168 chips: more than the largest slice
    v5e = get_generation("v5e")
    assert v5e.is_valid_shape((8, 16)) and not v5e.is_valid_shape((16, 8))
    assert v5e.shapes_with_chips(32) == [(4, 8)]


@pytest.mark.parametrize(
    ("call", "fragments"),
    [
        (lambda: Topology.create("v3", "4x4"), ["unknown TPU generation 'v3'", "v5p", "tpu7x"]),
        (
            lambda: Topology.create("v5p", "3x4x4"),
            ["3x4x4 is not a v5p slice shape", "no v5p slice has 48 chips", "multiple of 4"],
        ),
        (lambda: Topology.create("v5p", "4x4x2"), ["32-chip v5p slices: 2x4x4"]),
        (lambda: Topology.create("v5p", "8x4x4"), ["128-chip v5p slices: 4x4x8", "A<=B<=C"]),
        (lambda: Topology.create("v5e", "4x4x4"), ["2-D grid", "1x1, 2x2, 2x4"]),
        (lambda: Topology.create("v5p", "4by4"), ["expected a chip grid like '4x4x4'"]),
        (lambda: Topology.create("v5p", "4x4x4", num_slices=0), ["num_slices=0"]),
        (lambda: Topology.from_accelerator_type("v5p-96"), ["48 chips", "v5p-128"]),
        (lambda: Topology.from_accelerator_type("v5p-7"), ["multiple of 2", "v5p-8"]),
        (lambda: Topology.from_accelerator_type("v5p"), ["like 'v5p-128'"]),
        (lambda: Topology.from_accelerator_type("v6e-12"), ["no v6e slice has 12 chips"]),
    ],
)
def test_errors_say_what_is_supported(call, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("world_size", "expected"),
    [
        (1, ("v5e", (1, 1), 1)),
        (2, ("v5e", (1, 1), 2)),
        (4, ("v5p", (2, 2, 1), 1)),
        (8, ("v5p", (2, 2, 2), 1)),
        (12, ("v5p", (2, 2, 1), 3)),
        (16, ("v5p", (2, 2, 4), 1)),
        (64, ("v5p", (4, 4, 4), 1)),
    ],
)
def test_for_world_size(world_size: int, expected: tuple) -> None:
    topo = Topology.for_world_size(world_size)
    assert (topo.generation.name, topo.shape, topo.num_slices) == expected
    assert topo.num_devices == world_size


# -- real TPU devices (mocked as jax's tests mock them) -------------------------------------------


@dataclasses.dataclass(frozen=True)
class MockTpuDevice:
    id: int
    coords: tuple[int, int, int]
    core_on_chip: int
    slice_index: int
    process_index: int
    device_kind: str
    platform: str = "tpu"


def _mock_devices(topo: Topology) -> list[MockTpuDevice]:
    """What jax.devices() would list for ``topo``, in rank order (2-D coords padded with z=0)."""
    return [
        MockTpuDevice(
            id=c.rank,
            coords=c.coords + (0,) * (3 - len(c.coords)),
            core_on_chip=c.core,
            slice_index=c.slice_index,
            process_index=c.host,
            device_kind=topo.generation.device_kind,
        )
        for c in topo.chips
    ]


@pytest.mark.parametrize("spec", ["v5p:4x4x4", "v5e:4x8", "v7x:2x2x2", "v6e:2x4"])
def test_from_devices_matches_canonical(spec: str) -> None:
    topo = Topology.parse(spec, num_slices=2)
    assert Topology.from_devices(_mock_devices(topo)) == topo


def test_from_devices_any_rank_order() -> None:
    topo = Topology.create("v5p", "2x2x4", num_slices=2)
    devices = _mock_devices(topo)
    random.Random(0).shuffle(devices)
    real = Topology.from_devices(devices)
    assert real.shape == topo.shape and real.num_slices == 2
    for rank, device in enumerate(devices):
        chip = real.chips[rank]
        assert (chip.coords, chip.slice_index, chip.host) == (
            device.coords, device.slice_index, device.process_index
        )


def test_from_devices_errors() -> None:
    devices = _mock_devices(Topology.create("v5p", "2x2x2"))
    with pytest.raises(ValueError, match="holes"):
        Topology.from_devices(devices[:-1])
    with pytest.raises(ValueError, match="unknown TPU device_kind 'TPU v9'"):
        Topology.from_devices([dataclasses.replace(d, device_kind="TPU v9") for d in devices])
    with pytest.raises(ValueError, match="same slice, chip coordinates and core"):
        Topology.from_devices(devices[:-1] + [devices[0]])


# -- emulation from the environment --------------------------------------------------------------


def test_topology_from_env() -> None:
    assert topology_from_env({}) is None
    topo = topology_from_env({"TPU_DIST_TOPOLOGY": "v5p-16", "TPU_DIST_NUM_SLICES": "2"})
    assert topo == Topology.create("v5p", "2x2x2", 2)
    assert topology_from_env({"TPU_DIST_TOPOLOGY": "v6e:4x4"}) == Topology.create("v6e", "4x4")
    assert topo.env() == {"TPU_DIST_TOPOLOGY": "v5p:2x2x2", "TPU_DIST_NUM_SLICES": "2"}
    assert topology_from_env(topo.env()) == topo


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"TPU_DIST_TOPOLOGY": "v5p-16", "TPU_DIST_NUM_SLICES": "two"}, "TPU_DIST_NUM_SLICES"),
        ({"TPU_DIST_TOPOLOGY": "v5p-16", "TPU_DIST_NUM_SLICES": "0"}, "positive int, got '0'"),
        ({"TPU_DIST_NUM_SLICES": "2"}, "TPU_DIST_TOPOLOGY is not"),
        ({"TPU_DIST_TOPOLOGY": "v5p-15"}, "TPU_DIST_TOPOLOGY='v5p-15'"),
    ],
)
def test_topology_from_env_errors(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        topology_from_env(env)
    assert fragment in str(info.value)


def test_current_topology_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPU_DIST_TOPOLOGY", raising=False)
    monkeypatch.delenv("TPU_DIST_NUM_SLICES", raising=False)
    assert current_topology(world_size=8) == Topology.create("v5p", "2x2x2")
    with pytest.raises(RuntimeError, match="needs the world size"):
        current_topology()
    monkeypatch.setenv("TPU_DIST_TOPOLOGY", "v5litepod-4")
    monkeypatch.setenv("TPU_DIST_NUM_SLICES", "2")
    assert current_topology(world_size=8) == Topology.create("v5e", "2x2", 2)
    assert current_topology() == Topology.create("v5e", "2x2", 2)  # no world to check against
    with pytest.raises(ValueError) as info:
        current_topology(world_size=4)
    assert "has 8 devices, but the world has 4 ranks" in str(info.value)
