"""Pure-logic tests of plan_mesh: layout properties, hand-checked layouts, JAX agreement, speed."""

from __future__ import annotations

import time

import numpy as np
import pytest
from jax.experimental import mesh_utils

from tpu_dist.mesh import Topology, plan_mesh
from tpu_dist.mesh._layout import _plan_slice, snake_order, split_dcn


def check_plan(
    topo: Topology, ranks: np.ndarray, ici: tuple[int, ...], dcn: tuple[int, ...]
) -> None:
    """The properties every plan must have (the issue's "must hold")."""
    assert ranks.shape == tuple(i * d for i, d in zip(ici, dcn))
    # Every rank exactly once.
    assert np.array_equal(np.sort(ranks, axis=None), np.arange(topo.num_devices))
    slices = topo.slice_of(ranks)
    for axis in range(ranks.ndim):
        size = ranks.shape[axis]
        groups = np.moveaxis(ranks, axis, -1).reshape(-1, size)
        group_slices = np.moveaxis(slices, axis, -1).reshape(-1, size)
        distinct = np.array([len(set(row)) for row in group_slices[:256]])
        if dcn[axis] == 1:
            # An ICI axis: every group inside one slice.
            assert np.all(group_slices == group_slices[:, :1]), f"axis {axis} leaves its slice"
        else:
            # A DCN axis crosses dcn[axis] slices, ici[axis] members in each.
            assert np.all(distinct == dcn[axis]), f"axis {axis} does not cross {dcn[axis]} slices"
    # Consecutive members of the innermost (last non-trivial) axis are ICI neighbours.
    inner = max((a for a in range(ranks.ndim) if ici[a] > 1), default=None)
    if inner is not None:
        groups = np.moveaxis(ranks, inner, -1).reshape(-1, ranks.shape[inner])
        # Members inside one slice: the ICI part of the axis.
        for block in range(dcn[inner]):
            part = groups[:, block * ici[inner] : (block + 1) * ici[inner]]
            hops = topo.ici_hops(part[:, :-1], part[:, 1:])
            assert hops.min() >= 0 and hops.max() <= 1, (
                f"innermost axis {inner}: consecutive members {hops.max()} hops apart"
            )


# (topology, num_slices, ici, dcn): every generation, several shapes, one and several slices.
CASES = [
    ("v4:2x2x1", 1, (2, 2), (1, 1)),
    ("v4:4x4x4", 1, (4, 16), (1, 1)),
    ("v4:4x4x8", 2, (8, 16), (2, 1)),
    ("v4:2x2x4", 1, (2, 8), (1, 1)),  # splits the 4-long z axis
    ("v5e:1x1", 4, (1, 1), (2, 2)),
    ("v5e:4x4", 1, (16,), (1,)),
    ("v5e:4x4", 1, (2, 8), (1, 1)),  # 8 is no product of whole axes: JAX splits one
    ("v5e:8x16", 2, (4, 32), (2, 1)),
    ("v5e:16x16", 1, (16, 16), (1, 1)),
    ("v5p:2x2x1", 1, (4,), (1,)),
    ("v5p:2x2x2", 1, (2, 4), (1, 1)),
    ("v5p:4x4x4", 1, (4, 4, 4), (1, 1, 1)),
    ("v5p:4x4x4", 1, (64,), (1,)),
    ("v5p:4x4x4", 2, (1, 8, 8), (2, 1, 1)),
    ("v5p:4x8x8", 1, (2, 128), (1, 1)),
    ("v5p:4x4x4", 4, (2, 8, 4), (2, 2, 1)),
    ("v5p:4x4x4", 1, (16, 4, 1), (1, 1, 1)),  # innermost non-trivial axis is the middle one
    ("v6e:2x4", 1, (8,), (1,)),
    ("v6e:8x8", 3, (4, 16), (3, 1)),
    ("v6e:16x16", 1, (4, 64), (1, 1)),
    ("v7x:2x2x1", 1, (2, 4), (1, 1)),
    ("v7x:2x2x2", 1, (16,), (1,)),
    ("v7x:4x4x4", 2, (8, 16), (2, 1)),
    ("v7x:4x4x4", 1, (2, 4, 16), (1, 1, 1)),
]


@pytest.mark.parametrize(("spec", "num_slices", "ici", "dcn"), CASES)
def test_plan_properties(spec: str, num_slices: int, ici: tuple, dcn: tuple) -> None:
    topo = Topology.parse(spec, num_slices)
    ranks = plan_mesh(topo, ici, dcn)
    check_plan(topo, ranks, ici, dcn)


