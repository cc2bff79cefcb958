"""``redistribute``: DTensor's redistribute, with Shard(i) -> Shard(j) as one all-to-all.

Why this exists. torch 2.13's DTensor moves a mesh axis from ``Shard(i)`` to ``Shard(j)``
through ``shard_dim_alltoall``, which checks ``mesh.device_type == "cpu"`` and then, since gloo
has no all-to-all, all-gathers the whole dim and keeps one chunk: every rank receives
``n`` times the data it needs. The "tpu" backend's meshes have device type "cpu" (the tensors
are CPU tensors), so DTensor takes that path although the backend runs ``all_to_all_single``
as one XLA program. torch offers no hook to change it: the check is inline in
``torch.distributed.tensor._collective_utils.shard_dim_alltoall``, and the redistribute
planner has no per-backend strategies. Rather than patch torch, :func:`redistribute` is an
explicit drop-in for ``DTensor.redistribute`` that does those steps with one all-to-all and
hands every other step to DTensor.

The all-to-all step on mesh axis ``k`` (size ``n``) from ``Shard(a)`` to ``Shard(b)``: each
rank cuts its local tensor into ``n`` pieces along ``b``, sends piece ``r`` to the rank at
coordinate ``r`` of axis ``k``, and concatenates what it receives along ``a`` in coordinate
order. It is exact when it keeps DTensor's default left-to-right shard order: no mesh axis
after ``k`` may shard ``a`` or ``b`` (axis ``k``'s split must be the innermost on both dims),
and every shard must have the same shape (the sizes of ``a`` and ``b`` divide evenly by the
axes that shard them). Steps that do not qualify go through ``DTensor.redistribute``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["redistribute"]


def redistribute(
    dtensor: DTensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``dtensor.redistribute(device_mesh, placements)``, Shard(i) -> Shard(j) by all-to-all.

    Same arguments, result and autograd behaviour as ``DTensor.redistribute`` (the backward
    of an all-to-all step is the reverse all-to-all). Each mesh axis that goes from
    ``Shard(i)`` to ``Shard(j)`` and qualifies (module doc) costs one ``all_to_all_single``
    over that axis's group, moving ``1/n`` of what DTensor's all-gather fallback moves; the
    remaining changes are made by ``DTensor.redistribute``.

    SPMD: every rank of the mesh calls it with the same placements, as for
    ``DTensor.redistribute``. On a (dp=2, tp=2) mesh ``[[0, 1], [2, 3]]``, ``x`` of shape
    (4, 4), (Replicate(), Shard(0)) -> (Replicate(), Shard(1)): one all-to-all in each tp
    group ({0, 1} and {2, 3})::

        rank  before (local)   sends to tp peer 0   sends to tp peer 1   after (local)
        0     x[0:2, :]        x[0:2, 0:2]          x[0:2, 2:4]          x[:, 0:2]
        1     x[2:4, :]        x[2:4, 0:2]          x[2:4, 2:4]          x[:, 2:4]

    Args:
        dtensor: The DTensor to redistribute.
        device_mesh: Must be ``dtensor.device_mesh`` or None (DTensor itself supports no
            other).
        placements: The target placements, one per mesh axis (default: all Replicate).

    Returns:
        A DTensor with ``placements``; its local tensor is a new tensor.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"redistribute expects a DTensor, got {type(dtensor).__name__}")
    mesh = dtensor.device_mesh
    if device_mesh is not None and device_mesh != mesh:
        return dtensor.redistribute(device_mesh, placements)
    if placements is None:
        return dtensor.redistribute(mesh, placements)
    target = _normalize(tuple(placements), dtensor.ndim)
    current = list(_normalize(dtensor.placements, dtensor.ndim))
    if len(target) != mesh.ndim or mesh.get_coordinate() is None:
        return dtensor.redistribute(mesh, target)
    local = None
    while (step := _next_all_to_all(current, target, tuple(dtensor.shape), mesh)) is not None:
        k, src_dim, dst_dim = step
        if local is None:
            local = dtensor.to_local()
        local = _shard_to_shard(local, src_dim, dst_dim, mesh, k)
        current[k] = Shard(dst_dim)
    if local is None:
        return dtensor.redistribute(mesh, target)
    moved = DTensor.from_local(
        local, mesh, current, run_check=False, shape=dtensor.shape, stride=dtensor.stride()
    )
    if tuple(current) == target:
        return moved
    return moved.redistribute(mesh, target)


def _normalize(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    return tuple(
        Shard(p.dim % ndim) if type(p) is Shard and ndim and p.dim < 0 else p
        for p in placements
    )


def _next_all_to_all(
    current: list[Placement],
    target: tuple[Placement, ...],
    shape: tuple[int, ...],
    mesh: DeviceMesh,
) -> tuple[int, int, int] | None:
    """The next mesh axis whose Shard(a) -> Shard(b) change an all-to-all does exactly."""
    for k in reversed(range(len(current))):
        src, dst = current[k], target[k]
        if type(src) is not Shard or type(dst) is not Shard or src.dim == dst.dim:
            continue
        a, b = src.dim, dst.dim
        if any(
            isinstance(p, Shard | _StridedShard) and p.dim in (a, b)
            for p in current[k + 1 :]
        ) or any(isinstance(p, _StridedShard) and p.dim in (a, b) for p in current):
            continue
        after = current[:k] + [dst] + current[k + 1 :]
        if _even(shape, a, current, mesh) and _even(shape, b, after, mesh):
            return k, a, b
    return None


def _even(
    shape: tuple[int, ...], dim: int, placements: Sequence[Placement], mesh: DeviceMesh
) -> bool:
    ways = math.prod(
        mesh.size(m) for m, p in enumerate(placements) if type(p) is Shard and p.dim == dim
    )
    return shape[dim] % ways == 0


def _shard_to_shard(
    local: torch.Tensor, src_dim: int, dst_dim: int, mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """One all-to-all over ``mesh_dim``'s group: split along dst_dim, gather along src_dim."""
    n = mesh.size(mesh_dim)
    # (n, ...local dims with dst_dim / n...): row r is the piece for the peer at coordinate r.
    pieces = local.unflatten(dst_dim, (n, -1)).movedim(dst_dim, 0).contiguous()
    received = funcol.all_to_all_single_autograd(pieces, None, None, (mesh, mesh_dim))
    if isinstance(received, funcol.AsyncCollectiveTensor):
        received = received.wait()
    # Row r came from coordinate r: put the rows side by side along src_dim, in order.
    return received.movedim(0, src_dim).flatten(src_dim, src_dim + 1)
