"""DTensor extensions for the "tpu" backend: DTensor <-> ``jax.Array``, placements <-> specs.

A DTensor on a torch ``DeviceMesh`` and a ``jax.Array`` with a ``NamedSharding`` on
:func:`tpu_dist.mesh.mesh_to_jax` of that mesh are the same global array on the same devices,
so a DTensor can be handed to a jitted JAX function and the result taken back, shard for
shard, without communication::

    import jax
    import torch
    from torch.distributed.tensor import distribute_tensor, Shard
    from tpu_dist.dtensor_ext import from_jax, to_jax
    from tpu_dist.mesh import init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
    arr = to_jax(x)                    # NamedSharding(mesh_to_jax(mesh), P("dp", "tp"))
    y = from_jax(jax.jit(jax.nn.relu)(arr), mesh)   # DTensor, (Shard(0), Shard(1))

Public names:

* :func:`to_jax` / :func:`from_jax` - the conversions (local shards change hands through
  DLPack, zero-copy on CPU).
* :func:`placements_to_spec` / :func:`spec_to_placements` - the layout mapping, pure logic.
  ``Partial`` has no ``NamedSharding`` equivalent: converting it is a ``ValueError`` unless
  ``to_jax(..., reduce_partial=True)`` is asked to all-reduce first.
* :func:`redistribute` - ``DTensor.redistribute`` with every ``Shard(i) -> Shard(j)`` step
  done by one ``all_to_all_single`` (DTensor itself all-gathers the whole dim on meshes whose
  device type is "cpu", as the "tpu" backend's are; torch has no hook to change that).

The axis names of a ``DeviceMesh`` without ``mesh_dim_names`` are ``axis0``, ``axis1``, ...,
as :func:`tpu_dist.mesh.mesh_to_jax` names them.
"""

from __future__ import annotations

from tpu_dist.dtensor_ext._jax import from_jax, to_jax
from tpu_dist.dtensor_ext._redistribute import redistribute
from tpu_dist.dtensor_ext._spec import placements_to_spec, spec_to_placements

__all__ = [
    "from_jax",
    "placements_to_spec",
    "redistribute",
    "spec_to_placements",
    "to_jax",
]