def test_hand_checked_v5e_4x4_snake() -> None:
    # v5e 4x4: four hosts of 2x2 chips, rank = 4 * host + x % 2 + 2 * (y % 2) with
    # host = x // 2 + 2 * (y // 2):
    #   y=0:  0  1 |  4  5
    #   y=1:  2  3 |  6  7
    #   y=2:  8  9 | 12 13
    #   y=3: 10 11 | 14 15
    # JAX gives the 16-way axis the x-y plane, y fastest; the snake turns at each row end:
    # (0,0) (0,1) (0,2) (0,3) (1,3) (1,2) (1,1) (1,0) (2,0) ... (3,0).
    ranks = plan_mesh(Topology.create("v5e", "4x4"), (16,))
    assert ranks.tolist() == [0, 2, 8, 10, 11, 9, 3, 1, 4, 6, 12, 14, 15, 13, 7, 5]


def test_hand_checked_v5p_2x2x2() -> None:
    # v5p 2x2x2: host 0 is z=0 (ranks 0 1 2 3 at (0,0) (1,0) (0,1) (1,1)), host 1 is z=1.
    # Mesh (2, 4): the 4-way axis gets the x-y plane as a ring (0,0) (0,1) (1,1) (1,0); the
    # 2-way axis gets z, pairing the hosts.
    ranks = plan_mesh(Topology.create("v5p", "2x2x2"), (2, 4))
    assert ranks.tolist() == [[0, 2, 3, 1], [4, 6, 7, 5]]
    # Mesh (4, 2): the 2-way axis takes a whole axis of size 2 (x), the 4-way axis the y-z
    # plane, z fastest, as a ring: (y,z) = (0,0) (0,1) (1,1) (1,0).
    ranks = plan_mesh(Topology.create("v5p", "2x2x2"), (4, 2))
    assert ranks.tolist() == [[0, 1], [4, 5], [6, 7], [2, 3]]


def test_hand_checked_multislice_blocks() -> None:
    # Two v5p 2x2x1 slices (ranks 0-3 and 4-7), mesh dcn (2, 1) x ici (1, 4): slice s is
    # block s of axis 0; in each slice the 4-way axis is the ring (0,0) (0,1) (1,1) (1,0).
    ranks = plan_mesh(Topology.create("v5p", "2x2x1", 2), (1, 4), (2, 1))
    assert ranks.tolist() == [[0, 2, 3, 1], [4, 6, 7, 5]]
    # dcn (1, 2): the slices multiply the inner axis: block 0 of it is slice 0.
    ranks = plan_mesh(Topology.create("v5p", "2x2x1", 2), (2, 2), (1, 2))
    assert ranks.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_v7x_puts_a_two_way_axis_on_the_chip() -> None:
    # A 2-way innermost axis takes the two TensorCores of one chip (the on-chip link).
    topo = Topology.from_accelerator_type("tpu7x-16")
    ranks = plan_mesh(topo, (8, 2))
    pairs = ranks.reshape(-1, 2)
    assert np.array_equal(topo.coords_of(pairs[:, 0]), topo.coords_of(pairs[:, 1]))
    assert set(topo.core_of(pairs[:, 0])) == {0} and set(topo.core_of(pairs[:, 1])) == {1}


@pytest.mark.parametrize(
    ("spec", "num_slices", "ici", "dcn"),
    [("v5p:4x4x4", 2, (1, 4, 16), (2, 1, 1)), ("v5e:4x8", 2, (2, 16), (1, 2))],
)
def test_same_groups_as_jax_hybrid_mesh(spec: str, num_slices: int, ici: tuple, dcn: tuple) -> None:
    """Our plan is JAX's create_hybrid_device_mesh up to the order inside each group."""

    class Device:
        def __init__(self, chip) -> None:
            self.id = chip.rank
            self.coords = chip.coords + (0,) * (3 - len(chip.coords))
            self.core_on_chip = chip.core
            self.slice_index = chip.slice_index
            self.process_index = chip.host
            self.platform = "tpu"
            self.device_kind = "TPU v4"  # a kind without a special-case handler

    topo = Topology.parse(spec, num_slices)
    jax_mesh = mesh_utils.create_hybrid_device_mesh(
        ici, dcn, [Device(c) for c in topo.chips], allow_split_physical_axes=True
    )
    jax_ranks = np.vectorize(lambda d: d.id, otypes=[np.int64])(jax_mesh)
    ranks = plan_mesh(topo, ici, dcn)
    for axis in range(ranks.ndim):
        ours = {frozenset(g) for g in np.moveaxis(ranks, axis, -1).reshape(-1, ranks.shape[axis])}
        theirs = {
            frozenset(g) for g in np.moveaxis(jax_ranks, axis, -1).reshape(-1, ranks.shape[axis])
        }
        assert ours == theirs


