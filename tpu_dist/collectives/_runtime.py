"""The per-process runtime behind the "tpu" backend: JAX start, device map, tensor hand-off.

One :class:`Runtime` per process (:func:`get`) owns everything that lives longer
than one call: the JAX runtime and its devices, the program cache
(``_lowering.ProgramCache``), the on-disk compile cache as this process uses it
(``_compile_cache.CompileCache``), which private jaxlib calls still work
(``_jaxlib.JaxlibCalls``), the dispatcher and the group counts per device set
(``_dispatch``), the point-to-point channels (``_p2p``), the completion thread
(``_work.Completer``) and the watchdog (``_watchdog``). The modules of the
package keep no per-process state of their own: what must be process-wide
(this object itself among it) is declared in :mod:`tpu_dist._process`
(``docs/architecture.md``, "Per-process state"). JAX starts when the first
"tpu" process group is created (the default group, since torch creates it
first) and lives until the interpreter exits (``destroy_process_group`` leaves
it running: JAX allows one distributed initialization per process).

* Start. One JAX process per torch rank, every one a client of JAX's
  coordination service (gRPC), which is hosted in one of two places:

  - *Outside the ranks* (under ``tpu-launch``): the launcher of node 0 starts a
    service for each launch attempt and hands its address to every worker as
    ``TPU_DIST_COORDINATION_SERVICE``; every rank, rank 0 included, connects
    as a client only (``_jaxlib.connect_to_service``: ``jax.distributed
    .initialize`` would start a service in rank 0). Rank 0 is then a rank like
    the others: when it dies, the others live on (their collectives with it
    fail and raise, as on gloo) and it need not wait for them at exit.
  - *In rank 0* (anywhere else: torchrun, a hand-made world): ``jax.distributed
    .initialize``. The address is exchanged through the group's c10d store under
    a key of this launch attempt (:func:`attempt`): rank 0 binds a free port
    (never the store's own port, which would collide) on ``MASTER_ADDR`` (or
    this host's address), bound to that host's interface only
    (``JAX_COORDINATOR_BIND_ADDRESS`` overrides the bind address, as for JAX),
    and publishes ``host:port``; the others read it. A restarted job never reads
    the address of an earlier attempt.

  XLA's CPU collectives (gloo) open their own ports on the interface of each
  rank's address.
* Lifetime. The coordination service runs *recoverable* (a JAX option): a
  process that exits or dies is not a fatal error for the others, and there
  is no shutdown barrier, so each rank exits when it is done, with its own
  exit code. JAX's own heartbeats are off (a timeout of ~11 days): the
  watchdog (``_watchdog``) decides who is gone. What a rank cannot survive is
  the service going away: JAX's client then ends its process at once (SIGABRT,
  "Terminating process because the JAX distributed service detected fatal
  errors"), before any ``except`` handler runs. So where rank 0 hosts the
  service, its death ends every other rank, and at exit rank 0 waits until the
  others have exited (see ``Watchdog.at_exit``); with the service outside the
  ranks neither holds.
* Platform. ``TPU_DIST_PLATFORM`` = ``auto`` (default: TPU when a TPU is
  attached, else CPU), ``cpu``, ``tpu`` or ``gpu``. On CPU each rank owns one
  XLA CPU device and collectives ride XLA's CPU collectives (gloo).
* Device map. Global rank ``r`` owns the first addressable device of JAX
  process ``r``: :func:`global_devices` lists them by rank.
* 64-bit types. JAX truncates int64/float64 unless ``jax_enable_x64`` is on.
  Every JAX call of this package runs inside :func:`x64_scope`, a thread-local
  scope, so 64-bit tensors stay exact while the user's own JAX configuration
  is left as it was.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist

from tpu_dist import _process, _settings
from tpu_dist.mesh import tpu_attached
from tpu_dist.collectives import (
    _compile_cache,
    _dispatch,
    _jaxlib,
    _lowering,
    _p2p,
    _pipeline,
    _watchdog,
    _work,
)
from tpu_dist.collectives._service import (
    JAX_HEARTBEAT_TIMEOUT_S,
    JAX_SHUTDOWN_TIMEOUT_S,
    bind_address,
    free_port,
    host_port,
)

logger = logging.getLogger(__name__)

PLATFORM_ENV = _settings.PLATFORM.env
_COORDINATOR_KEY = "jax_coordinator_address"
_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class RuntimeInfo:
    """What the running JAX runtime was started with."""

    world_size: int
    """Number of JAX processes, equal to the torch world size."""
    rank: int
    """This process's JAX process index, equal to its global torch rank."""
    platform: str
    """The JAX platform collectives run on: "cpu", "tpu" or "gpu"."""
    coordinator_address: str
    """``host:port`` of the JAX coordination service."""
    hosts_service: bool = False
    """Whether this process hosts the coordination service (rank 0 when no service runs
    outside the ranks, module doc): the others cannot outlive it."""


