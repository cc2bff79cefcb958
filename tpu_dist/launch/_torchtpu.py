"""The environment TorchTPU's workers need (``--runtime torchtpu``), computed per host (pure).

TorchTPU (``torch-tpu``) ships no launcher: ``torch_tpu._internal.distributed.distributed.
set_tpu_launch_env()`` fills a few variables for ``torchrun``, and its runtime reads, in every
worker (besides torch's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, which torch.distributed.elastic sets):

``TORCH_TPU_SLICEBUILDER_ADDRESSES``
    one ``host:port`` per TPU device of the slice, the same list on every worker: the slice's
    hosts in ``TPU_WORKER_HOSTNAMES`` order, each with ports ``TORCH_TPU_BASE_PORT`` (8070)
    + 0 .. devices per host - 1. TorchTPU takes its task id as ``RANK % len(addresses)``, so the
    address at that index must be on the worker's own host: it is, because a host's node rank is
    slice id x hosts per slice + its worker id and ``RANK`` = node rank x workers per host +
    local rank.
``TORCH_TPU_TOPOLOGY``
    the whole slice's chip grid, ``x,y,z``, with a fourth dimension for the TensorCores of a
    chip on TPU7x (``4,4,8,2``). (TorchTPU's own single-host table: ``2,2,1`` for 4 v4/v5p
    chips, ``2,4,1`` for 8 v5e/v6e chips, ``2,2,1,2`` for 8 TPU7x devices.)
``TORCH_TPU_DEVICES_PER_HOST``
    TPU devices per host: the workers of one host (one per device; two per chip on TPU7x).

Multislice: ``MEGASCALE_NUM_SLICES``, ``MEGASCALE_SLICE_ID`` and
``MEGASCALE_COORDINATOR_ADDRESS`` as libtpu reads them: the platform's values when it set them
(passed through; a coordinator without a port is reported), else tpu-launch's: the coordinator
is the master address with port 8080, since libtpu would otherwise append each process's own
``MEGASCALE_PORT``. The addresses above list only this
slice's hosts.

Not set, because TorchTPU's runtime overwrites them itself at start-up: ``TPU_VISIBLE_CHIPS``,
``TPU_PROCESS_BOUNDS``, ``TPU_PROCESS_ADDRESSES``, ``TPU_PROCESS_PORT``,
``TPU_CHIPS_PER_PROCESS_BOUNDS``, ``CLOUD_TPU_TASK_ID``. Nor ``TORCH_TPU_XPROF_SESSION_ID``
(a profiling session id every host must agree on; set it yourself when profiling).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpu_dist.launch._config import LaunchSpec

__all__ = ["DEFAULT_TORCH_TPU_BASE_PORT", "MEGASCALE_PORT", "torchtpu_vars"]

DEFAULT_TORCH_TPU_BASE_PORT = 8070
"""TorchTPU's default first slice-builder port (``TORCH_TPU_BASE_PORT`` overrides it)."""
MEGASCALE_PORT = 8080
"""The port tpu-launch gives ``MEGASCALE_COORDINATOR_ADDRESS`` when it has none."""


def torchtpu_vars(
    spec: LaunchSpec, node_rank: int, environ: Mapping[str, str], notes: list[str]
) -> dict[str, str]:
    """The ``TORCH_TPU_*`` (and multislice ``MEGASCALE_*``) variables of host ``node_rank``.

    The same for every worker of the host. Problems that leave a variable unset are appended
    to ``notes``.
    """
    assert spec.slice is not None  # resolve() refuses torchtpu without a known slice
    shape = spec.slice
    out: dict[str, str] = {}
    per_host = spec.nproc_per_node
    dims = list(shape.bounds) + ([shape.devices_per_chip] if shape.devices_per_chip > 1 else [])
    out["TORCH_TPU_TOPOLOGY"] = ",".join(str(d) for d in dims)
    out["TORCH_TPU_DEVICES_PER_HOST"] = str(per_host)
    raw_port = environ.get("TORCH_TPU_BASE_PORT", str(DEFAULT_TORCH_TPU_BASE_PORT))
    try:
        base_port = int(raw_port)
    except ValueError:
        raise ValueError(
            f"TORCH_TPU_BASE_PORT={raw_port!r} is not a port number (TorchTPU's default is "
            f"{DEFAULT_TORCH_TPU_BASE_PORT})"
        ) from None
    if len(spec.worker_hostnames) > 1:
        hosts: list[str] | None = list(spec.worker_hostnames)
    elif spec.hosts_per_slice <= 1:
        hosts = ["localhost"]
    else:
        hosts = None
        notes.append(
            "TORCH_TPU_SLICEBUILDER_ADDRESSES is not set: the slice has several hosts but their "
            "names are unknown (set TPU_WORKER_HOSTNAMES)"
        )
    if hosts is not None:
        out["TORCH_TPU_SLICEBUILDER_ADDRESSES"] = ",".join(
            f"{host}:{base_port + i}" for host in hosts for i in range(per_host)
        )
    if spec.num_slices > 1:
        # The platform's values (GKE, queued resources) reach the workers as they are; the
        # launcher fills in only what is missing (e.g. --num-slices on hosts it did not set).
        coordinator = environ.get("MEGASCALE_COORDINATOR_ADDRESS")
        if coordinator is None:
            out["MEGASCALE_COORDINATOR_ADDRESS"] = f"{spec.master_addr}:{MEGASCALE_PORT}"
        elif coordinator.count(":") == 0:
            notes.append(
                f"MEGASCALE_COORDINATOR_ADDRESS={coordinator!r} has no port: libtpu then appends "
                "each process's own MEGASCALE_PORT, and TorchTPU asks for host:port (e.g. "
                f"{coordinator}:{MEGASCALE_PORT})"
            )
        if "MEGASCALE_NUM_SLICES" not in environ:
            out["MEGASCALE_NUM_SLICES"] = str(spec.num_slices)
        if "MEGASCALE_SLICE_ID" not in environ:
            out["MEGASCALE_SLICE_ID"] = str(node_rank // spec.hosts_per_slice)
    return out
