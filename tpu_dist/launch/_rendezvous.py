"""A separate c10d store for every launch attempt: what a restarted job's workers connect to.

Under torch.distributed.elastic the workers do not host their c10d store: ``init_process_group``
(env://, ``TORCHELASTIC_USE_AGENT_STORE=True``) connects to a TCPStore that the launcher of
rank 0 hosts, at ``MASTER_ADDR:MASTER_PORT``, and uses its keys without a per-attempt prefix
(torch 2.13's ``torch/distributed/rendezvous.py`` assumes "a new TCPStore for every retry").
Both rendezvous tpu-launch uses keep ONE store for the whole job: the static rendezvous its
TCPStore at ``--master-addr:--master-port``, the c10d rendezvous a TCPStore its rank 0 starts in
the first round. So attempt 1 of a ``--max-restarts`` job reads the keys attempt 0 wrote: gloo's
peer addresses (``connectFullMesh ... Connection refused``: the dead workers' ports), the
``default_pg`` keys, and any key of the user's own.

:class:`PerAttemptStore` wraps torch's rendezvous handler and gives every attempt its own store:

* the first attempt gets torch's store unchanged (``MASTER_PORT`` is ``--master-port`` or the
  c10d rendezvous's port, as ``--dry-run`` shows); a job that never restarts sees no difference;
* every later attempt gets a TCPStore that rank 0's launcher starts for it on a free port (the
  previous attempt's is closed), and its workers' ``MASTER_ADDR``/``MASTER_PORT`` name it.

Every node of one attempt must connect to the same store. Rank 0's launcher decides which
(torch's store if no attempt used it yet, noted by a key in that store, else a new one) and
publishes its address in the rendezvous's store under a key the other nodes can only read for
this attempt: the c10d rendezvous's store is already scoped to its round (every node of a round
reads the same value, also one that joined late), the static rendezvous's is not, so there the
key carries the attempt number (static nodes do not join late, and each counts its own
rendezvous). Rank 0 publishes the attempt's number with the address (how many attempts
torch's store has seen), and every launcher hands it to its workers as
``TPU_DIST_LAUNCH_ATTEMPT``, which the "tpu" backend namespaces its own store keys by:
``TORCHELASTIC_RESTART_COUNT`` differs between the nodes of one attempt once a node restarted
its healthy workers because another node failed (elastic counts only failures).

The same launcher (rank 0's) also hosts each attempt's JAX coordination service
(``tpu_dist.collectives.start_coordination_service``) for the attempt's ``nodes x
nproc_per_node`` workers, and publishes its address with the store's; every launcher hands it to
its workers as ``TPU_DIST_COORDINATION_SERVICE``, and the "tpu" backend's ranks connect to it as
clients only. So the service outlives every worker: rank 0's death fails the collectives it was
in (the others' ``except`` handlers run, as on gloo) instead of ending every worker at once, as
it does where rank 0 hosts the service. The previous attempt's service stops when the next
attempt starts (its workers are gone). The last one is not stopped by elastic's
``shutdown()`` of the handler, which comes right after this host's workers ended: other hosts'
workers may still be connected, and JAX ends a client's process (SIGABRT) once its service is
gone. tpu-launch stops it with :func:`stop_services` once the other hosts' workers are gone too
(:mod:`._watch`); :func:`hosts_a_service` says whether this launcher must wait for them.

Registered with elastic's rendezvous registry as ``tpu-launch-<backend>`` (:func:`wrap_backend`);
elastic then takes ``MASTER_ADDR``/``MASTER_PORT`` from the handler, not from the flags.
Handlers whose workers host their own store (``use_agent_store`` False, e.g. etcd) are passed
through: each attempt's rank 0 starts a new store there anyway.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from tpu_dist import _settings

__all__ = ["PerAttemptStore", "hosts_a_service", "stop_services", "wrap_backend"]

logger = logging.getLogger("tpu_dist.launch")

_PREFIX = "tpu-launch-"
_USED_KEY = "tpu_dist/launch/workers_used_this_store"
"""Set (``add``) in torch's store by rank 0's launcher when it hands that store to an attempt."""
_ADDRESS_KEY = "tpu_dist/launch/attempt_store"
"""Under it, in the rendezvous's store, rank 0's launcher publishes ``"<attempt> <host>:<port>"``:
the attempt's number and the store of its workers."""
_CONNECT_TIMEOUT = datetime.timedelta(seconds=60)
_services: list[object] = []
"""The coordination services this launcher started and has not stopped (the current attempt's)."""
NPROC_CONFIG = "tpu_dist_nproc_per_node"
"""The rendezvous config key (``LaunchConfig.rdzv_configs``) that carries the workers per node
to :func:`_create`: the coordination service is started for ``nodes x nproc_per_node``."""


