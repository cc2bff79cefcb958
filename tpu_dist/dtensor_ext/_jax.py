"""DTensor <-> ``jax.Array``: the same global array, laid out on the same devices.

A DTensor on a ``DeviceMesh`` of the "tpu" backend and a ``jax.Array`` with a ``NamedSharding``
over :func:`tpu_dist.mesh.mesh_to_jax` of that mesh describe the same thing: rank ``r``'s
local shard is the array's shard on JAX device ``global_devices()[r]``. Converting is
therefore local: no rank sends anything (except ``reduce_partial=True``, which all-reduces
first). On the CPU platform the local shard changes hands through DLPack without a copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from tpu_dist.dtensor_ext._spec import placements_to_spec, spec_to_placements

if TYPE_CHECKING:
    import jax
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["from_jax", "to_jax"]


def to_jax(dtensor: DTensor, *, reduce_partial: bool = False) -> jax.Array:
    """The DTensor as a global ``jax.Array`` sharded the same way.

    The array's sharding is ``NamedSharding(mesh_to_jax(dtensor.device_mesh),
    placements_to_spec(dtensor.placements, dtensor.device_mesh, dtensor.ndim))``; its shape
    and dtype are the DTensor's (64-bit dtypes stay 64-bit, whatever ``jax_enable_x64`` says).
    Autograd does not follow the data into JAX.

    Zero-copy: on the CPU platform the array's local shard is the DTensor's local tensor
    itself, handed over with DLPack. It therefore sees later in-place changes to that tensor
    (an optimizer step, for instance): convert after the update, or pass ``.clone()``d data
    if you need a snapshot. XLA copies instead when the storage is not 64-byte aligned, and
    this function copies when the local tensor is not contiguous. On TPU the shard is copied
    to the device.

    SPMD: every rank of the DTensor's mesh calls it; nothing is communicated unless
    ``reduce_partial=True`` meets a ``Partial`` placement. A (dp=2, tp=2) mesh of ranks
    ``[[0, 1], [2, 3]]``, ``x`` of shape (4, 6) with placements (Shard(0), Shard(1))::

        rank  local shard of x     jax device of the shard   array.sharding.spec
        0     x[0:2, 0:3]          global_devices()[0]       P("dp", "tp")
        1     x[0:2, 3:6]          global_devices()[1]       P("dp", "tp")
        2     x[2:4, 0:3]          global_devices()[2]       P("dp", "tp")
        3     x[2:4, 3:6]          global_devices()[3]       P("dp", "tp")

    Args:
        dtensor: A DTensor on a mesh of the running "tpu" backend.
        reduce_partial: When the DTensor has ``Partial`` placements, all-reduce them to
            ``Replicate`` first (one collective per partial mesh axis, every rank of the mesh
            must call). False: a ``Partial`` placement is a ``ValueError``.

    Raises:
        TypeError: ``dtensor`` is not a DTensor.
        ValueError: a ``Partial`` placement without ``reduce_partial``; uneven sharding (a
            NamedSharding splits every sharded dim evenly: pad the dim to a multiple of the
            axis sizes, or redistribute it to ``Replicate``).
        RuntimeError: the "tpu" backend has not started (no JAX devices to place shards on).
    """
    import jax
    from jax.sharding import NamedSharding

    from tpu_dist.collectives import global_devices
    from tpu_dist.mesh import mesh_to_jax

    if not isinstance(dtensor, DTensor):
        raise TypeError(f"to_jax expects a DTensor, got {type(dtensor).__name__}")
    mesh = dtensor.device_mesh
    if any(p.is_partial() for p in dtensor.placements):
        if not reduce_partial:
            partial = [
                (m, p) for m, p in enumerate(dtensor.placements) if p.is_partial()
            ]
            raise ValueError(
                f"the DTensor has Partial placements {partial} (mesh axis, placement): a "
                "jax NamedSharding cannot hold unreduced values. Pass reduce_partial=True "
                "to all-reduce them to Replicate() first, or redistribute yourself."
            )
        dtensor = dtensor.redistribute(
            mesh, [Replicate() if p.is_partial() else p for p in dtensor.placements]
        )
    shape = tuple(dtensor.shape)
    sharding = NamedSharding(
        mesh_to_jax(mesh), placements_to_spec(dtensor.placements, mesh, dtensor.ndim)
    )
    try:
        shard_shape = tuple(sharding.shard_shape(shape))
    except ValueError as err:
        raise ValueError(
            f"a DTensor of shape {shape} with placements {dtensor.placements} on a mesh of "
            f"shape {tuple(mesh.shape)} is sharded unevenly, which a jax NamedSharding "
            "cannot express; pad the sharded dims to a multiple of the mesh axis sizes or "
            f"redistribute them to Replicate() ({err})"
        ) from err
    arrays = []
    if mesh.get_coordinate() is not None:
        local = dtensor.to_local().detach().resolve_conj().resolve_neg()
        if tuple(local.shape) != shard_shape:  # uneven in a way shard_shape accepted
            raise ValueError(
                f"this rank's shard has shape {tuple(local.shape)}, but {sharding.spec} on "
                f"the mesh gives every device a shard of shape {shard_shape}; pad the "
                "sharded dims to a multiple of the mesh axis sizes"
            )
        device = global_devices()[dist.get_rank()]
        with jax.enable_x64(True):
            arrays.append(_tensor_to_device(local.contiguous(), device))
    with jax.enable_x64(True):
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def from_jax(array: jax.Array, device_mesh: DeviceMesh, *, copy: bool = False) -> DTensor:
    """A ``jax.Array`` with a ``NamedSharding`` as a DTensor on ``device_mesh``.

    The placements are ``spec_to_placements(array.sharding.spec, device_mesh)``, reading the
    spec's axes by position: the array's mesh must put the same devices at the same places as
    ``mesh_to_jax(device_mesh)`` (axis names may differ). The DTensor's local tensor is this
    rank's shard of the array.

    Zero-copy by default: on the CPU platform the local tensor shares memory with the JAX
    shard (DLPack). JAX assumes its buffers never change, so do not modify the DTensor in
    place while the array is still in use, or pass ``copy=True``. On TPU the shard is copied
    to host memory.

    SPMD: every rank of ``device_mesh`` calls it with its part of the same global array;
    nothing is communicated. The result requires no grad (``.requires_grad_()`` it, or wrap in
    ``nn.Parameter``).

    Args:
        array: A global ``jax.Array`` whose sharding is a ``NamedSharding`` (a jitted
            function's output on ``mesh_to_jax(device_mesh)``, or :func:`to_jax`'s).
        device_mesh: The torch ``DeviceMesh`` to put the DTensor on.
        copy: Give the DTensor its own copy of the data.

    Raises:
        TypeError: ``array`` is not a ``jax.Array`` or its sharding is not a
            ``NamedSharding``.
        ValueError: the array's mesh lays out other devices than ``device_mesh``; the spec
            has ``unreduced`` axes.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from tpu_dist.mesh import mesh_to_jax

    if not isinstance(array, jax.Array):
        raise TypeError(f"from_jax expects a jax.Array, got {type(array).__name__}")
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"from_jax needs an array with a NamedSharding, got {type(sharding).__name__}; "
            "produce it with jax.jit(..., out_shardings=NamedSharding(mesh_to_jax(mesh), "
            "spec)) or jax.device_put onto such a sharding"
        )
    target = mesh_to_jax(device_mesh)
    source_ids = np.vectorize(lambda d: d.id, otypes=[int])(sharding.mesh.devices)
    target_ids = np.vectorize(lambda d: d.id, otypes=[int])(target.devices)
    if source_ids.shape != target_ids.shape or not np.array_equal(source_ids, target_ids):
        raise ValueError(
            f"the array lives on a mesh of devices {source_ids.tolist()} (axes "
            f"{sharding.mesh.axis_names}), but device_mesh lays out devices "
            f"{target_ids.tolist()} (axes {target.axis_names}); reshard the array onto "
            "NamedSharding(tpu_dist.mesh.mesh_to_jax(device_mesh), spec) first"
        )
    rename = dict(zip(sharding.mesh.axis_names, target.axis_names))
    spec = sharding.spec
    for attr in ("unreduced", "reduced"):
        if getattr(spec, attr, None):
            spec_to_placements(spec, target)  # raises the error that explains it
    entries = [
        entry
        if entry is None or entry is PartitionSpec.UNCONSTRAINED
        else rename[entry]
        if isinstance(entry, str)
        else tuple(rename[a] for a in entry)
        for entry in tuple(spec)
    ]
    placements = spec_to_placements(PartitionSpec(*entries), target)
    shards = array.addressable_shards
    if len(shards) > 1:
        raise ValueError(
            f"this process holds {len(shards)} shards of the array; from_jax expects one "
            "JAX device per rank, as the 'tpu' backend runs"
        )
    if shards:
        local = _device_to_tensor(shards[0].data)
        if copy:
            local = local.clone()
    else:  # This rank is not in the mesh: an empty local tensor, as DTensor uses.
        local = torch.empty(0, dtype=_torch_dtype(array.dtype))
    return DTensor.from_local(
        local,
        device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(array.shape),
        stride=_contiguous_strides(tuple(array.shape)),
    )


def _tensor_to_device(tensor: torch.Tensor, device: Any) -> jax.Array:
    """A contiguous CPU tensor as a single-device JAX array (DLPack on CPU, else a copy)."""
    import jax

    if device.platform == "cpu":
        return jax.dlpack.from_dlpack(tensor, device=device)
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        host = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        host = tensor.numpy()
    return jax.device_put(host, device)


def _device_to_tensor(array: jax.Array) -> torch.Tensor:
    """A single-device JAX array as a CPU tensor (DLPack on CPU, else a copy)."""
    import jax

    if next(iter(array.devices())).platform == "cpu":
        return torch.from_dlpack(array)
    host = np.asarray(jax.device_get(array))
    if host.dtype.name == "bfloat16":
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def _torch_dtype(dtype: Any) -> torch.dtype:
    if np.dtype(dtype).name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