def _leave_if_stuck() -> None:
    """At exit, after every handler registered later (the watchdog's), before JAX's teardown.

    A thread stuck in an XLA collective (one the watchdog gave up on under the raise policy)
    makes JAX's teardown abort the process (SIGABRT, "FATAL: exception not rethrown") or
    hang. Such a process leaves at once instead, with the exit code tpu-launch's worker entry
    noted (``tpu_dist.launch.EXIT_CODE_VAR``; 1 without it). Exit handlers registered before
    tpu_dist was imported do not run then.
    """
    runtime = _process.runtime()
    watchdog = runtime.watchdog if runtime is not None else None
    if watchdog is None or not watchdog.stuck():
        return
    try:
        code = _settings.EXIT_CODE.read()
    except ValueError:
        code = None
    code = 1 if code is None or code < 0 else code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# Registered when JAX is imported here, so it runs after the watchdog's exit handler and
# before JAX's own (registered earlier, when jax was first imported).
atexit.register(_leave_if_stuck)


x64_scope = _jaxlib.x64_scope
"""A thread-local scope in which JAX keeps 64-bit dtypes (see module doc)."""


def resolve_platform(value: str | None = None) -> str:
    """Return the platform to run on from ``value`` or ``TPU_DIST_PLATFORM``.

    Raises:
        ValueError: the value is not one of auto, cpu, tpu, gpu.
    """
    environ = None if value is None else {PLATFORM_ENV: value}
    choice = _settings.PLATFORM.get(environ)
    if choice != "auto":
        return choice
    return "tpu" if tpu_attached() else "cpu"


