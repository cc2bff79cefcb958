"""The running world's topology, and topology-aware torch ``DeviceMesh`` / JAX ``Mesh``.

Thin glue: :func:`current_topology` decides which chips the ranks have (emulated from the
environment, or real TPU devices), :func:`init_device_mesh` builds the torch ``DeviceMesh`` of
:func:`~tpu_dist.mesh.plan_mesh`, :func:`mesh_to_jax` gives the same layout as a JAX ``Mesh``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tpu_dist import _settings
from tpu_dist.mesh._layout import plan_mesh
from tpu_dist.mesh._topology import Topology

if TYPE_CHECKING:
    import jax
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "NUM_SLICES_ENV",
    "TOPOLOGY_ENV",
    "current_topology",
    "init_device_mesh",
    "mesh_to_jax",
    "register_mesh",
]


_TOPOLOGY = _settings.TOPOLOGY
_NUM_SLICES = _settings.NUM_SLICES

TOPOLOGY_ENV = _TOPOLOGY.env
"""``"TPU_DIST_TOPOLOGY"``: see :func:`current_topology`."""
NUM_SLICES_ENV = _NUM_SLICES.env
"""``"TPU_DIST_NUM_SLICES"``: see :func:`current_topology`."""


def topology_from_env(environ: Mapping[str, str] | None = None) -> Topology | None:
    """The emulated topology ``TPU_DIST_TOPOLOGY`` / ``TPU_DIST_NUM_SLICES`` ask for, or None.

    Raises:
        ValueError: a variable is malformed; the message names it.
    """
    environ = os.environ if environ is None else environ
    spec = _TOPOLOGY.read(environ)
    num_slices = _NUM_SLICES.get(environ)
    if not spec:
        raw_slices = environ.get(_NUM_SLICES.env, "").strip()
        if raw_slices:
            raise ValueError(
                f"{_NUM_SLICES.env}={raw_slices!r} is set but {_TOPOLOGY.env} is not; set both "
                f"(e.g. {_TOPOLOGY.env}=v5p-8 {_NUM_SLICES.env}=2) or neither"
            )
        return None
    try:
        return Topology.parse(spec, num_slices)
    except ValueError as err:
        raise ValueError(f"{_TOPOLOGY.env}={spec!r}: {err}") from err


def current_topology(world_size: int | None = None) -> Topology:
    """The topology of the running world: which chip each rank drives.

    In order:

    1. ``TPU_DIST_TOPOLOGY`` (with ``TPU_DIST_NUM_SLICES``, default 1) if set: an emulated
       topology (``tpu-launch --emulate TYPE`` sets both). Explicit, so it wins.
    2. The real TPU devices of the "tpu" backend (the default group's ``devices``)
       when its process group runs on TPUs.
    3. :meth:`Topology.for_world_size`: a default emulated topology with one device per rank
       (4 ranks: v5p 2x2x1; 8 ranks: v5p 2x2x2).

    Args:
        world_size: The number of ranks; default: the default process group's size. Required
            when no process group is initialised and no real devices are known.

    Raises:
        ValueError: malformed environment variables, or a topology whose device count is not
            the world size.
        RuntimeError: no world size can be found.
    """
    import torch.distributed as dist

    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    topology = topology_from_env()
    if topology is None:
        topology = _real_tpu_topology()
    if topology is None:
        if world_size is None:
            raise RuntimeError(
                "current_topology() needs the world size: initialise the default process group "
                f"first, pass world_size=..., or set {_TOPOLOGY.env}"
            )
        return Topology.for_world_size(world_size)
    if world_size is not None and topology.num_devices != world_size:
        raise ValueError(
            f"{_TOPOLOGY.env}={os.environ.get(_TOPOLOGY.env)!r} with {_NUM_SLICES.env}="
            f"{topology.num_slices} has {topology.num_devices} devices, but the world has "
            f"{world_size} ranks (one device per rank); pick a topology of {world_size} devices "
            f"or unset {_TOPOLOGY.env} for the default"
            if os.environ.get(_TOPOLOGY.env)
            else f"the TPU devices ({topology.describe()}) are {topology.num_devices}, but the "
            f"world has {world_size} ranks; run one rank per device"
        )
    return topology


def world_devices() -> list | None:
    """The JAX device of each global rank, indexed by rank, as the default process group
    lists them when it is a "tpu" group (its ``devices``); None before
    ``init_process_group`` or when the default group has no JAX devices (gloo).

    Read from the group torch holds, so this layer needs nothing from the backend's modules.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    devices = getattr(dist.group.WORLD, "devices", None)
    return list(devices) if devices else None


def _real_tpu_topology() -> Topology | None:
    """The topology of the "tpu" backend's devices, if it runs on real TPUs; else None."""
    devices = world_devices()
    if not devices or getattr(devices[0], "platform", None) != "tpu":
        return None
    return Topology.from_devices(devices)


def init_device_mesh(
    mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
    dcn_mesh_shape: Sequence[int] | None = None,
) -> DeviceMesh:
    """A torch ``DeviceMesh`` over all ranks, laid out for the TPU topology.

    ``mesh.mesh`` equals ``plan_mesh(current_topology(), mesh_shape, dcn_mesh_shape)``: inner
    (last) axes on ICI neighbours, outer axes across DCN. Axes are ordered by increasing traffic
    (data parallel first, tensor parallel last). The device type is ``"cpu"``, the device type
    the "tpu" backend is registered for (tensors stay torch CPU tensors; the backend moves them);
    it works as well on a "gloo" default group.

    SPMD: every rank of the default process group must call it, with the same arguments (it
    creates one process group per axis, collectively). Each rank gets the same mesh and its own
    coordinates. A 2x4 mesh on 8 ranks (default topology v5p 2x2x2; ``mesh_dim_names=("dp",
    "tp")``)::

        mesh.mesh = [[0, 2, 3, 1],      rank  get_coordinate()  tp group      dp group
                     [4, 6, 7, 5]]      0     [0, 0]            [0, 2, 3, 1]  [0, 4]
                                        1     [0, 3]            [0, 2, 3, 1]  [1, 5]
                                        2     [0, 1]            [0, 2, 3, 1]  [2, 6]
                                        7     [1, 2]            [4, 6, 7, 5]  [3, 7]

    Each tp group is a ring over one host's 2x2 chips, chips (0,0) (0,1) (1,1) (1,0) (one hop
    each step); dp pairs the two hosts along z. A rank that passes other arguments, or does not
    call, hangs or fails in the process-group creation of torch's ``DeviceMesh``. Each axis's
    groups are registered as a family (:func:`register_mesh`): on a "tpu" world their
    collectives run as one program over the whole family.

    Args:
        mesh_shape: The mesh; with ``dcn_mesh_shape``, the mesh inside one slice.
        mesh_dim_names: One name per axis (``("dp", "tp")``), or None.
        dcn_mesh_shape: How slices multiply each axis (see :func:`plan_mesh`); default: slices
            are split off the outermost axes of ``mesh_shape``.

    Raises:
        RuntimeError: the default process group is not initialised.
        ValueError: the shapes or names do not fit (see :func:`plan_mesh`).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "init_device_mesh needs the default process group: call "
            "torch.distributed.init_process_group('tpu') (or 'gloo') first"
        )
    names = _check_names(mesh_dim_names, len(tuple(mesh_shape)))
    ranks = plan_mesh(current_topology(dist.get_world_size()), mesh_shape, dcn_mesh_shape)
    mesh = DeviceMesh.from_group(
        _groups_in_mesh_order(ranks, names), "cpu", mesh=torch.from_numpy(ranks),
        mesh_dim_names=names,
    )
    register_mesh(mesh)
    return mesh


def register_mesh(mesh: DeviceMesh) -> None:
    """Tell the "tpu" backend that each dimension's groups of ``mesh`` form a family, so that
    their collectives run as one program over the whole family (TPU v5e and v6e compile
    collectives over part of a slice only so; see ``docs/architecture.md``).

    Registers every dimension of the mesh ``mesh`` was sliced from (its root; ``mesh`` may be
    a sub-mesh such as ``mesh["tp"]``) and every dimension flattened from it so far
    (``mesh["dp", "cp"]._flatten("dp_cp")``, as HSDP and TorchTitan do). :func:`init_device_mesh`
    registers its mesh itself. Call it for a mesh made any other way (torch's
    ``init_device_mesh("cpu", ...)`` on a "tpu" world, ``DeviceMesh(...)``), and again after
    flattening dimensions: on every rank, after creating the mesh (or the flattened
    dimension), before the new groups' first collective. Registering a group again is
    harmless. A dimension whose group is not a "tpu" group (a gloo mesh), or is the whole
    world, is left as it is. The mesh's groups must be the ones of its dimensions in mesh
    order (torch's own meshes sort each group's ranks; both forms are recognised).

    Every rank of a family must then call the same collectives on its group at the same points
    (as DeviceMesh users do): on TPU, every device of a family program takes part in it. On
    CPU only the group's own ranks take part, as before.

    Raises:
        ValueError: a dimension's group is not the ranks of this rank's line of the mesh
            along that dimension (in mesh order or sorted).
    """
    import torch.distributed as dist

    devices = world_devices()
    if devices is None:  # no "tpu" default group: nothing to tell
        return
    for name, lines, group in _dimensions(mesh):
        backend = _tpu_backend(group)
        if backend is None:
            continue
        mine = dist.get_process_group_ranks(group)
        if mine not in lines and mine == sorted(mine):
            lines = [sorted(line) for line in lines]
        if mine not in lines:
            raise ValueError(
                f"register_mesh: dimension {name!r}'s group on rank {dist.get_rank()} has "
                f"ranks {mine}, which is not a line of the mesh along that dimension (the "
                f"mesh's lines there are like {lines[0]}); register a mesh whose groups are "
                "its own dimensions' (torch.distributed.device_mesh.init_device_mesh or "
                "tpu_dist.mesh.init_device_mesh)."
            )
        backend.set_family(lines, devices)


def _dimensions(mesh: DeviceMesh) -> list[tuple[Any, list[list[int]], Any]]:
    """(name, the ranks of every line along it, this rank's group) for each dimension of
    ``mesh``'s root mesh, then for each dimension flattened from it.

    torch keeps the root and its flattened meshes on every mesh sliced from it
    (``_get_root_mesh``, ``_flatten_mapping``: torch 2.13 and 2.14); a mesh without them
    stands for itself, with no flattened dimensions.
    """
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else mesh
    ranks = root.mesh.cpu().numpy()
    names = root.mesh_dim_names or tuple(range(ranks.ndim))
    found = [
        (names[dim], np.moveaxis(ranks, dim, -1).reshape(-1, ranks.shape[dim]).tolist(),
         root.get_group(dim))
        for dim in range(ranks.ndim)
    ]
    for name, flat in getattr(root, "_flatten_mapping", {}).items():
        # Every line of the flattened dimension, as torch made its groups from them.
        lines = flat._layout.remap_to_tensor(flat._rank_map).reshape(-1, flat.size())
        found.append((name, lines.tolist(), flat.get_group()))
    return found


def _tpu_backend(group: Any) -> Any:
    """The "tpu" process group behind torch's ``group`` (one with ``set_family``), or None."""
    if hasattr(group, "set_family"):
        return group
    try:
        import torch

        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 (no CPU backend: not a "tpu" group)
        return None
    return backend if hasattr(backend, "set_family") else None


def _groups_in_mesh_order(ranks: np.ndarray, mesh_dim_names: Sequence[str] | None) -> list:
    """This rank's process group along each axis of ``ranks``, group rank = mesh position.

    A planned mesh lists an axis's ranks in ring order (``[0, 2, 3, 1]``), and DTensor takes a
    rank's coordinate on an axis to be its rank in that axis's group. torch's own
    ``DeviceMesh(...)`` builds its groups with ``new_group``'s default ``sort_ranks=True``, so
    on such a mesh the two disagree and some redistributions return wrong values, on every
    backend (seen with gloo on torch 2.13: ``[Shard(0), Shard(1)] -> [Replicate(), Shard(0)]``
    on ``[[0, 2, 3, 1], [4, 6, 7, 5]]``). Groups made here keep the mesh's order.

    Every rank creates every group of every axis, in the same order, as torch's DeviceMesh
    does: torch then names them from a counter all ranks share, the same on every rank. (A
    group made with ``use_local_synchronization`` is named from its ranks and how many groups
    *this rank* belongs to: two members that had joined different numbers of groups before
    gave it different names and waited for each other forever.) Creating a group this rank
    is not in costs about 70 us (2,047 of them: 0.14 s). An axis that is the whole world in
    rank order is the default group, as in torch.
    """
    import torch.distributed as dist

    me = dist.get_rank()
    world = list(range(dist.get_world_size()))
    names = mesh_dim_names or [f"dim_{axis}" for axis in range(ranks.ndim)]
    mine = []
    for axis in range(ranks.ndim):
        lines = np.moveaxis(ranks, axis, -1).reshape(-1, ranks.shape[axis]).tolist()
        if lines == [world]:
            mine.append(dist.group.WORLD)
            continue
        found = None
        for line in lines:
            group = dist.new_group(
                ranks=line, sort_ranks=False, group_desc=f"mesh_{names[axis]}"
            )
            if me in line:
                found = group
        mine.append(found)
    return mine


def mesh_to_jax(mesh: DeviceMesh, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """The same layout as a ``jax.sharding.Mesh``: position for position, rank ``r`` -> its device.

    Works for a sub-mesh too (``mesh["tp"]``): its ranks' devices, in its layout. Axis names
    are ``mesh.mesh_dim_names``, or ``axis0``, ``axis1``, ... when the mesh has none.

    Args:
        mesh: A torch ``DeviceMesh`` (from :func:`init_device_mesh` or any other).
        devices: The JAX device of each global rank, indexed by rank; default:
            the default "tpu" process group's (:func:`world_devices`).

    Raises:
        RuntimeError: ``devices`` not given and the "tpu" backend has not started.
        ValueError: a rank of the mesh has no device.
    """
    import jax

    if devices is None:
        devices = world_devices()
        if devices is None:
            raise RuntimeError(
                "mesh_to_jax needs the JAX device of each rank: call "
                "dist.init_process_group('tpu') first (a gloo world has no JAX devices), or "
                "pass devices= (one per global rank)."
            )
    ranks = mesh.mesh.cpu().numpy()
    if ranks.size and (ranks.min() < 0 or ranks.max() >= len(devices)):
        raise ValueError(
            f"the mesh holds ranks {ranks.min()}..{ranks.max()}, but devices has "
            f"{len(devices)} entries (one per global rank)"
        )
    array = np.empty(ranks.shape, dtype=object)
    for index, rank in np.ndenumerate(ranks):
        array[index] = devices[int(rank)]
    names = mesh.mesh_dim_names or tuple(f"axis{k}" for k in range(ranks.ndim))
    return jax.sharding.Mesh(array, tuple(names))


def _check_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise ValueError(f"mesh_dim_names must be a sequence of names, got the string {names!r}")
    names = tuple(names)
    if len(names) != ndim or len(set(names)) != len(names) or not all(
        isinstance(n, str) and n for n in names
    ):
        raise ValueError(
            f"mesh_dim_names must be {ndim} distinct non-empty names, one per axis, got {names}"
        )
    return names
