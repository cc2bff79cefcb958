"""tpu_dist: PyTorch's torch.distributed stack on TPU pods, through JAX/XLA collectives.

``import tpu_dist`` registers the c10d backend "tpu" (see
:mod:`tpu_dist.collectives`); nothing else in torch is changed. Subpackages:

* :mod:`tpu_dist.collectives` - the "tpu" process group.
* :mod:`tpu_dist.mesh` - TPU topologies and topology-aware device meshes.
* :mod:`tpu_dist.dtensor_ext` - DTensor <-> JAX interop.
* :mod:`tpu_dist.launch` - ``tpu-launch``, the multi-host runner.
"""

from __future__ import annotations

from tpu_dist.collectives import register_backend

__version__ = "0.1.0"

BACKEND = register_backend()
"""The name the backend is registered under ("tpu" unless TPU_DIST_BACKEND_NAME is set)."""

__all__ = ["BACKEND", "__version__"]
