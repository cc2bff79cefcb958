"""DTensor placements <-> JAX ``PartitionSpec``: pure layout logic, no communication.

The two describe the same thing from opposite ends. DTensor lists one placement per *mesh
axis* (what that axis does to the tensor); a ``PartitionSpec`` lists one entry per *tensor dim*
(which mesh axes split it, outermost first). For a (dp=2, tp=4) mesh::

    placements                        PartitionSpec
    (Shard(0), Replicate())           P("dp", None)
    (Shard(0), Shard(1))              P("dp", "tp")
    (Shard(0), Shard(0))              P(("dp", "tp"), None)   dim 0 split by dp, then by tp
    (_StridedShard(0, sf=4), Shard(0)) P(("tp", "dp"), None)  dim 0 split by tp, then by dp
    (Replicate(), Replicate())        P(None, None)
    (Partial(), Shard(0))             no equivalent: a NamedSharding cannot hold unreduced values

When several mesh axes split one dim, the order matters: ``P(("dp", "tp"))`` gives the device
at mesh coordinate (i, j) chunk ``i * 4 + j`` (dp outermost), as DTensor's default
left-to-right order does for ``(Shard(0), Shard(0))``. The other order, tp outermost, is what
FSDP2 on top of TP produces; DTensor writes it with ``_StridedShard`` placements whose
``split_factor`` is the product of the sizes of the axes that split the dim before it but sit
after it in the mesh (here tp, 4). Both directions decode and encode that rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec

__all__ = ["mesh_axes", "placements_to_spec", "spec_to_placements"]


def mesh_axes(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The axis names and sizes of a torch ``DeviceMesh`` or a JAX (abstract) mesh.

    A ``DeviceMesh`` without ``mesh_dim_names`` gets ``axis0``, ``axis1``, ... as
    :func:`tpu_dist.mesh.mesh_to_jax` names them.

    Raises:
        TypeError: ``mesh`` is neither.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        sizes = tuple(int(s) for s in mesh.mesh.shape)
        names = mesh.mesh_dim_names or tuple(f"axis{k}" for k in range(len(sizes)))
        return tuple(names), sizes
    names = getattr(mesh, "axis_names", None)
    shape = getattr(mesh, "shape", None)
    if names is None or not hasattr(shape, "values"):
        raise TypeError(
            "mesh must be a torch DeviceMesh, a jax.sharding.Mesh or a "
            f"jax.sharding.AbstractMesh, got {type(mesh).__name__}"
        )
    return tuple(names), tuple(int(s) for s in shape.values())


def placements_to_spec(
    placements: Sequence[Placement], mesh: Any, ndim: int | None = None
) -> PartitionSpec:
    """The ``PartitionSpec`` that lays a tensor out as ``placements`` do on ``mesh``.

    Pure layout logic: no communication, so any rank (or no process group at all, with a
    ``jax.sharding.AbstractMesh``) can call it.

    Args:
        placements: One placement per mesh axis: ``Shard``, ``Replicate`` or
            ``_StridedShard`` (FSDP2 + TP parameters).
        mesh: A torch ``DeviceMesh`` or a JAX ``Mesh``/``AbstractMesh``; only its axis names
            and sizes are read.
        ndim: The tensor's rank. Given: the spec has exactly ``ndim`` entries and negative
            ``Shard`` dims are allowed. None: trailing unsharded dims are left out (JAX
            treats missing entries as unsharded).

    Returns:
        A ``jax.sharding.PartitionSpec``; an entry is None, an axis name, or a tuple of axis
        names (outermost split first) when several axes split one dim.

    Raises:
        ValueError: a ``Partial`` placement (a NamedSharding has no unreduced state: reduce
            first, e.g. ``dt.redistribute(placements=[Replicate() if p.is_partial() else p
            ...])`` or ``to_jax(dt, reduce_partial=True)``); the wrong number of placements; a
            shard dim outside ``ndim``; ``_StridedShard`` split factors that no order of axes
            produces.
        TypeError: a placement of another kind.
    """
    from jax.sharding import PartitionSpec

    names, sizes = mesh_axes(mesh)
    placements = tuple(placements)
    if len(placements) != len(names):
        raise ValueError(
            f"expected one placement per mesh axis ({len(names)} for axes {names}), "
            f"got {len(placements)}: {placements}"
        )
    orders = _shard_orders(placements, names, sizes, ndim)
    length = ndim if ndim is not None else max(orders, default=-1) + 1
    entries: list[Any] = [None] * length
    for dim, mesh_dims in orders.items():
        axes = tuple(names[m] for m in mesh_dims)
        entries[dim] = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*entries)


def spec_to_placements(spec: PartitionSpec, mesh: Any) -> tuple[Placement, ...]:
    """The DTensor placements that lay a tensor out as ``spec`` does on ``mesh``.

    The inverse of :func:`placements_to_spec`: ``Shard(d)`` for an axis named in entry ``d``,
    ``Replicate()`` for an axis named nowhere, and ``_StridedShard`` where several axes split
    one dim in an order other than the mesh's (what DTensor itself uses for FSDP2 + TP).
    Pure layout logic, no communication.

    Args:
        spec: A ``jax.sharding.PartitionSpec`` (a tuple of entries is accepted too).
        mesh: A torch ``DeviceMesh`` or a JAX ``Mesh``/``AbstractMesh`` whose axis names the
            spec uses.

    Raises:
        ValueError: an axis the mesh does not have, an axis used twice,
            ``PartitionSpec.UNCONSTRAINED``, or ``unreduced``/``reduced`` axes (DTensor
            ``Partial`` has no NamedSharding counterpart that tpu_dist converts).
    """
    from jax.sharding import PartitionSpec

    names, sizes = mesh_axes(mesh)
    for attr in ("unreduced", "reduced"):
        extra = getattr(spec, attr, None)
        if extra:
            raise ValueError(
                f"{spec} has {attr} axes {sorted(extra)}; tpu_dist converts only plain "
                "sharded/replicated specs. Reduce the array inside your jitted function "
                "(e.g. jax.lax.psum) before converting."
            )
    orders: dict[int, tuple[int, ...]] = {}
    used: dict[str, int] = {}
    for dim, entry in enumerate(tuple(spec)):
        if entry is None:
            continue
        if entry is PartitionSpec.UNCONSTRAINED:
            raise ValueError(
                f"{spec}: entry {dim} is UNCONSTRAINED; a DTensor needs a concrete layout"
            )
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        mesh_dims = []
        for axis in axes:
            if axis not in names:
                raise ValueError(f"{spec} names axis {axis!r}, but the mesh has axes {names}")
            if axis in used:
                raise ValueError(
                    f"{spec} uses axis {axis!r} for dims {used[axis]} and {dim}; an axis "
                    "can split one dim only"
                )
            used[axis] = dim
            mesh_dims.append(names.index(axis))
        if mesh_dims:
            orders[dim] = tuple(mesh_dims)
    placements: list[Placement] = [Replicate()] * len(names)
    for dim, mesh_dims in orders.items():
        for position, m in enumerate(mesh_dims):
            # Axes that split this dim before m but sit after m in the mesh: DTensor's
            # left-to-right reading needs m's chunks strided by their total size.
            factor = math.prod(sizes[e] for e in mesh_dims[:position] if e > m)
            placements[m] = Shard(dim) if factor == 1 else _StridedShard(dim, split_factor=factor)
    return tuple(placements)


def _shard_orders(
    placements: tuple[Placement, ...],
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    ndim: int | None,
) -> dict[int, tuple[int, ...]]:
    """Tensor dim -> the mesh dims that split it, outermost first.

    Shard-like placements are read right to left, as DTensor does: a ``Shard`` goes where the
    product of the axes already placed before it is 1 (outermost), a ``_StridedShard`` of
    split factor ``f`` where that product is ``f``.
    """
    orders: dict[int, list[int]] = {}
    for m in reversed(range(len(placements))):
        p = placements[m]
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise ValueError(
                f"mesh axis {m} ({names[m]!r}) has placement {p!r}, partial: a jax NamedSharding cannot "
                "hold unreduced (partial) values. Reduce first: redistribute that axis to "
                "Replicate() (an all-reduce), or call to_jax(dtensor, reduce_partial=True)."
            )
        if not isinstance(p, Shard | _StridedShard):
            raise TypeError(
                f"mesh axis {m} ({names[m]!r}) has placement {p!r} of type "
                f"{type(p).__name__}; only Shard, _StridedShard and Replicate map to a "
                "PartitionSpec"
            )
        dim = p.dim
        if ndim is not None:
            if not -ndim <= dim < ndim:
                raise ValueError(
                    f"placement {p} on mesh axis {m} ({names[m]!r}) shards dim {dim}, but "
                    f"the tensor has {ndim} dims"
                )
            dim %= ndim
        elif dim < 0:
            raise ValueError(f"placement {p} has a negative dim; pass ndim= to resolve it")
        factor = p.split_factor if isinstance(p, _StridedShard) else 1
        order = orders.setdefault(dim, [])
        placed = 1
        for position in range(len(order) + 1):
            if placed == factor:
                order.insert(position, m)
                break
            if position < len(order):
                placed *= sizes[order[position]]
        else:
            raise ValueError(
                f"placements {placements} on a mesh of sizes {sizes}: {p} on mesh axis {m} "
                "has a split factor that no order of the axes sharding that dim produces"
            )
    return {dim: tuple(order) for dim, order in sorted(orders.items())}