class Runtime:
    """Everything tpu_dist keeps per process, in one object (:func:`get`).

    It owns the stages of a collective's life that outlive one call: the JAX runtime
    (:attr:`info`, :attr:`devices`, started by :meth:`start`), the compiled programs
    (:attr:`programs`, with the on-disk cache :attr:`disk_cache` and the private jaxlib calls
    :attr:`jaxlib`), the ordered dispatch of programs and the channels of point-to-point
    ops (:attr:`dispatcher`, :attr:`device_sets`, :attr:`p2p`), the thread that completes
    works whose future was asked for (:attr:`completer`) and the watchdog (:attr:`watchdog`,
    started by :meth:`start_watchdog`). It is the composition root: it builds each group's
    pipeline (:meth:`pipeline`) from these parts and hands them down; no module of the
    package imports it back.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Held while JAX starts."""
        self.info: RuntimeInfo | None = None
        """What JAX was started with; None before the first "tpu" group."""
        self.devices: list[jax.Device] | None = None
        """The JAX device owned by each global rank, indexed by rank (module doc)."""
        self.jaxlib = _jaxlib.JaxlibCalls()
        """Which private jaxlib calls still work in this process (DLPack hand-off, direct
        execute): used by :meth:`to_jax`, :meth:`to_torch` and the program cache."""
        self.disk_cache = _compile_cache.CompileCache()
        """The on-disk compile cache as this process uses it (its checked, open directories)."""
        self.programs = _lowering.ProgramCache(self.jaxlib, self.disk_cache)
        self.device_sets = _dispatch.DeviceSets()
        self.dispatcher = _dispatch.Dispatcher(
            self.programs, self.to_jax, self.to_torch, self.device_sets
        )
        self.p2p = _p2p.P2PChannels(self.programs, self.to_jax, self.to_torch)
        self.completer = _work.Completer()
        self.watchdog: _watchdog.Watchdog | None = None
        """Started with the default group (:meth:`start_watchdog`); None before, and in
        compile-only mode."""
        self._device: jax.Device | None = None
        self._on_cpu = True

    def start(
        self, store: dist.Store, rank: int, world_size: int, timeout: timedelta
    ) -> RuntimeInfo:
        """Start JAX for this process once; later calls check and return the same info.

        Every rank of the default group calls this while the default "tpu" group
        is created.

        Raises:
            ValueError: a ``TPU_DIST_*`` variable (or ``TORCHELASTIC_RESTART_COUNT``) is
                malformed: checked first, before any rank talks to another.
            torch.distributed.DistNetworkError: the coordination service did not accept a
                connection within ``timeout``.
            RuntimeError: JAX already runs with another world (a new
                ``init_process_group`` after ``destroy_process_group`` with a
                different world size or rank), or JAX was started by someone else
                before the first "tpu" group.
        """
        # Every rank parses every setting before anything starts (issue 34): a malformed one
        # read only later, by one rank, once JAX ran, crashed the others.
        _settings.check()
        attempt()
        with self.lock:
            if self.info is not None:
                return _same_world(self.info, world_size, rank)
            platform = resolve_platform()
            # Parsed now, so that a malformed TPU_DIST_COMPILE_CACHE fails init_process_group on
            # every rank, not the first collective (the directory is made at the first program).
            _settings.COMPILE_CACHE.get()
            _select_jax_platform(platform)
            outside = _settings.COORDINATION_SERVICE.read()
            address = _coordinator_address(store, rank, timeout, outside)
            _initialize_jax(address, rank, world_size, timeout, connect_only=outside is not None)
            self.devices = _one_device_per_process(world_size)
            self._device = self.devices[rank]
            self._on_cpu = platform == "cpu"
            self.programs.platform = platform
            self.info = RuntimeInfo(
                world_size, rank, platform, address, hosts_service=outside is None and rank == 0
            )
            logger.info("tpu_dist: JAX runtime started: %s", self.info)
            return self.info

    def start_watchdog(
        self, store: dist.Store, rank: int, world_size: int, group_timeout: timedelta
    ) -> _watchdog.Watchdog:
        """Start this process's watchdog once (with the default group's store); a later
        default group hands it its store and timeout.

        ``store`` is wrapped in this launch attempt's prefix (:func:`store_prefix`).
        """
        store = dist.PrefixStore(store_prefix(), store)
        watchdog = self.watchdog
        if watchdog is None:
            watchdog = self.watchdog = _watchdog.Watchdog(
                store, rank, world_size, _watchdog.policy_from_env(),
                _watchdog.heartbeat_timeout_from_env(),
                hosts_service=hosts_service, disconnect=disconnect,
            )
            # Registered after jax.distributed.initialize (the runtime starts first), so it
            # runs before JAX's own exit handlers take the runtime down.
            atexit.register(watchdog.at_exit)
        else:
            watchdog._store = store
        watchdog.group_timeout = group_timeout.total_seconds()
        return watchdog

    def pipeline(self, devices: Sequence[jax.Device]) -> _pipeline.Pipeline:
        """A new group's pipeline over ``devices`` (one per group rank), with this process's
        dispatcher, p2p channels, completion thread and watchdog (the group's track, dispatch and
        complete stages: :mod:`._pipeline`).

        ``TPU_DIST_TIMEOUT_POLICY=raise`` makes its works poll (the watchdog can interrupt
        them) and ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every call against the other
        ranks' first (torch reads the variable when torch.distributed is imported; a value set
        later, before the group, counts too).
        """
        watchdog = self.watchdog  # it read the policy when it started
        policy = watchdog.policy if watchdog is not None else _watchdog.policy_from_env()
        check_calls = (
            dist.get_debug_level() == dist.DebugLevel.DETAIL
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        )
        services = _pipeline.Services(
            dispatcher=self.dispatcher,
            p2p=self.p2p,
            device_sets=self.device_sets,
            completer=self.completer,
            watchdog=watchdog,
            to_jax=self.to_jax,
            to_torch=self.to_torch,
            rank=self.info.rank if self.info is not None else 0,
        )
        return _pipeline.Pipeline(
            services, devices, poll=policy == "raise", check_calls=check_calls
        )

    def global_devices(self) -> list[jax.Device]:
        """The JAX device owned by each global rank, indexed by rank.

        Raises:
            RuntimeError: no "tpu" process group has been created in this process.
        """
        if self.devices is None:
            raise _not_started()
        return list(self.devices)

    def local_device(self) -> jax.Device:
        """The JAX device of this rank."""
        if self._device is None:
            raise _not_started()
        return self._device

    def to_jax(self, flat: torch.Tensor) -> jax.Array:
        """A 1-D contiguous CPU tensor as a JAX array on this rank's device.

        Zero-copy on the CPU platform (DLPack; XLA copies storage that is not
        64-byte aligned). On TPU/GPU the data is copied to the device.
        """
        if flat.requires_grad:  # a Parameter or a loss: DLPack refuses them, the data is the same
            flat = flat.detach()
        device = self._device
        if device is None:
            raise _not_started()
        if not self._on_cpu:
            with x64_scope():
                return jax.device_put(_as_numpy(flat), device)
        return self.jaxlib.dlpack_import(flat, device)

    def to_torch(self, array: jax.Array) -> torch.Tensor:
        """A JAX result block as a CPU tensor (zero-copy on the CPU platform)."""
        if not self._on_cpu:
            host = np.asarray(jax.device_get(array))
            if host.dtype == jnp.bfloat16:
                return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
            return torch.from_numpy(host.copy())
        return self.jaxlib.dlpack_export(array)


