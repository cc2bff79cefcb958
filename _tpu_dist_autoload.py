"""tpu_dist's hook in torch's device-backend autoload (the ``torch.backends`` entry point).

torch calls :func:`register` inside ``import torch``, in every process of an environment where
tpu-dist is installed, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch's switch for every such
hook; TorchTPU loads the same way). It registers the c10d backend name ``"tpu"`` with a creator
that imports tpu_dist only when the first group of that backend is created, so that
``init_process_group("tpu")`` works in a program that never imports tpu_dist (a framework run
with ``torchrun -m trainer``). It imports no part of tpu_dist and no JAX, sets no environment
variable and leaves torch's default backends alone: a process that never creates a "tpu" group
is as without tpu_dist, apart from the name in ``torch.distributed.Backend.backend_list``.

What it registers:

* ``"tpu"`` (or ``TPU_DIST_BACKEND_NAME``), or tpu_dist's fallback name ``"tpu_jax"`` when
  another package holds it already (TorchTPU on a TPU host, when its hook ran first); nothing
  when both are taken. No warning here: ``import tpu_dist`` says which name it took, as it always
  did, and registers its own creator over this one. A package that registers the name after
  this hook (TorchTPU's hook running second) replaces it, and ``import tpu_dist`` then takes
  ``"tpu_jax"``, as when TorchTPU was loaded first.
* When ``TPU_DIST_DEFAULT_FOR_CPU`` is set (``1``: make tpu_dist torch's default backend for CPU
  tensors), the hook imports tpu_dist itself (about 15 ms after torch), which applies it as
  ``import tpu_dist`` does: a framework that picks the backend itself then gets tpu_dist with
  no code change. A malformed value then fails ``import torch``, naming the variable.

This module lives outside the ``tpu_dist`` package on purpose: importing ``tpu_dist._anything``
would run ``tpu_dist/__init__.py``, which registers for real and warns, inside ``import torch``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["register"]

# The names below are tpu_dist's (tpu_dist._settings, tpu_dist.collectives); this module cannot
# import them without running tpu_dist/__init__.py. tests/test_frameworks.py checks they agree.
DEFAULT_FOR_CPU_ENV = "TPU_DIST_DEFAULT_FOR_CPU"
"""Set: the hook imports tpu_dist, which applies it."""
BACKEND_NAME_ENV = "TPU_DIST_BACKEND_NAME"
"""The name to register (``import tpu_dist`` rejects a malformed one; the hook then registers none)."""
DEFAULT_NAME = "tpu"
FALLBACK_NAME = "tpu_jax"


def register() -> None:
    """Register tpu_dist's backend name with a creator that imports tpu_dist on first use.

    Called by torch (``torch._import_device_backends``) inside ``import torch``; does nothing
    when tpu_dist is being imported already (it imported torch, and registers itself next).
    """
    if "tpu_dist" in sys.modules:
        return
    if os.environ.get(DEFAULT_FOR_CPU_ENV):
        import tpu_dist  # noqa: F401  (registers, and applies the variable)

        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    wanted = (os.environ.get(BACKEND_NAME_ENV) or DEFAULT_NAME).strip().lower()
    if not wanted.isidentifier():
        return
    for name in dict.fromkeys((wanted, FALLBACK_NAME)):
        if name.upper() not in dist.Backend._plugins and not hasattr(dist.Backend, name.upper()):
            dist.Backend.register_backend(
                name, create_process_group, extended_api=True, devices=["cpu"]
            )
            return


def create_process_group(dist_opts: object, backend_opts: object) -> object:
    """The creator torch calls for the first group: import tpu_dist (which registers its own
    creator in place of this one) and create the group with it."""
    import tpu_dist  # noqa: F401
    from tpu_dist.collectives import _registry

    return _registry._create_process_group(dist_opts, backend_opts)
