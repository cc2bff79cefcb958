"""Registering the backend with torch.distributed, once per process.

Three knobs (the two variables are declared in :mod:`tpu_dist._settings`):

* ``TPU_DIST_BACKEND_NAME`` (default ``"tpu"``): the name to register under.
* the fallback name :data:`FALLBACK_BACKEND_NAME` (``"tpu_jax"``), used when the name is taken
  by another package. TorchTPU registers ``"tpu"`` and ``"tpu_dist"`` for its own ``"tpu"``
  device; ``"tpu_jax"`` is a name it does not use.
* ``TPU_DIST_DEFAULT_FOR_CPU`` (default off): make tpu_dist torch's default backend for CPU
  tensors (:func:`make_default_for_cpu`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from tpu_dist import _process, _settings


logger = logging.getLogger(__name__)


_BACKEND_NAME = _settings.BACKEND_NAME
DEFAULT_FOR_CPU_ENV = _settings.DEFAULT_FOR_CPU.env
"""``"TPU_DIST_DEFAULT_FOR_CPU"``."""
FALLBACK_BACKEND_NAME = "tpu_jax"
"""The name tpu_dist registers under when its own name is taken (by TorchTPU, for instance)."""

_BUILTIN = (dist.Backend.GLOO, dist.Backend.NCCL, dist.Backend.MPI, "ucc", "xccl", "fake",
            "undefined")


PipelineSource = Callable[[int, int, list[int], int], tuple[Sequence, Any]]
"""``(rank, size, global_ranks, world_size) -> (devices, pipeline)`` for a new group
(:mod:`tpu_dist.collectives.pipelines`)."""


def set_pipeline_source(source: PipelineSource | None) -> None:
    """Build every "tpu" group created from now on with ``source``'s devices and pipeline
    instead of the running JAX runtime's; ``None`` restores the backend's own.

    Process-wide (groups already created keep theirs). Compile-only mode
    (:mod:`tpu_dist.compile_job`) installs its recording pipeline this way; no JAX runtime is
    started for such groups and they have no watchdog.
    """
    _process.set_pipeline_source(source)


def pipeline_source() -> PipelineSource | None:
    """The source :func:`set_pipeline_source` installed, if any."""
    return _process.pipeline_source()


def _create_process_group(
    dist_opts: dist.distributed_c10d._DistributedBackendOptions, backend_opts: object
) -> dist.ProcessGroup:
    """The creator torch calls for every new "tpu" group (extended API).

    JAX is imported here, not when tpu_dist is imported, so that importing
    tpu_dist (the launcher, tools) stays cheap.
    """
    from tpu_dist.collectives import _runtime, flight_recorder
    from tpu_dist.collectives._backend import ProcessGroupTPU

    rank, size = dist_opts.group_rank, dist_opts.group_size
    global_ranks = list(dist_opts.global_ranks_in_group)
    source = _process.pipeline_source()
    if source is not None:  # another pipeline (compile-only: record, do not run)
        world_size = size if not global_ranks else dist.get_world_size()
        global_ranks = global_ranks or list(range(size))
        devices, pipeline = source(rank, size, global_ranks, world_size)
        return ProcessGroupTPU(
            rank, size, global_ranks, dist_opts.timeout, devices=devices, pipeline=pipeline
        )
    runtime = _runtime.get()
    if not global_ranks:
        # The default group (torch passes no ranks for it): start JAX, or check
        # that the running JAX runtime has this world.
        runtime.start(dist_opts.store, rank, size, dist_opts.timeout)
        runtime.start_watchdog(dist_opts.store, rank, size, dist_opts.timeout)
        flight_recorder.install_signal_handler(rank)
        global_ranks = list(range(size))
    elif runtime.info is None:
        raise RuntimeError(
            "tpu_dist: the first 'tpu' process group must be the default group "
            "(init_process_group('tpu')); got a subgroup of global ranks "
            f"{global_ranks}."
        )
    every = runtime.global_devices()
    devices = [every[r] for r in global_ranks]
    watchdog = runtime.watchdog
    return ProcessGroupTPU(
        rank, size, global_ranks, dist_opts.timeout, dist_opts.store,
        devices=devices,
        pipeline=runtime.pipeline(devices),
        on_named=watchdog.group_created if watchdog is not None else None,
    )


def _owner(name: str) -> str | None:
    """Who holds backend ``name``: None (free), "tpu_dist", "torch itself" or a module name."""
    if name in _BUILTIN:
        return "torch itself"
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        return None
    # Also tpu_dist's: the lazy creator its torch.backends hook (_tpu_dist_autoload) registers
    # inside `import torch`; registering here replaces it with _create_process_group.
    if plugin.creator_fn is _create_process_group or (
        getattr(plugin.creator_fn, "__module__", None) == "_tpu_dist_autoload"
    ):
        return "tpu_dist"
    return getattr(plugin.creator_fn, "__module__", None) or "another package"


def register_backend() -> str:
    """Register tpu_dist's process group with torch.distributed; returns its name.

    Called by ``import tpu_dist`` in every process; calling it again is a no-op. The name is
    ``TPU_DIST_BACKEND_NAME`` (default ``"tpu"``). When another package already registered
    that name (TorchTPU registers ``"tpu"`` and ``"tpu_dist"`` for its own device when it
    loads inside ``import torch`` on a TPU host), tpu_dist does not replace it: it registers
    under :data:`FALLBACK_BACKEND_NAME` (``"tpu_jax"``) and warns once, naming it. Pass
    :func:`registered_name` to ``init_process_group``. Returns ``""`` only if the fallback is
    taken too (with a warning). With ``TPU_DIST_DEFAULT_FOR_CPU=1`` it then calls
    :func:`make_default_for_cpu`.

    Raises:
        ValueError: ``TPU_DIST_BACKEND_NAME`` or ``TPU_DIST_DEFAULT_FOR_CPU`` is malformed.
    """
    registered = _process.backend_name()
    if registered is not None:
        return registered
    wanted = _BACKEND_NAME.get()
    default_for_cpu = default_for_cpu_from_env()
    chosen = None
    for name in dict.fromkeys((wanted, FALLBACK_BACKEND_NAME)):
        if _owner(name) in (None, "tpu_dist"):
            chosen = name
            break
    if chosen != wanted and _process.first_time(f"{__name__}:name taken"):
        owner = _owner(wanted)
        if chosen is None:
            what = (
                f"{FALLBACK_BACKEND_NAME!r} is taken too ({_owner(FALLBACK_BACKEND_NAME)}), so "
                f"tpu_dist is not registered: set {_BACKEND_NAME.env} to a free name before "
                "importing tpu_dist"
            )
        else:
            what = (
                f"tpu_dist registered as {chosen!r} instead: use "
                f"init_process_group({chosen!r}) (or tpu_dist.collectives.registered_name()) "
                f"for tpu_dist's groups, or 'cpu:{chosen},tpu:{wanted}' to combine both"
            )
        warnings.warn(
            f"tpu_dist: the torch.distributed backend name {wanted!r} is already registered "
            f"by {owner}; tpu_dist did not replace it. {what}.",
            RuntimeWarning,
            stacklevel=3,
        )
    if chosen is None:
        return ""
    dist.Backend.register_backend(
        chosen, _create_process_group, extended_api=True, devices=["cpu"]
    )
    _process.set_backend_name(chosen)
    if default_for_cpu:
        make_default_for_cpu()
    return chosen


def registered_name() -> str | None:
    """The name tpu_dist's backend is registered under (pass it to ``init_process_group``).

    ``"tpu"``, ``TPU_DIST_BACKEND_NAME``, or ``"tpu_jax"`` when the name was taken; None if
    tpu_dist is not registered.

    Raises:
        RuntimeError: another package registered a backend under the same name after
            tpu_dist (torch lets the last registration win), so ``init_process_group`` with
            that name would create the other package's group.
    """
    registered = _process.backend_name()
    if registered is not None and _owner(registered) != "tpu_dist":
        raise RuntimeError(
            f"tpu_dist: the backend name {registered!r} was registered by "
            f"{_owner(registered)} after tpu_dist registered it, and torch now creates "
            f"that package's groups for {registered!r}. Import tpu_dist after it (tpu_dist "
            f"then registers as {FALLBACK_BACKEND_NAME!r}), or set "
            f"{_BACKEND_NAME.env}={FALLBACK_BACKEND_NAME} before importing tpu_dist."
        )
    return registered


def default_for_cpu_from_env() -> bool:
    """``TPU_DIST_DEFAULT_FOR_CPU``: ``1``/``true``/``yes`` or ``0``/``false``/``no`` (default)."""
    return _settings.DEFAULT_FOR_CPU.get()


def make_default_for_cpu() -> str:
    """Make tpu_dist torch's default backend for CPU tensors in this process; returns its name.

    Sets ``torch.distributed.Backend.default_device_backend_map["cpu"]`` (the table torch
    reads to pick a backend for a device type) to tpu_dist's registered name, and logs that it
    did. Then, in this process:

    * ``init_process_group()`` with no backend creates a tpu_dist group on a machine whose
      accelerator is the CPU (``get_backend()`` then says ``"undefined"``, as it does for gloo
      there; ``get_backend_config()`` says ``"cpu:tpu"``);
    * ``get_default_backend_for_device("cpu")`` and the map itself give the name, so code that
      builds ``init_process_group(backend=...)`` from them (``"tpu"``, ``"cpu:tpu"``) gets
      tpu_dist, and ``get_backend()`` says so.

    Off unless called (or ``TPU_DIST_DEFAULT_FOR_CPU=1`` at ``import tpu_dist``; ``tpu-launch
    --default-for-cpu`` sets it for its workers). Every rank should do the same. Call it before
    ``init_process_group``.

    Raises:
        RuntimeError: tpu_dist is not registered (see :func:`register_backend`).
    """
    name = registered_name()
    if not name:
        raise RuntimeError(
            "tpu_dist: cannot make tpu_dist the default backend for CPU tensors: it is not "
            f"registered (its name and {FALLBACK_BACKEND_NAME!r} are taken); set "
            f"{_BACKEND_NAME.env} to a free name before importing tpu_dist."
        )
    previous = dist.Backend.default_device_backend_map.get("cpu")
    if previous != name:
        dist.Backend.default_device_backend_map["cpu"] = name
        logger.warning(
            "tpu_dist: set torch.distributed.Backend.default_device_backend_map['cpu'] = %r "
            "(was %r): groups created without a backend now use tpu_dist.", name, previous
        )
    return name

