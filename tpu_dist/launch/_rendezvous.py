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

Waiting for the other nodes is interruptible and says what it waits for. Both rendezvous wait
inside C++ calls of torch's TCPStore (node 0's static store waits there until every node has
connected, the other nodes wait in ``get`` for node 0's key, a c10d node in its connect to the
host's store), up to the rendezvous timeout (900 s by default); CPython runs a Python signal
handler only once the main thread is back in Python, so the launcher's handler (and
elastic's, and Python's own for SIGINT) ran only when that call returned: SIGTERM and SIGINT
were held for up to the whole timeout. (torchrun, whose SIGTERM is still the default action at
that point, dies at once; its SIGINT is held just the same.) So every rendezvous step and the
creation of the handler run in a daemon thread while the main thread waits on it in an
interruptible wait: a signal stops the launcher within its poll interval (exit code 128 + N,
no workers were started). While the wait lasts, a line every :data:`PROGRESS_INTERVAL_S`
seconds (the first after :data:`FIRST_PROGRESS_S`) says which nodes it waits for, e.g.
``tpu-launch: node 0 is waiting for node(s) 1 to join the rendezvous at 10.0.0.2:29500 (1 of 2
joined, 30 s of the 900 s rendezvous timeout)``: every node of a static rendezvous notes in the
store that it joined (``tpu_dist/launch/joined/<attempt>/<node rank>``), and each waiting node
reads those keys over a connection of its own; a c10d rendezvous's line names its endpoint.

Registered with elastic's rendezvous registry as ``tpu-launch-<backend>`` (:func:`wrap_backend`);
elastic then takes ``MASTER_ADDR``/``MASTER_PORT`` from the handler, not from the flags.
Handlers whose workers host their own store (``use_agent_store`` False, e.g. etcd) are passed
through: each attempt's rank 0 starts a new store there anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from tpu_dist import _settings

__all__ = [
    "FIRST_PROGRESS_S",
    "PROGRESS_INTERVAL_S",
    "PerAttemptStore",
    "RendezvousView",
    "hosts_a_service",
    "stop_services",
    "waiting",
    "wrap_backend",
]

logger = logging.getLogger("tpu_dist.launch")

_PREFIX = "tpu-launch-"
_USED_KEY = "tpu_dist/launch/workers_used_this_store"
"""Set (``add``) in torch's store by rank 0's launcher when it hands that store to an attempt."""
_ADDRESS_KEY = "tpu_dist/launch/attempt_store"
"""Under it, in the rendezvous's store, rank 0's launcher publishes ``"<attempt> <host>:<port>"``:
the attempt's number and the store of its workers."""
_JOINED_KEY = "tpu_dist/launch/joined"
"""Under ``<it>/<attempt>/<node rank>``, in a static rendezvous's store (run id prefix), each node
notes that it joined that attempt's rendezvous: what the waiting nodes' progress lines read."""
_CONNECT_TIMEOUT = datetime.timedelta(seconds=60)
_PROBE_TIMEOUT = datetime.timedelta(seconds=2)
FIRST_PROGRESS_S = 5.0
"""Seconds a rendezvous waits before its first progress line (a quick one prints none)."""
PROGRESS_INTERVAL_S = 30.0
"""Seconds between the progress lines of a rendezvous that goes on waiting."""
_POLL_S = 0.2
"""How often the main thread looks whether the rendezvous step finished (signals are handled at
once regardless: the wait is interruptible)."""
_waiting: list[str] = []
"""What this launcher is waiting for right now (at most one entry), for the signal message."""
_services: list[object] = []
"""The coordination services this launcher started and has not stopped (the current attempt's)."""
NPROC_CONFIG = "tpu_dist_nproc_per_node"
"""The rendezvous config key (``LaunchConfig.rdzv_configs``) that carries the workers per node
to :func:`_create`: the coordination service is started for ``nodes x nproc_per_node``."""