def get() -> Runtime:
    """This process's :class:`Runtime`, created on first use (the first "tpu" group).

    The one object is kept in :mod:`tpu_dist._process` (process-wide state, declared once).
    """
    runtime = _process.runtime()
    if runtime is None:
        runtime = _process.runtime_or_create(Runtime)
    return runtime


def _not_started() -> RuntimeError:
    return RuntimeError(
        "tpu_dist's JAX runtime is not started: call "
        "torch.distributed.init_process_group('tpu') first."
    )


def info() -> RuntimeInfo | None:
    """The running runtime's :class:`RuntimeInfo`, or None before the first group."""
    runtime = _process.runtime()
    return runtime.info if runtime is not None else None


def attempt() -> int:
    """This launch attempt: ``TPU_DIST_LAUNCH_ATTEMPT`` (tpu-launch), else
    ``TORCHELASTIC_RESTART_COUNT`` (0 without a restarting launcher).

    torch.distributed.elastic keeps its store across restarts of the worker group, so every
    key tpu_dist puts in the c10d store is namespaced by the attempt (:func:`store_prefix`).
    Every rank of one attempt must get the same number: elastic's restart count is per node
    (a node whose healthy workers restart because another node failed keeps its count), the
    attempt tpu-launch hands out is the rendezvous's.
    """
    launched = _settings.LAUNCH_ATTEMPT.read()
    if launched is not None:
        return launched
    raw = os.environ.get(_RESTART_ENV, "0").strip() or "0"
    if not raw.isdigit():
        raise ValueError(f"{_RESTART_ENV}={raw!r} is not a restart count (0, 1, ...).")
    return int(raw)


def store_prefix() -> str:
    """The prefix of every c10d store key of tpu_dist in this launch attempt."""
    return f"tpu_dist/attempt{attempt()}/"


def hosts_service() -> bool:
    """Whether this process hosts JAX's coordination service (:attr:`RuntimeInfo.hosts_service`):
    rank 0 when no service runs outside the ranks; False before the first group."""
    started = info()
    return started is not None and started.hosts_service


def disconnect() -> None:
    """Leave JAX's coordination service (at exit, on every rank that does not host it).

    ``jax.distributed.shutdown()``, which JAX's own exit handler would call later; the CPU
    collectives need the service only to set up communicators.
    """
    started = info()
    if started is not None and not started.hosts_service and jax.distributed.is_initialized():
        jax.distributed.shutdown()


def _same_world(info: RuntimeInfo, world_size: int, rank: int) -> RuntimeInfo:
    """``info`` when JAX already runs for this world and rank; else the error saying why not."""
    if (info.world_size, info.rank) != (world_size, rank):
        raise RuntimeError(
            "tpu_dist's JAX runtime was started for "
            f"world_size={info.world_size}, rank={info.rank} and cannot be "
            f"restarted in the same process as world_size={world_size}, "
            f"rank={rank}: JAX allows one distributed initialization per "
            "process. Start a new process (tpu-launch restarts workers) to "
            "change the world."
        )
    return info


