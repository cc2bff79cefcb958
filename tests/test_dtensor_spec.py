"""placements <-> PartitionSpec: pure layout logic on abstract meshes, no processes.

The reference for both directions is an independent model of which global indices each mesh
coordinate holds:

* DTensor: placements applied left to right; ``Shard`` takes the coordinate's contiguous
  chunk of the indices held so far; ``_StridedShard(sf)`` views them as (sf, n, rest) and
  takes column ``coordinate`` of every row (torch's documented meaning, see the
  ``_StridedShard`` docstring).
* JAX: for an entry ``(a1, ..., ak)`` the dim splits into ``prod(sizes)`` equal blocks and a
  device holds block ``c_a1 * (n_a2 ... n_ak) + ... + c_ak`` (a1 outermost).
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tpu_dist.dtensor_ext import placements_to_spec, spec_to_placements

MESH_2X4 = AbstractMesh((2, 4), ("dp", "tp"))
MESH_3D = AbstractMesh((2, 3, 2), ("a", "b", "c"))


def _dtensor_indices(placements, sizes, coord, shape):
    """Global indices per dim that ``coord`` holds under DTensor's left-to-right rules."""
    held = [np.arange(n) for n in shape]
    for m, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        n = sizes[m]
        if isinstance(p, _StridedShard):
            held[p.dim] = held[p.dim].reshape(p.split_factor, n, -1)[:, coord[m], :].ravel()
        else:
            held[p.dim] = np.array_split(held[p.dim], n)[coord[m]]
    return [h.tolist() for h in held]