def test_jax_v5e_handler_ring_does_not_fit_grid_coordinates() -> None:
    """Why the mocks avoid JAX's device-kind handlers (see tpu_dist/mesh/_layout.py).

    JAX's v5e handler reorders an 8-chip slice with a ring order made for real devices'
    numbering; on a 2x4 grid listed x fastest it is not a ring. If this starts failing, JAX
    changed its handler and the bypass can be revisited.
    """
    devices = [
        type("D", (), dict(id=i, coords=(i % 2, i // 2, 0), core_on_chip=0, slice_index=0,
                           process_index=0, platform="tpu", device_kind="TPU v5 lite"))()
        for i in range(8)
    ]
    order = mesh_utils.create_device_mesh((8,), devices)
    coords = np.array([d.coords for d in order])
    assert np.abs(np.diff(coords, axis=0)).sum(axis=1).max() > 1


def test_snake_order() -> None:
    assert snake_order([2, 3]).tolist() == [0, 1, 2, 5, 4, 3]
    order = snake_order([3, 2, 4])
    digits = np.stack(np.unravel_index(order, (3, 2, 4)), axis=-1)
    assert np.all(np.abs(np.diff(digits, axis=0)).sum(axis=1) == 1)
    assert sorted(order.tolist()) == list(range(24))


def test_split_dcn() -> None:
    assert split_dcn((4, 8), 2) == ((2, 1), (2, 8))
    assert split_dcn((2, 6), 4) == ((2, 2), (1, 3))
    assert split_dcn((1, 8), 2) == ((1, 2), (1, 4))
    # Without dcn_mesh_shape, the slices come off the outermost axes.
    topo = Topology.create("v5p", "2x2x1", 2)
    assert np.array_equal(plan_mesh(topo, (2, 4)), plan_mesh(topo, (1, 4), (2, 1)))
    with pytest.raises(ValueError, match="cannot split 2 slices off mesh shape"):
        split_dcn((3, 5), 2)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("v5p:4x4x4", 1, (4, 8), None), ["has 32 devices", "must be 64", "4, 16, 64"]),
        (("v5p:4x4x4", 2, (4, 16), (3, 1)), ["spans 3 slices", "has 2"]),
        (("v5p:4x4x4", 1, (4, 16), (1,)), ["same number of axes"]),
        (("v5p:4x4x4", 1, (0, 64), None), ["positive ints"]),
        (("v5p:4x4x4", 1, "64", None), ["positive ints"]),
        (("v5p:4x4x4", 3, (2, 32), None), ["cannot split 3 slices"]),
        (
            ("v7x:2x2x1", 1, (4,), None),
            ["has 4 devices", "must be 8", "2x2x1 chips x 2 devices per chip"],
        ),
    ],
)
def test_plan_errors(args: tuple, fragments: list[str]) -> None:
    spec, num_slices, ici, dcn = args
    with pytest.raises(ValueError) as info:
        plan_mesh(Topology.parse(spec, num_slices), ici, dcn)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_12288_chips_plan_fast_and_correct() -> None:
    """2 slices of v5p 16x16x24: the issue's large case; planning takes well under a second."""
    topo = Topology.create("v5p", "16x16x24", num_slices=2)
    _plan_slice.cache_clear()
    start = time.perf_counter()
    ranks = plan_mesh(topo, (1, 384, 16), (2, 1, 1))
    elapsed = time.perf_counter() - start
    print(f"planned 12,288 chips in {elapsed * 1e3:.1f} ms")
    check_plan(topo, ranks, (1, 384, 16), (2, 1, 1))
    # The 384-way axis is a snake through the y-z plane: also all one hop.
    groups = np.moveaxis(ranks, 1, -1).reshape(-1, 384)
    assert topo.ici_hops(groups[:, :-1], groups[:, 1:]).max() == 1
    assert elapsed < 5.0  # measured ~20-40 ms; generous for a loaded 2-core machine