class PerAttemptStore(RendezvousHandler):
    """Wraps ``inner`` so that each attempt's workers get their own c10d store (module docstring).

    Args:
        inner: torch's handler (static or c10d rendezvous).
        local_addr: this node's address as other nodes reach it (``--local-addr``); default
            ``socket.getfqdn()``, as torch's c10d rendezvous.
        nproc_per_node: workers per node; None: no coordination service is started (the
            "tpu" backend's rank 0 then hosts one, as outside tpu-launch).
    """

    def __init__(
        self,
        inner: RendezvousHandler,
        local_addr: str | None = None,
        nproc_per_node: int | None = None,
    ) -> None:
        self._inner = inner
        self._local_addr = local_addr
        self._nproc_per_node = nproc_per_node
        self._scoped_by_round = inner.get_backend() != "static"
        self._attempts = 0
        self._server: TCPStore | None = None  # the store of the current attempt, on rank 0
        self._service: object | None = None  # JAX's coordination service of the attempt, on rank 0

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        attempt = self._attempts
        self._attempts += 1
        boot = info.bootstrap_store_info
        if not self._inner.use_agent_store or boot is None:
            return info
        key = _ADDRESS_KEY if self._scoped_by_round else f"{_ADDRESS_KEY}/{attempt}"
        if info.rank == 0:
            published = self._store_for_this_attempt(boot)
            service = self._service_for_this_attempt(boot.master_addr, info.world_size)
            info.store.set(key, f"{published} {service}" if service else published)
        try:
            number, _, rest = info.store.get(key).decode().partition(" ")
        except Exception as err:  # torch's store timeout (DistStoreError) and connection errors
            raise RendezvousError(
                f"node {info.rank} of the rendezvous found no c10d store for its attempt "
                f"{attempt} (key {key!r}, which rank 0's launcher sets when it joins that "
                f"attempt): {err}. Check that rank 0's launcher is alive and restarted too; "
                "with the static rendezvous a healthy node does not restart for a failed one "
                "(use --rdzv-backend c10d)."
            ) from err
        address, _, service = rest.partition(" ")
        host, _, port = address.rpartition(":")
        # The workers inherit this process's environment (tpu_dist's store keys, module doc).
        os.environ[_settings.LAUNCH_ATTEMPT.env] = number
        if service:
            os.environ[_settings.COORDINATION_SERVICE.env] = service
        else:
            os.environ.pop(_settings.COORDINATION_SERVICE.env, None)
        if (host, int(port)) != (boot.master_addr, boot.master_port):
            logger.info(
                "tpu-launch: attempt %s's workers use a new c10d store at %s", number, address
            )
        return RendezvousInfo(
            info.store, info.rank, info.world_size, RendezvousStoreInfo(host, int(port))
        )

    def _store_for_this_attempt(self, boot: RendezvousStoreInfo) -> str:
        """On rank 0: ``"<attempt> <host>:<port>"``, the store being torch's if no attempt
        used it yet, else a new one; ``attempt`` counts the attempts torch's store has seen."""
        self._server = None  # the previous attempt's store closes; its workers are gone
        torch_store = TCPStore(
            boot.master_addr,
            boot.master_port,
            is_master=False,
            wait_for_workers=False,
            timeout=_CONNECT_TIMEOUT,
        )
        attempt = torch_store.add(_USED_KEY, 1) - 1
        if attempt == 0:
            return f"0 {boot.master_addr}:{boot.master_port}"
        host = boot.master_addr if not self._scoped_by_round else (
            self._local_addr or socket.getfqdn()
        )
        self._server = TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=_CONNECT_TIMEOUT
        )
        return f"{attempt} {host}:{self._server.port}"

    def _service_for_this_attempt(self, host: str, nodes: int) -> str:
        """On rank 0: start this attempt's JAX coordination service (the previous one stops)
        for ``nodes x nproc_per_node`` workers on ``host``; its ``host:port``, or ``""`` when
        none is started (no ``nproc_per_node``)."""
        self._stop_service()
        if self._nproc_per_node is None:
            return ""
        from tpu_dist.collectives import start_coordination_service

        if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
            # The service's gRPC and coordination logs (INFO, and a WARNING on every start
            # that its recoverable mode is "experimental") would fill the launcher's stderr;
            # errors still print. The level is this process's (the workers keep theirs).
            # Cosmetic: a jaxlib without the call only prints more.
            with contextlib.suppress(ImportError, AttributeError):
                from jaxlib import utils

                utils.absl_set_min_log_level(2)
        self._service, address = start_coordination_service(host, nodes * self._nproc_per_node)
        _services.append(self._service)
        logger.debug("tpu-launch: JAX coordination service at %s", address)
        return address

    def _stop_service(self) -> None:
        service, self._service = self._service, None
        if service is not None and service in _services:  # not yet stopped by stop_services
            _services.remove(service)
            service.shutdown()

    def get_backend(self) -> str:
        return _PREFIX + self._inner.get_backend()  # the registered name (elastic checks it)

    # Everything else is the inner handler's.

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        # The attempt's service stays up for other hosts' workers (module docstring).
        self._server = None
        return self._inner.shutdown()


def hosts_a_service() -> bool:
    """Whether this launcher hosts a coordination service that workers may still use."""
    return bool(_services)


def stop_services() -> None:
    """Stops the coordination services this launcher started (at its end, once every host's
    workers are gone). A service that clients are still connected to takes JAX's 5 s grace
    period to stop, and those clients' processes abort."""
    while _services:
        _services.pop().shutdown()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    config = dict(params.config)
    nproc = config.pop(NPROC_CONFIG, None)
    inner = RendezvousParameters(
        params.backend.removeprefix(_PREFIX),
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **config,
    )
    handler = rendezvous_handler_registry.create_handler(inner)
    return PerAttemptStore(handler, params.local_addr, None if nproc is None else int(nproc))


def wrap_backend(backend: str) -> str:
    """The name under which elastic creates ``backend``'s handler wrapped in
    :class:`PerAttemptStore` (registered here, once)."""
    name = _PREFIX + backend
    rendezvous_handler_registry.register(name, _create)
    return name
