"""The "tpu" c10d backend: torch.distributed collectives as XLA collective programs.

``import tpu_dist`` registers it; then ``torch.distributed.init_process_group("tpu")``
(env://, tcp:// or file://, as for gloo) creates the default group, starting a
JAX runtime with one process per rank. Every collective of the group runs as a
compiled XLA program over the group's JAX devices: on a TPU slice over ICI,
across slices over DCN, on CPU over XLA's CPU collectives.

Public names:

* :class:`ProcessGroupTPU` - the process group class torch creates.
* :func:`register_backend` - what ``import tpu_dist`` calls (idempotent).
* :func:`global_devices` - the JAX device of each global rank.
* :func:`compile_count` - how many collective programs this process compiled.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tpu_dist.collectives._registry import register_backend, registered_name

if TYPE_CHECKING:
    from tpu_dist.collectives._backend import ProcessGroupTPU
    from tpu_dist.collectives._lowering import compile_count
    from tpu_dist.collectives._runtime import global_devices

# These pull in JAX, so they load on first use: ``import tpu_dist`` stays cheap.
_LAZY = {
    "ProcessGroupTPU": "tpu_dist.collectives._backend",
    "compile_count": "tpu_dist.collectives._lowering",
    "global_devices": "tpu_dist.collectives._runtime",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpu_dist.collectives' has no attribute {name!r}")

__all__ = [
    "ProcessGroupTPU",
    "compile_count",
    "global_devices",
    "register_backend",
    "registered_name",
]
