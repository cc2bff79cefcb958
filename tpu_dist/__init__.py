"""tpu_dist: PyTorch's torch.distributed stack on TPU pods, through JAX/XLA collectives.

``import tpu_dist`` registers the c10d backend "tpu" (see
:mod:`tpu_dist.collectives`; "tpu_jax" when another package such as TorchTPU holds "tpu");
nothing else in torch is changed, unless ``TPU_DIST_DEFAULT_FOR_CPU=1`` asks to make it torch's
default backend for CPU tensors (:func:`tpu_dist.collectives.make_default_for_cpu`). Where
tpu-dist is installed, ``import torch`` already registers the name through torch's
device-backend autoload (the ``torch.backends`` entry point, the top-level module
``_tpu_dist_autoload``) with a creator that imports this package when the first group is
created; ``import tpu_dist`` then registers its own creator in its place. Subpackages:

* :mod:`tpu_dist.collectives` - the "tpu" process group.
* :mod:`tpu_dist.mesh` - TPU topologies and topology-aware device meshes.
* :mod:`tpu_dist.dtensor_ext` - DTensor <-> JAX interop.
* :mod:`tpu_dist.compile_job` - compile-only mode: a job's collectives compiled for a TPU
  topology without a TPU (``tpu-launch --compile-only``).
* :mod:`tpu_dist.launch` - ``tpu-launch``, the multi-host runner.

The layers, lowest first (each imports only those below it; ``tests/test_layers.py`` checks):
``mesh`` < ``collectives`` < ``dtensor_ext``, ``compile_job`` < ``launch`` < ``bench``;
``docs/architecture.md`` has the map and the life of one collective.
"""

from __future__ import annotations

import contextlib as _contextlib
import sys as _sys

from tpu_dist import _process

# When this import is the one that imports torch (tpu-launch, ``python -m tpu_dist...``), the
# cyclic collector is paused until it is done: the import creates ~170,000 objects, and the
# collector would run about 360 times meanwhile (0.14-0.18 of the 1.7-2.2 CPU-s it costs;
# docs/decisions/0018-import-pauses-and-freezes-the-collector.md). Those objects (torch's
# modules, mostly) then go to the collector's permanent generation (``gc.freeze``): left in the
# youngest generation, they were scanned again by the next collections of each generation, 0.2
# CPU-s of each launcher (the same record). The collector runs as usual afterwards, on
# everything created after the import.
with _process.gc_paused(freeze=True) if "torch" not in _sys.modules else _contextlib.nullcontext():
    from tpu_dist import _settings
    from tpu_dist.collectives import register_backend
del _contextlib, _sys

__version__ = "0.1.0"

BACKEND = register_backend()
"""The name the backend is registered under ("tpu" unless TPU_DIST_BACKEND_NAME is set, "tpu_jax"
when the name was taken; see :func:`tpu_dist.collectives.registered_name`)."""

if _settings.COMPILE_ONLY.get():  # tpu-launch --compile-only: "tpu" groups record, not run
    from tpu_dist import compile_job

    compile_job.activate()

__all__ = ["BACKEND", "__version__"]