def _select_jax_platform(platform: str) -> None:
    """Point JAX at ``platform``; on CPU, one XLA CPU device for this process."""
    if platform == "cpu":
        if os.environ.get("JAX_PLATFORMS") not in (None, "", "cpu"):
            logger.warning(
                "tpu_dist: %s=cpu overrides JAX_PLATFORMS=%s for this process.",
                PLATFORM_ENV,
                os.environ["JAX_PLATFORMS"],
            )
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 1)
    elif platform == "tpu":
        jax.config.update("jax_platforms", "tpu")
    else:
        jax.config.update("jax_platforms", "cuda")


def _coordinator_address(
    store: dist.Store, rank: int, timeout: timedelta, outside: str | None
) -> str:
    """The coordination service's ``host:port``: the one outside the ranks (``outside``, once it
    listens) or the one rank 0 hosts (exchanged through ``store``)."""
    if outside is not None:
        _wait_until_listening(
            outside, timeout.total_seconds(), rank,
            f"set by {_settings.COORDINATION_SERVICE.env}",
        )
        return outside
    return _exchange_coordinator_address(store, rank, timeout)


def _initialize_jax(
    address: str, rank: int, world_size: int, timeout: timedelta, *, connect_only: bool
) -> None:
    """Start JAX's distributed runtime: a client of the service at ``address`` only
    (``connect_only``), or ``jax.distributed.initialize`` (rank 0 hosts the service). Recoverable,
    and SIGTERM's handler as it was before."""
    init_timeout = max(int(timeout.total_seconds()), 10)
    sigterm = signal.getsignal(signal.SIGTERM)
    # A process that exits is not an error for the others (no error propagation, no
    # shutdown barrier); JAX's preemption notifier would swallow SIGTERM.
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_enable_preemption_service", False)
    try:
        if connect_only:
            _jaxlib.connect_to_service(
                address,
                rank,
                world_size,
                init_timeout_s=init_timeout,
                heartbeat_timeout_s=JAX_HEARTBEAT_TIMEOUT_S,
            )
        else:
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=world_size,
                process_id=rank,
                initialization_timeout=init_timeout,
                heartbeat_timeout_seconds=JAX_HEARTBEAT_TIMEOUT_S,
                shutdown_timeout_seconds=JAX_SHUTDOWN_TIMEOUT_S,
                coordinator_bind_address=bind_address(address),
            )
    except RuntimeError as err:
        if "must be called before" in str(err):
            raise RuntimeError(
                "tpu_dist must start JAX's distributed runtime, but JAX was already "
                "used in this process before the first 'tpu' process group "
                f"({err}). Call dist.init_process_group('tpu') before any JAX "
                "computation or jax.devices() call."
            ) from err
        raise
    if sigterm is not None and threading.current_thread() is threading.main_thread():
        # JAX's preemption notifier catches SIGTERM and carries on; torch users (and
        # tpu-launch, torchrun) expect SIGTERM to stop a worker. Put back what was there.
        signal.signal(signal.SIGTERM, sigterm)


def _one_device_per_process(world_size: int) -> list[jax.Device]:
    """The first device of each JAX process, by process index (= rank)."""
    by_process: dict[int, jax.Device] = {}
    for device in sorted(jax.devices(), key=lambda d: d.id):
        by_process.setdefault(device.process_index, device)
    if sorted(by_process) != list(range(world_size)):
        raise RuntimeError(
            f"JAX reports devices for processes {sorted(by_process)}, expected one "
            f"device in each of {world_size} processes; check that every rank "
            "started with the same world size."
        )
    return [by_process[r] for r in range(world_size)]


def _exchange_coordinator_address(store: dist.Store, rank: int, timeout: timedelta) -> str:
    key = store_prefix() + _COORDINATOR_KEY
    if rank == 0:
        address = _settings.COORDINATOR_ADDRESS.read() or host_port(_host_address(), free_port())
        store.set(key, address)  # first: the others then fail naming it, not the store's key
        _check_can_listen(address)
        return address
    store.wait([key], timeout)
    address = store.get(key).decode()
    _wait_until_listening(address, timeout.total_seconds(), rank, "published by rank 0")
    return address


