"""Registering the backend with torch.distributed, once per process."""

from __future__ import annotations

import logging
import os
import warnings

import torch.distributed as dist


logger = logging.getLogger(__name__)

BACKEND_NAME_ENV = "TPU_DIST_BACKEND_NAME"
DEFAULT_BACKEND_NAME = "tpu"

_registered_name: str | None = None


def _create_process_group(
    dist_opts: dist.distributed_c10d._DistributedBackendOptions, backend_opts: object
) -> dist.ProcessGroup:
    """The creator torch calls for every new "tpu" group (extended API).

    JAX is imported here, not when tpu_dist is imported, so that importing
    tpu_dist (the launcher, tools) stays cheap.
    """
    from tpu_dist.collectives import _runtime, _watchdog, flight_recorder
    from tpu_dist.collectives._backend import ProcessGroupTPU

    rank, size = dist_opts.group_rank, dist_opts.group_size
    global_ranks = list(dist_opts.global_ranks_in_group)
    if not global_ranks:
        # The default group (torch passes no ranks for it): start JAX, or check
        # that the running JAX runtime has this world.
        _runtime.start(dist_opts.store, rank, size, dist_opts.timeout)
        _watchdog.start(dist_opts.store, rank, size)
        flight_recorder.install_signal_handler(rank)
        global_ranks = list(range(size))
    elif _runtime.info() is None:
        raise RuntimeError(
            "tpu_dist: the first 'tpu' process group must be the default group "
            "(init_process_group('tpu')); got a subgroup of global ranks "
            f"{global_ranks}."
        )
    return ProcessGroupTPU(rank, size, global_ranks, dist_opts.timeout)


def register_backend() -> str:
    """Register tpu_dist's process group with torch.distributed; returns its name.

    The name is "tpu", or ``TPU_DIST_BACKEND_NAME`` when set. Calling it again
    is a no-op. If another package already registered the name (TorchTPU
    registers "tpu" for its own device), tpu_dist does not replace it: it
    warns and stays unregistered; set ``TPU_DIST_BACKEND_NAME`` (e.g.
    ``tpu_dist``) and pass that name to ``init_process_group``.
    """
    global _registered_name
    if _registered_name is not None:
        return _registered_name
    name = os.environ.get(BACKEND_NAME_ENV, DEFAULT_BACKEND_NAME).strip().lower()
    if not name.isidentifier():
        raise ValueError(
            f"{BACKEND_NAME_ENV}={name!r} is not a usable backend name; use a short "
            "identifier such as 'tpu_dist'."
        )
    existing = dist.Backend._plugins.get(name.upper())
    builtin = name in (dist.Backend.GLOO, dist.Backend.NCCL, dist.Backend.MPI, "ucc", "xccl")
    if builtin or (existing is not None and existing.creator_fn is not _create_process_group):
        owner = "torch itself" if builtin else getattr(existing.creator_fn, "__module__", "?")
        warnings.warn(
            f"tpu_dist: the torch.distributed backend name {name!r} is already "
            f"registered by {owner}; tpu_dist did not replace it. Set "
            f"{BACKEND_NAME_ENV}=tpu_dist (or another free name) before importing "
            "tpu_dist and pass that name to init_process_group.",
            RuntimeWarning,
            stacklevel=3,
        )
        return ""
    dist.Backend.register_backend(
        name, _create_process_group, extended_api=True, devices=["cpu"]
    )
    _registered_name = name
    return name


def registered_name() -> str | None:
    """The name tpu_dist's backend is registered under, or None."""
    return _registered_name
