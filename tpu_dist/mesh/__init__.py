"""TPU topologies and topology-aware device meshes.

A :class:`Topology` says which TPU chip each rank drives (generation, per-slice torus shape,
slices, hosts); :func:`plan_mesh` lays global ranks out as a mesh whose inner axes ride ICI
between neighbouring chips and whose outer axes cross DCN; :func:`init_device_mesh` and
:func:`mesh_to_jax` give that layout as a torch ``DeviceMesh`` and a ``jax.sharding.Mesh``::

    from tpu_dist.mesh import Topology, plan_mesh, init_device_mesh

    topo = Topology.from_accelerator_type("v5p-128")              # 64 chips, 4x4x4
    ranks = plan_mesh(topo, (4, 16))                               # (4, 16) array of ranks
    mesh = init_device_mesh((2, 4), mesh_dim_names=("dp", "tp"))   # on the running world

CPU-emulated ranks get virtual chips from ``TPU_DIST_TOPOLOGY`` / ``TPU_DIST_NUM_SLICES``
(see :func:`current_topology`). :func:`register_mesh` tells the "tpu" backend that a mesh
dimension's groups form a family (one program over the family's devices: what TPU v5e and v6e
need; :func:`init_device_mesh` does it itself). ``python -m tpu_dist.mesh --help`` prints plans.
:func:`expected_busbw` bounds what a collective over a group can reach on the topology's links
(the model ``tpu-dist-bench`` and compile-only estimates use); :func:`tpu_attached` says whether
this host has a TPU (the one answer the launcher and the backend use).
"""

from __future__ import annotations

from tpu_dist.mesh._device_mesh import (
    NUM_SLICES_ENV,
    TOPOLOGY_ENV,
    current_topology,
    init_device_mesh,
    mesh_to_jax,
    register_mesh,
)
from tpu_dist.mesh._bandwidth import BUS_FACTORS, Expectation, bus_factor, expected_busbw
from tpu_dist.mesh._host import count_local_tpu_chips, tpu_attached, tpu_device_files
from tpu_dist.mesh._layout import plan_mesh
from tpu_dist.mesh._generations import (
    Generation,
    generation_of_device_kind,
    generations,
    get_generation,
    register_generation,
)
from tpu_dist.mesh._topology import Chip, Topology

__all__ = [
    "BUS_FACTORS",
    "NUM_SLICES_ENV",
    "TOPOLOGY_ENV",
    "Chip",
    "Expectation",
    "Generation",
    "Topology",
    "bus_factor",
    "count_local_tpu_chips",
    "current_topology",
    "expected_busbw",
    "generation_of_device_kind",
    "generations",
    "get_generation",
    "init_device_mesh",
    "mesh_to_jax",
    "plan_mesh",
    "register_generation",
    "register_mesh",
    "tpu_attached",
    "tpu_device_files",
]
