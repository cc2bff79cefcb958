"""The resolved launch as JSON (``--plan-json FILE``): what each worker of each host gets (pure).

The shape, for a manifest generator (a GKE JobSet, a scheduler) as much as for a person::

    {
      "world_size": 8,
      "runtime": "tpu_dist",                # or "torchtpu"
      "nodes": [
        {"node_rank": 0, "host": "h0",      # null when this launcher cannot know the host name
         "workers": [
           {"rank": 0, "local_rank": 0,
            "env": {"RANK": "0", ..., "TPU_VISIBLE_CHIPS": "0", ...}},   # everything tpu-launch
           ...]},                                                        # sets for the worker
        ...],
      "shared_env": {...}                   # the variables equal on every worker of every node
    }

Each worker's ``env`` is complete: torch.distributed.elastic's variables (as ``--dry-run``
shows them: with a single-host c10d rendezvous ``MASTER_ADDR`` is ``"<this host>"`` and
``MASTER_PORT`` ``"<free port>"``, decided at start), the host's shared variables and the
worker's own; ``shared_env`` repeats the ones that every worker has with the same value.
Every node of the job is listed, computed the way its own launcher would compute it from the
same flags and platform environment (its host index within the slice, its slice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpu_dist.launch._config import LaunchSpec
from tpu_dist.launch._env import compute_worker_env, elastic_vars

__all__ = ["launch_plan"]


def _host(spec: LaunchSpec, node_rank: int) -> str | None:
    hosts_per_slice = spec.hosts_per_slice
    same_slice = node_rank // hosts_per_slice == spec.slice_id
    if spec.worker_hostnames and same_slice and len(spec.worker_hostnames) == hosts_per_slice:
        return spec.worker_hostnames[node_rank % hosts_per_slice]
    if spec.max_nodes == 1:
        return "localhost"
    if node_rank == 0 and spec.num_slices == 1:
        return spec.master_addr
    return None


def launch_plan(spec: LaunchSpec, environ: Mapping[str, str]) -> dict[str, Any]:
    """The plan of every node and worker of ``spec`` (see the module docstring).

    Args:
        spec: the resolved launch.
        environ: the user's environment as the launcher found it.
    """
    nodes = []
    envs: list[dict[str, str]] = []
    for node in range(spec.max_nodes):
        wenv = compute_worker_env(spec, environ, node_rank=node)
        workers = []
        for local_rank in range(spec.nproc_per_node):
            env = {**elastic_vars(spec, node, local_rank), **wenv.for_local_rank(local_rank)}
            envs.append(env)
            workers.append(
                {"rank": int(env["RANK"]), "local_rank": local_rank, "env": dict(sorted(env.items()))}
            )
        nodes.append({"node_rank": node, "host": _host(spec, node), "workers": workers})
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)}
    return {
        "world_size": spec.world_size,
        "runtime": spec.runtime,
        "nodes": nodes,
        "shared_env": dict(sorted(shared.items())),
    }