_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class RendezvousView:
    """What the progress lines of a rendezvous can say: where, who, how long.

    Attributes:
        backend: ``static`` or ``c10d`` (any other: only the endpoint is named).
        endpoint: ``host:port`` of the rendezvous's store.
        run_id: the rendezvous id (a static store's keys are prefixed by it).
        node_rank: this node's rank (static rendezvous), else None (assigned at the end).
        min_nodes: nodes the rendezvous needs.
        max_nodes: nodes it takes.
        timeout_s: the rendezvous timeout (static ``timeout``, c10d ``join_timeout``).
    """

    backend: str
    endpoint: str
    run_id: str
    node_rank: int | None
    min_nodes: int
    max_nodes: int
    timeout_s: float


def format_ranges(ranks: Sequence[int]) -> str:
    """``1`` or ``1-3, 5`` (ascending ``ranks``; also the launcher's failure summary's)."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class _Progress:
    """Builds the progress line of one rendezvous wait (see the module docstring), over a
    store connection of its own (the rendezvous's own is inside the waiting call)."""

    def __init__(self, view: RendezvousView, attempt: int | None) -> None:
        self.view, self.attempt = view, attempt
        self._probe: Any = None

    def _joined(self) -> set[int] | None:
        """Static rendezvous: the nodes that noted they joined this attempt (this one counted);
        None when the store does not answer."""
        v = self.view
        host, _, port = v.endpoint.rpartition(":")
        try:
            if self._probe is None:
                # A plain connect first: TCPStore logs a C++ stack trace for every failed one.
                socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
                client = TCPStore(
                    host.strip("[]"),
                    int(port),
                    is_master=False,
                    wait_for_workers=False,
                    timeout=_PROBE_TIMEOUT,
                )
                self._probe = PrefixStore(v.run_id, client)
            keys = [f"{_JOINED_KEY}/{self.attempt}/{r}" for r in range(v.max_nodes)]
            joined = {r for r, key in enumerate(keys) if self._probe.check([key])}
        except Exception:  # not up yet (node 0 not started), or gone
            self._probe = None
            return None
        return joined | {0, v.node_rank}  # node 0 hosts the store that answered

    def line(self, waited: float) -> str:
        v = self.view
        kind = "rendezvous timeout" if v.backend == "static" else "rendezvous join timeout"
        timing = f"{waited:.0f} s of the {v.timeout_s:.0f} s {kind}"
        if v.backend != "static" or v.node_rank is None or self.attempt is None:
            nodes = (
                str(v.max_nodes) if v.min_nodes == v.max_nodes else f"{v.min_nodes}..{v.max_nodes}"
            )
            return (
                f"tpu-launch: waiting for the other node(s) to join the {v.backend} rendezvous at "
                f"{v.endpoint} (id {v.run_id}; {nodes} nodes; {timing})"
            )
        joined = self._joined()
        if joined is None:
            return (
                f"tpu-launch: node {v.node_rank} is waiting for node 0 to open the rendezvous "
                f"store at {v.endpoint} (no answer; {timing})"
            )
        missing = [r for r in range(v.max_nodes) if r not in joined]
        if not missing:  # everyone is in; node 0 is publishing this attempt's store
            return (
                f"tpu-launch: node {v.node_rank} is waiting for node 0 to finish the rendezvous "
                f"at {v.endpoint} ({len(joined)} of {v.max_nodes} joined, {timing})"
            )
        return (
            f"tpu-launch: node {v.node_rank} is waiting for node(s) {format_ranges(missing)} to join "
            f"the rendezvous at {v.endpoint} ({len(joined)} of {v.max_nodes} joined, {timing})"
        )


def _interruptible(step: Callable[[], _T], what: str, progress: _Progress | None) -> _T:
    """Runs ``step`` (a rendezvous step that may wait inside a C++ TCPStore call) in a daemon
    thread; the main thread waits for it interruptibly, so that a signal handler runs at once
    (and its exception, elastic's ``SignalException``, propagates from here while the thread is
    abandoned: the launcher ends with ``os._exit``). Logs ``progress``'s line after
    :data:`FIRST_PROGRESS_S` s and then every :data:`PROGRESS_INTERVAL_S` s. Outside the main
    thread (no signal handlers run there) ``step`` runs directly."""
    if threading.current_thread() is not threading.main_thread():
        return step()
    result: list[Any] = []
    error: list[BaseException] = []
    done = threading.Event()
    stop_progress = threading.Event()

    def run() -> None:
        try:
            result.append(step())
        except BaseException as err:  # re-raised in the main thread
            error.append(err)
        finally:
            done.set()

    def report() -> None:
        start, wait = time.monotonic(), FIRST_PROGRESS_S
        while not stop_progress.wait(wait):
            line = progress.line(time.monotonic() - start)
            if not stop_progress.is_set():
                logger.warning("%s", line)
            wait = PROGRESS_INTERVAL_S

    threading.Thread(target=run, name="tpu-launch-rendezvous", daemon=True).start()
    if progress is not None:
        threading.Thread(target=report, name="tpu-launch-rdzv-progress", daemon=True).start()
    _waiting.append(what)
    try:
        while not done.wait(_POLL_S):
            pass
    except BaseException:  # a signal handler's exception: `what` stays for launch()'s message
        stop_progress.set()
        raise
    stop_progress.set()
    _waiting.remove(what)
    if error:
        raise error[0]
    return result[0]


def waiting() -> str | None:
    """What this launcher is waiting for in the rendezvous right now (for a signal's message),
    or None."""
    return _waiting[-1] if _waiting else None


class PerAttemptStore(RendezvousHandler):
    """Wraps ``inner`` so that each attempt's workers get their own c10d store (module docstring).

    Args:
        inner: torch's handler (static or c10d rendezvous).
        local_addr: this node's address as other nodes reach it (``--local-addr``); default
            ``socket.getfqdn()``, as torch's c10d rendezvous.
        nproc_per_node: workers per node; None: no coordination service is started (the
            "tpu" backend's rank 0 then hosts one, as outside tpu-launch).
        view: what the progress lines of a long wait say; None: no progress lines.
    """

    def __init__(
        self,
        inner: RendezvousHandler,
        local_addr: str | None = None,
        nproc_per_node: int | None = None,
        view: RendezvousView | None = None,
    ) -> None:
        self._inner = inner
        self._view = view
        self._local_addr = local_addr
        self._nproc_per_node = nproc_per_node
        self._scoped_by_round = inner.get_backend() != "static"
        self._attempts = 0
        self._server: TCPStore | None = None  # the store of the current attempt, on rank 0
        self._service: object | None = None  # JAX's coordination service of the attempt, on rank 0

    def next_rendezvous(self) -> RendezvousInfo:
        attempt = self._attempts
        self._attempts += 1
        view = self._view
        # A c10d round's keys are its own; a static store's need the attempt (module docstring).
        scoped_attempt = None if self._scoped_by_round else attempt
        progress = None if view is None else _Progress(view, scoped_attempt)
        where = "the rendezvous" + (f" at {view.endpoint}" if view else "")
        return _interruptible(lambda: self._next(attempt), where, progress)

    def _next(self, attempt: int) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        if not self._scoped_by_round and info.rank != 0:
            with contextlib.suppress(Exception):  # only the progress lines read it
                info.store.set(f"{_JOINED_KEY}/{attempt}/{info.rank}", "1")
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
    backend = inner.backend
    rank = config.get("rank")
    view = RendezvousView(
        backend=backend,
        endpoint=params.endpoint,
        run_id=params.run_id,
        node_rank=int(rank) if backend == "static" and rank is not None else None,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        timeout_s=float(
            config.get("timeout", 600) if backend == "static" else config.get("join_timeout", 600)
        ),
    )
    # A c10d node that does not host the store connects to it here, inside C++, for up to
    # the store's read timeout: interruptible too.
    handler = _interruptible(
        lambda: rendezvous_handler_registry.create_handler(inner),
        f"the {backend} rendezvous store at {params.endpoint}",
        None,
    )
    return PerAttemptStore(
        handler, params.local_addr, None if nproc is None else int(nproc), view
    )


def wrap_backend(backend: str) -> str:
    """The name under which elastic creates ``backend``'s handler wrapped in
    :class:`PerAttemptStore` (registered here, once)."""
    name = _PREFIX + backend
    rendezvous_handler_registry.register(name, _create)
    return name
