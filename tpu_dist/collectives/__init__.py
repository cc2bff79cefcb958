"""The "tpu" c10d backend: torch.distributed collectives as XLA collective programs.

``import tpu_dist`` registers it; then ``torch.distributed.init_process_group("tpu")``
(env://, tcp:// or file://, as for gloo) creates the default group, starting a
JAX runtime with one process per rank. Every collective of the group runs as a
compiled XLA program over the group's JAX devices: on a TPU slice over ICI,
across slices over DCN, on CPU over XLA's CPU collectives.

Public names:

* :class:`ProcessGroupTPU` - the process group class torch creates.
* :func:`register_backend` - what ``import tpu_dist`` calls (idempotent); it registers under
  ``"tpu_jax"`` (:data:`FALLBACK_BACKEND_NAME`) when another package (TorchTPU) holds ``"tpu"``.
* :func:`registered_name` - the name to pass to ``init_process_group``.
* :func:`make_default_for_cpu` - opt in: tpu_dist becomes torch's default backend for CPU
  tensors (also ``TPU_DIST_DEFAULT_FOR_CPU=1`` at import).
* :func:`set_timeout` - change a group's timeout for later collectives (torch's
  ``_set_pg_timeout`` reaches only gloo and NCCL).
* :func:`global_devices` - the JAX device of each global rank.
* :func:`start_coordination_service` - host JAX's coordination service outside the ranks (what
  tpu-launch's node 0 does), so that rank 0's death does not end the others.
* :func:`compile_count` - how many collective programs this process compiled.
* :func:`program_cache_info` - what the process's compiled programs hold (a
  :class:`ProgramCacheInfo`: programs, bytes, the ``TPU_DIST_PROGRAM_CACHE_MB`` budget past
  which the least recently used are dropped, how many were).
* :class:`ProgramKey` - what decides a collective's XLA program (kind, blocks, params, algorithm);
  :mod:`tpu_dist.collectives.compile_only` compiles one for TPU without a TPU (libtpu).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tpu_dist.collectives._registry import (
    DEFAULT_FOR_CPU_ENV,
    FALLBACK_BACKEND_NAME,
    make_default_for_cpu,
    register_backend,
    registered_name,
)
from tpu_dist.collectives._timeout import set_timeout

if TYPE_CHECKING:
    from tpu_dist.collectives._backend import ProcessGroupTPU
    from tpu_dist.collectives._lowering import ProgramCacheInfo
    from tpu_dist.collectives._runtime import compile_count, global_devices, program_cache_info
    from tpu_dist.collectives._types import ProgramKey
    from tpu_dist.collectives._service import start_coordination_service

# These pull in JAX, so they load on first use: ``import tpu_dist`` stays cheap.
_LAZY = {
    "ProcessGroupTPU": "tpu_dist.collectives._backend",
    "compile_count": "tpu_dist.collectives._runtime",
    "program_cache_info": "tpu_dist.collectives._runtime",
    "ProgramCacheInfo": "tpu_dist.collectives._lowering",
    "ProgramKey": "tpu_dist.collectives._types",
    "global_devices": "tpu_dist.collectives._runtime",
    "start_coordination_service": "tpu_dist.collectives._service",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpu_dist.collectives' has no attribute {name!r}")

__all__ = [
    "DEFAULT_FOR_CPU_ENV",
    "FALLBACK_BACKEND_NAME",
    "ProcessGroupTPU",
    "ProgramCacheInfo",
    "ProgramKey",
    "compile_count",
    "global_devices",
    "make_default_for_cpu",
    "program_cache_info",
    "register_backend",
    "registered_name",
    "set_timeout",
    "start_coordination_service",
]