def _check_can_listen(address: str) -> None:
    """Raise unless rank 0 can listen where its coordination service will (``address``, or
    ``JAX_COORDINATOR_BIND_ADDRESS``): JAX's service crashed the process (SIGSEGV, "Failed to
    add port to server") on an address of another host or a port in use.

    Raises:
        torch.distributed.DistNetworkError: binding that address failed.
    """
    where = bind_address(address)
    host, _, port = where.rpartition(":")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except (OSError, ValueError) as err:
        source = (
            f"set by {_settings.COORDINATOR_ADDRESS.env}" if _settings.COORDINATOR_ADDRESS.read()
            else "MASTER_ADDR, or this host's address, and a free port"
        )
        raise dist.DistNetworkError(
            f"tpu_dist: rank 0 cannot host JAX's coordination service at {where} ({source}): "
            f"{err}. Use an address of rank 0's host and a free port, or leave "
            f"{_settings.COORDINATOR_ADDRESS.env} unset."
        ) from err


_SAY_WAITING_AFTER_S = 10.0


def _wait_until_listening(address: str, timeout_s: float, rank: int, source: str) -> None:
    """Return once the coordination service at ``address`` accepts connections.

    Rank 0 publishes the address before ``jax.distributed.initialize`` starts the service
    there. A rank whose client dials first is refused, and gRPC's first reconnect backoff
    is one second: 4-rank worlds took 1.1-1.3 s to initialise instead of 0.16 s. A plain TCP
    connect, retried every 5 ms, tells when the port is open. It also bounds the wait: JAX's
    client, given an address where nothing listens, retried in silence and then ended the
    process (SIGABRT). ``source`` says where the address came from; after 10 s a warning
    names both.

    Raises:
        torch.distributed.DistNetworkError: nothing accepted a connection within ``timeout_s``.
    """
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    said = False
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError as err:
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise dist.DistNetworkError(
                    f"tpu_dist: rank {rank} could not connect to JAX's coordination service at "
                    f"{address} ({source}) within {timeout_s:g} s (the group's timeout): "
                    f"{err}. Check that the address is right and that the service runs there "
                    "(tpu-launch starts one per attempt; outside tpu-launch rank 0 hosts it)."
                ) from err
            if not said and waited >= _SAY_WAITING_AFTER_S:
                said = True
                logger.warning(
                    "tpu_dist: rank %d waits for JAX's coordination service at %s (%s): "
                    "%s; giving up after %g s (the group's timeout).",
                    rank, address, source, err, timeout_s,
                )
            time.sleep(0.005 if waited < 1.0 else 0.05)


def _host_address() -> str:
    # The torch rendezvous host is reachable by every rank; when rank 0 started
    # the store (env://), MASTER_ADDR names this host.
    master = os.environ.get("MASTER_ADDR")
    if master:
        return master
    return socket.gethostbyname(socket.gethostname())


def compile_count() -> int:
    """How many collective programs this process has built: compiled, or loaded compiled (on
    CPU, a program this process compiled for another group of the same size; or from the
    on-disk compile cache, ``TPU_DIST_COMPILE_CACHE``). Each program counts once, unless it
    was dropped (past ``TPU_DIST_PROGRAM_CACHE_MB``: :func:`program_cache_info`) and built
    again."""
    return get().programs.compilations


def program_cache_info() -> _lowering.ProgramCacheInfo:
    """What this process's compiled collective programs hold: how many, what they count for
    in bytes against the ``TPU_DIST_PROGRAM_CACHE_MB`` budget, how many were built
    (:func:`compile_count`) and how many dropped (the least recently used, past the budget)."""
    return get().programs.info()


def global_devices() -> list[jax.Device]:
    """The JAX device owned by each global rank, indexed by rank.

    Raises:
        RuntimeError: no "tpu" process group has been created in this process.
    """
    return get().global_devices()


def release_results() -> None:
    """Free result blocks whose tensors are gone (jaxlib defers that; see _jaxlib)."""
    _jaxlib.collect_garbage()


def to_jax(flat: torch.Tensor) -> jax.Array:
    """:meth:`Runtime.to_jax` of this process's runtime."""
    return get().to_jax(flat)


def to_torch(array: jax.Array) -> torch.Tensor:
    """:meth:`Runtime.to_torch` of this process's runtime."""
    return get().to_torch(array)


def _as_numpy(flat: torch.Tensor) -> np.ndarray:
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(jnp.bfloat16)
    return flat.numpy()