def _jax_indices(spec, names, sizes, coord, shape):
    """Global indices per dim that ``coord`` holds under a PartitionSpec."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    held = []
    for dim, entry in enumerate(entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        block, ways = 0, 1
        for axis in axes:
            m = names.index(axis)
            block, ways = block * sizes[m] + coord[m], ways * sizes[m]
        width = shape[dim] // ways
        held.append(list(range(block * width, (block + 1) * width)))
    return held


def _same_layout(placements, spec, mesh, shape):
    names, sizes = tuple(mesh.axis_names), tuple(mesh.shape.values())
    for coord in itertools.product(*(range(s) for s in sizes)):
        want = _dtensor_indices(placements, sizes, coord, shape)
        got = _jax_indices(spec, names, sizes, coord, shape)
        assert got == want, f"{placements} vs {spec} at {coord}"


@pytest.mark.parametrize(
    ("placements", "spec"),
    [
        ((Replicate(), Replicate()), P(None, None)),
        ((Shard(0), Replicate()), P("dp", None)),
        ((Replicate(), Shard(1)), P(None, "tp")),
        ((Shard(0), Shard(1)), P("dp", "tp")),
        ((Shard(1), Shard(0)), P("tp", "dp")),
        ((Shard(0), Shard(0)), P(("dp", "tp"), None)),
        ((Shard(1), Shard(1)), P(None, ("dp", "tp"))),
        # FSDP2 over TP: dim 0 split by tp first (outermost), then dp
        ((_StridedShard(0, split_factor=4), Shard(0)), P(("tp", "dp"), None)),
    ],
)
def test_known_pairs_on_2x4(placements, spec) -> None:
    assert placements_to_spec(placements, MESH_2X4, 2) == spec
    assert spec_to_placements(spec, MESH_2X4) == placements
    _same_layout(placements, spec, MESH_2X4, (8, 8))


def _all_orders_3d():
    """Every way to give each axis of a 3-D mesh Replicate or a dim of a 3-D tensor, in every
    order of the axes that split the same dim (as a PartitionSpec)."""
    names = MESH_3D.axis_names
    for assignment in itertools.product([None, 0, 1, 2], repeat=3):
        by_dim = {d: [m for m, a in enumerate(assignment) if a == d] for d in range(3)}
        for orders in itertools.product(*(itertools.permutations(by_dim[d]) for d in range(3))):
            entries = [
                None if not o else names[o[0]] if len(o) == 1 else tuple(names[m] for m in o)
                for o in orders
            ]
            yield P(*entries)


def test_every_3d_spec_round_trips_and_means_the_same_layout() -> None:
    shape = (12, 12, 12)  # divisible by every product of axis sizes (2, 3, 2)
    specs = list(_all_orders_3d())
    assert len(specs) > 64  # includes every non-default order of axes on one dim
    for spec in specs:
        placements = spec_to_placements(spec, MESH_3D)
        _same_layout(placements, spec, MESH_3D, shape)
        assert placements_to_spec(placements, MESH_3D, 3) == spec


def test_default_order_placements_round_trip_3d() -> None:
    for placements in itertools.product([Replicate(), Shard(0), Shard(1), Shard(2)], repeat=3):
        spec = placements_to_spec(placements, MESH_3D, 3)
        _same_layout(placements, spec, MESH_3D, (12, 12, 12))
        assert spec_to_placements(spec, MESH_3D) == placements


def test_spec_length_and_negative_dims() -> None:
    assert placements_to_spec([Shard(0), Replicate()], MESH_2X4) == P("dp")
    assert placements_to_spec([Replicate(), Replicate()], MESH_2X4) == P()
    assert placements_to_spec([Shard(-1), Replicate()], MESH_2X4, 3) == P(None, None, "dp")
    with pytest.raises(ValueError, match="pass ndim"):
        placements_to_spec([Shard(-1), Replicate()], MESH_2X4)
    with pytest.raises(ValueError, match="tensor has 2 dims"):
        placements_to_spec([Shard(2), Replicate()], MESH_2X4, 2)
    # a spec shorter than the tensor: the missing dims are unsharded
    assert spec_to_placements(P("tp"), MESH_2X4) == (Replicate(), Shard(0))


def test_partial_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"mesh axis 1 \(.tp.\).*partial.*reduce_partial=True"):
        placements_to_spec([Shard(0), Partial()], MESH_2X4, 2)
    with pytest.raises(ValueError, match="unreduced axes"):
        spec_to_placements(P("dp", None, unreduced={"tp"}), MESH_2X4)


def test_bad_input_errors() -> None:
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        placements_to_spec([Shard(0)], MESH_2X4, 2)
    with pytest.raises(TypeError, match="only Shard, _StridedShard and Replicate"):
        placements_to_spec([Shard(0), "tp"], MESH_2X4, 2)
    with pytest.raises(ValueError, match="split factor"):
        placements_to_spec([_StridedShard(0, split_factor=3), Shard(0)], MESH_2X4, 2)
    with pytest.raises(ValueError, match="names axis 'x'"):
        spec_to_placements(P("x"), MESH_2X4)
    with pytest.raises(ValueError, match="uses axis 'dp' for dims 0 and 1"):
        spec_to_placements(P("dp", "dp"), MESH_2X4)
    with pytest.raises(ValueError, match="UNCONSTRAINED"):
        spec_to_placements(P(P.UNCONSTRAINED), MESH_2X4)
    with pytest.raises(TypeError, match="DeviceMesh"):
        placements_to_spec([Shard(0)], object(), 1)


def test_random_uneven_free_layouts_agree_with_torch_local_shapes() -> None:
    """DTensor's own local-shape computation agrees with the model used above."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rng = random.Random(0)
    sizes = tuple(MESH_3D.shape.values())
    for _ in range(50):
        spec = rng.choice(list(_all_orders_3d()))
        placements = spec_to_placements(spec, MESH_3D)
        coord = [rng.randrange(s) for s in sizes]
        shape, offset = _compute_local_shape_and_global_offset(
            (12, 12, 12), sizes, coord, placements
        )
        held = _jax_indices(spec, MESH_3D.axis_names, sizes, coord, (12, 12, 12))
        assert shape == tuple(len(h) for h in held)
        assert offset == tuple(h[0] for h in held)
        assert math.prod(shape) == 12**3 // math.prod(
            sizes[MESH_3D.axis_names.index(a)]
            for e in spec
            if e is not None
            for a in ((e,) if isinstance(e, str) else e)
        )
