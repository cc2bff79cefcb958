"""JAX's coordination service, and where it listens: hosted by rank 0 or outside the ranks.

``tpu-launch``'s node 0 hosts one service per launch attempt (:func:`start_coordination_service`)
whatever backend its workers use, so this module imports only jaxlib's extension module
(about 0.1 CPU-s), never JAX itself (0.5-0.7 CPU-s in a launcher that may run gloo workers).
The runtime (``_runtime``) takes the same timeouts and bind address from here.
"""

from __future__ import annotations

import os
import socket

_BIND_ENV = "JAX_COORDINATOR_BIND_ADDRESS"
JAX_HEARTBEAT_TIMEOUT_S = 1_000_000
"""JAX's heartbeats would end every process after a rank stopped answering for this long (or
when the service went away): long enough never to fire. tpu_dist's watchdog decides."""
JAX_SHUTDOWN_TIMEOUT_S = 10
"""JAX's shutdown barrier timeout. The service runs recoverable, so there is no shutdown barrier
and ranks may finish any time apart; had there been one, a rank that finished this much earlier
than another would abort both at exit (tests/test_launch_faults.py checks ranks finishing
further apart than this)."""


def bind_address(address: str) -> str:
    """Where a coordination service listens: the address it advertises.

    JAX's default is ``[::]:port``, every interface; tpu_dist binds the advertised host's
    interface only, so a job told to use 127.0.0.1 stays on loopback.
    ``JAX_COORDINATOR_BIND_ADDRESS`` (JAX's own variable) wins when set.
    """
    return os.environ.get(_BIND_ENV) or address


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[fd00::1]:8476``), as gRPC and
    ``TPU_DIST_COORDINATION_SERVICE``'s parser want it."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def no_service_api(what: str, err: object) -> RuntimeError:
    """The error for a jaxlib whose private distributed-runtime calls are not the ones used here."""
    from jaxlib.version import __version__

    return RuntimeError(
        f"tpu_dist cannot {what} with this jaxlib ({__version__}): its private "
        f"distributed-runtime API differs from the one tpu_dist was written for (jax 0.10): "
        f"{err}. Unset TPU_DIST_COORDINATION_SERVICE (rank 0 then hosts JAX's coordination "
        "service, as jax.distributed.initialize does), or install jax 0.10."
    )


def start_coordination_service(host: str, num_processes: int) -> tuple[object, str]:
    """Start JAX's coordination service in this process, for ``num_processes`` ranks that
    run elsewhere: ``(service, "host:port")``. What ``tpu-launch``'s node 0 does for each
    launch attempt; hand the address to every rank as ``TPU_DIST_COORDINATION_SERVICE`` and
    each, rank 0 included, connects as a client only. ``service.shutdown()`` stops it; so does
    dropping the last reference.

    It listens on ``host`` and a free port (``JAX_COORDINATOR_BIND_ADDRESS`` overrides the bind
    address, as for JAX). Recoverable (the ``jax_enable_recoverability`` option of
    ``jax.distributed``): a rank that exits or dies is no error the service passes on to the
    others, and there is no shutdown barrier. What JAX's ``State.initialize`` does in process
    0, without a client (``jaxlib._jax.get_distributed_runtime_service``).

    Raises:
        RuntimeError: this jaxlib has no such call, or a different signature.
    """
    try:
        from jaxlib import _jax
    except ImportError as err:
        raise no_service_api("start a coordination service", err) from err
    make = getattr(_jax, "get_distributed_runtime_service", None)
    if make is None:
        raise no_service_api("start a coordination service", "no get_distributed_runtime_service")
    address = host_port(host, free_port())
    try:
        service = make(
            bind_address(address),
            num_processes,
            heartbeat_timeout=JAX_HEARTBEAT_TIMEOUT_S,
            shutdown_timeout=JAX_SHUTDOWN_TIMEOUT_S,
            recoverable=True,
        )
    except TypeError as err:
        raise no_service_api("start a coordination service", err) from err
    return service, address
