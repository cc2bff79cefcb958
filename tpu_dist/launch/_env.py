"""The environment each worker gets, computed from a :class:`~._config.LaunchSpec` (pure).

Three layers, applied in this order:

1. **torch.distributed.elastic** sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
   ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
   ``TORCHELASTIC_*`` per worker, exactly as under torchrun (:func:`elastic_vars` mirrors them for
   ``--dry-run``).
2. **Shared** variables (:attr:`WorkerEnv.shared`), the same for every local worker, exported by
   the launcher: ``TPU_DIST_PLATFORM``, ``TPU_DIST_TOPOLOGY``, ``TPU_DIST_NUM_SLICES``
   (emulation), ``TPU_PROCESS_BOUNDS``, ``TPU_CHIPS_PER_PROCESS_BOUNDS``,
   ``TPU_PROCESS_ADDRESSES`` (TPU), ``OMP_NUM_THREADS``, ``GLIBC_TUNABLES`` and
   ``JAX_PLATFORMS=cpu`` (CPU workers, each unless set),
   ``TPU_DIST_DEFAULT_FOR_CPU`` (``--default-for-cpu``); with ``--runtime torchtpu``, instead
   of the ``TPU_PROCESS_*`` ones, TorchTPU's ``TORCH_TPU_*`` (and ``MEGASCALE_*``) variables
   (:mod:`._torchtpu`).
3. **Per-worker** variables (:attr:`WorkerEnv.per_rank`), set by the worker entry
   (:mod:`._worker`) from ``LOCAL_RANK`` before the user's program starts:
   ``TPU_VISIBLE_CHIPS``, ``TPU_PROCESS_PORT``, ``CLOUD_TPU_TASK_ID``.

The TPU variables follow libtpu's and torch_xla's convention for one chip per process, shown for
host 1 of a ``v4-16`` (2 hosts ``h0,h1``, 4 chips each, base port 8476)::

    TPU_CHIPS_PER_PROCESS_BOUNDS = 1,1,1          every process owns one chip
    TPU_PROCESS_BOUNDS           = 2,2,2          the slice's chip grid = the process grid
    TPU_PROCESS_ADDRESSES        = h0:8476,h0:8477,h0:8478,h0:8479,h1:8476,...,h1:8479
    local rank 2:  TPU_VISIBLE_CHIPS=2  TPU_PROCESS_PORT=8478  CLOUD_TPU_TASK_ID=6 (= 1*4 + 2)

A variable the user set explicitly is never silently overwritten: it wins (and is reported in
:attr:`WorkerEnv.notes` when it differs from the computed value), except the two that back a
flag (``TPU_DIST_TOPOLOGY`` for ``--emulate``, ``TPU_DIST_NUM_SLICES`` for ``--num-slices``),
where the explicit flag wins and the note says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tpu_dist import _settings
from tpu_dist.collectives import DEFAULT_FOR_CPU_ENV
from tpu_dist.launch._config import LaunchSpec
from tpu_dist.launch._torchtpu import torchtpu_vars

__all__ = ["ATTEMPT_VARS", "ELASTIC_VARS", "HUGE_PAGES_TUNABLE", "WorkerEnv", "compute_worker_env", "elastic_vars"]

#: What CPU workers get as ``GLIBC_TUNABLES`` unless it is set: malloc asks the kernel for
#: transparent huge pages (``madvise``) for the chunks it maps (large buffers).
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"

ELASTIC_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""Set per worker by torch.distributed.elastic; a user's value cannot win over these."""

ATTEMPT_VARS = (_settings.COORDINATION_SERVICE.env, _settings.LAUNCH_ATTEMPT.env)
"""Set for every launch attempt by tpu-launch itself (``_rendezvous.PerAttemptStore``): the
attempt's JAX coordination service, which node 0's launcher starts, and the attempt's number. A
user's value cannot win over these either: a fixed service would not be restarted with the job."""

# Variables whose explicit flag beats the environment (the flag's env default is this variable).
_FLAG_BACKED = {_settings.TOPOLOGY.env: "--emulate", _settings.NUM_SLICES.env: "--num-slices"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """The variables tpu-launch adds on top of torch.distributed.elastic's, for one host."""

    shared: Mapping[str, str]
    """Set for every local worker."""
    per_rank: tuple[Mapping[str, str], ...]
    """Indexed by local rank."""
    notes: tuple[str, ...] = ()
    """Conflicts with the user's environment, one sentence each."""

    def for_local_rank(self, local_rank: int) -> dict[str, str]:
        """Shared and per-worker variables of one worker."""
        return {**self.shared, **self.per_rank[local_rank]}


def elastic_vars(spec: LaunchSpec, node_rank: int, local_rank: int) -> dict[str, str]:
    """What elastic will set for one worker under a static rendezvous (for ``--dry-run``)."""
    port = str(spec.master_port) if spec.master_port is not None else "<free port>"
    return {
        "RANK": str(node_rank * spec.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": spec.master_addr if spec.master_port is not None else "<this host>",
        "MASTER_PORT": port,
    }


def _tpu_vars(
    spec: LaunchSpec, worker_id: int, notes: list[str]
) -> tuple[dict[str, str], list[dict[str, str]]]:
    nproc = spec.nproc_per_node
    shared: dict[str, str] = {"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}
    if spec.slice is not None:
        shared["TPU_PROCESS_BOUNDS"] = spec.slice.bounds_str
    else:
        notes.append(
            "TPU_PROCESS_BOUNDS is not set: the accelerator type is unknown (set "
            "TPU_ACCELERATOR_TYPE, or TPU_PROCESS_BOUNDS yourself)"
        )
    hosts_per_slice = (spec.expected_nodes or spec.max_nodes) // spec.num_slices
    if len(spec.worker_hostnames) > 1:
        hosts: list[str] | None = list(spec.worker_hostnames)
    elif hosts_per_slice <= 1:
        hosts = ["localhost"]
    else:
        hosts = None
        notes.append(
            "TPU_PROCESS_ADDRESSES is not set: the slice has several hosts but their names are "
            "unknown (set TPU_WORKER_HOSTNAMES)"
        )
    if hosts is not None:
        ports = range(spec.tpu_base_port, spec.tpu_base_port + nproc)
        shared["TPU_PROCESS_ADDRESSES"] = ",".join(f"{h}:{p}" for h in hosts for p in ports)
    per_rank = [
        {
            "TPU_VISIBLE_CHIPS": str(local_rank),
            "TPU_PROCESS_PORT": str(spec.tpu_base_port + local_rank),
            "CLOUD_TPU_TASK_ID": str(worker_id * nproc + local_rank),
        }
        for local_rank in range(nproc)
    ]
    return shared, per_rank


def compute_worker_env(
    spec: LaunchSpec,
    environ: Mapping[str, str],
    *,
    node_rank: int | None = None,
) -> WorkerEnv:
    """The shared and per-worker variables for the workers of one host.

    The variables the launch sets (:func:`_launch_vars`), then the user's environment wins
    where it sets one otherwise, unless a flag asked for the launch's value
    (:func:`_yield_to_environ`); a note for each variable of the user's that is overridden or
    replaced.

    Args:
        spec: the resolved launch.
        environ: the user's environment as the launcher found it (before it exported anything).
        node_rank: the host to compute for (default: this one, ``spec.node_rank``); ``--dry-run``
            shows other hosts with it.
    """
    node_rank = spec.node_rank if node_rank is None else node_rank
    notes: list[str] = []
    shared, per_rank = _launch_vars(spec, node_rank, environ, notes)
    _yield_to_environ(shared, per_rank, environ, notes)
    _note_replaced_vars(environ, notes)
    return WorkerEnv(shared=shared, per_rank=tuple(per_rank), notes=tuple(notes))


def _launch_vars(
    spec: LaunchSpec, node_rank: int, environ: Mapping[str, str], notes: list[str]
) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The variables the launch gives every worker of host ``node_rank`` and each of them
    (``environ`` only decides whether a default such as ``OMP_NUM_THREADS`` is needed)."""
    shared: dict[str, str] = {}
    per_rank: list[dict[str, str]] = [{} for _ in range(spec.nproc_per_node)]
    if spec.platform is not None:
        shared[_settings.PLATFORM.env] = spec.platform
    if spec.mode == "emulate" and spec.topology is not None:
        shared[_settings.TOPOLOGY.env] = spec.topology
        shared[_settings.NUM_SLICES.env] = str(spec.num_slices)
    if spec.one_chip_per_process:
        if node_rank == spec.node_rank:
            worker_id = spec.worker_id
        else:
            hosts_per_slice = max(1, (spec.expected_nodes or spec.max_nodes) // spec.num_slices)
            worker_id = node_rank % hosts_per_slice
        tpu_shared, per_rank = _tpu_vars(spec, worker_id, notes)
        shared.update(tpu_shared)
    if spec.mode == "tpu" and spec.runtime == "torchtpu":
        shared.update(torchtpu_vars(spec, node_rank, environ, notes))
    if spec.default_for_cpu:
        shared[DEFAULT_FOR_CPU_ENV] = "1"
    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in environ:
        shared["OMP_NUM_THREADS"] = "1"  # torchrun's default, so workers do not oversubscribe
    if spec.platform == "cpu" and "GLIBC_TUNABLES" not in environ:
        # XLA:CPU allocates every collective's output afresh; backing large malloc chunks with
        # transparent huge pages cut a 64 MiB all_reduce's time by ~1/3
        # (docs/decisions/0003-huge-pages-for-cpu-workers.md). glibc < 2.35 and other C libraries
        # ignore the variable.
        shared["GLIBC_TUNABLES"] = HUGE_PAGES_TUNABLE
    if spec.platform == "cpu" and "JAX_PLATFORMS" not in environ:
        # tpu_dist pins JAX to the CPU when the first "tpu" group starts; pinned from the start,
        # a program's own JAX call before that does not probe libtpu's TPU backend, whose
        # start-up lines read like errors where libtpu is installed (issue 35).
        shared["JAX_PLATFORMS"] = "cpu"
    return shared, per_rank


def _yield_to_environ(
    shared: dict[str, str],
    per_rank: list[dict[str, str]],
    environ: Mapping[str, str],
    notes: list[str],
) -> None:
    """Drop from ``shared`` and ``per_rank`` the variables the user's environment sets to other
    values, so that the user's win, with a note each; a variable an explicit flag set
    (:data:`_FLAG_BACKED`) stays, with a note that it overrides the user's."""
    for var, value in list(shared.items()):
        if var not in environ or environ[var] == value:
            continue
        if var in _FLAG_BACKED:
            notes.append(
                f"{_FLAG_BACKED[var]} {value} overrides {var}={environ[var]!r} from your "
                "environment"
            )
            continue
        del shared[var]
        notes.append(f"{var}={environ[var]!r} from your environment wins over {value!r}")
    for var in sorted({v for env in per_rank for v in env}):
        if var not in environ:
            continue
        computed = sorted({env[var] for env in per_rank if var in env})
        for env in per_rank:
            env.pop(var, None)
        if computed != [environ[var]]:
            notes.append(
                f"{var}={environ[var]!r} from your environment wins over the per-worker values "
                f"{', '.join(computed)}; every local worker sees the same value: unset it to let "
                "tpu-launch give each worker its own"
            )


def _note_replaced_vars(environ: Mapping[str, str], notes: list[str]) -> None:
    """A note for each variable of the user's that elastic sets per worker or tpu-launch sets
    per attempt."""
    for var in ELASTIC_VARS:
        if var in environ:
            notes.append(
                f"{var}={environ[var]!r} from your environment is replaced per worker, as under "
                "torchrun"
            )
    for var in ATTEMPT_VARS:
        if var in environ:
            notes.append(
                f"{var}={environ[var]!r} from your environment is replaced for every attempt: "
                "tpu-launch starts the job's JAX coordination service itself (on node 0's "
                "launcher, a new one when the job restarts) and numbers the attempts"
            )
