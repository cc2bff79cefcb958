"""Job-wide failure propagation between the launchers of a multi-host job.

torch.distributed.elastic restarts or stops the workers of *one* host; with the static
rendezvous a launcher does not learn that another host's worker group failed until its own
workers trip over it in a collective (or never, if they are not communicating). tpu-launch closes
that gap with a few keys in the rendezvous store every launcher already reaches (the TCPStore at
``--master-addr:--master-port``, or the c10d rendezvous endpoint):

* a launcher whose worker group failed for good writes ``failed/<node rank>`` with a one-line
  reason (which rank, which exit code) before it exits, and lingers up to
  :attr:`JobWatch.linger` seconds until every other launcher has acknowledged it, because the
  store may live in its own process;
* every launcher polls the store every :attr:`JobWatch.interval` seconds; on seeing another host's
  failure it acknowledges (``done/<node rank>``), then sends itself SIGTERM, which elastic turns
  into an orderly stop of the local workers (SIGTERM, then SIGKILL after the shutdown timeout).

A successful job never touches these keys. Only keys under ``tpu_dist/launch/<run id>/`` are used.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["JobWatch"]

logger = logging.getLogger(__name__)


class JobWatch:
    """Watches the job's store for other hosts' failures; see the module docstring.

    Args:
        host: the store's host.
        port: the store's port.
        run_id: the rendezvous id (keys are namespaced by it).
        node_rank: this launcher's rank among the launchers.
        nnodes: number of launchers.
        interval: seconds between polls.
        linger: seconds :meth:`report_failure` waits for the other launchers' acknowledgements.
        connect_timeout: seconds to wait for the store to come up.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        run_id: str,
        node_rank: int,
        nnodes: int,
        interval: float = 0.5,
        linger: float = 5.0,
        connect_timeout: float = 900.0,
    ) -> None:
        self.host, self.port = host, port
        self.prefix = f"tpu_dist/launch/{run_id}"
        self.node_rank, self.nnodes = node_rank, nnodes
        self.interval, self.linger, self.connect_timeout = interval, linger, connect_timeout
        self.remote_failure: str | None = None
        """The reason another host gave, once this launcher stopped because of it."""
        self._store = None  # set by the polling thread once connected
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpu-launch-watch", daemon=True)

    def start(self) -> JobWatch:
        """Starts polling in a daemon thread (connects lazily: the store may not be up yet)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops polling (the job finished or this launcher is exiting)."""
        self._stop.set()

    def _connect(self, timeout: float) -> TCPStore:
        from torch.distributed import TCPStore

        return TCPStore(
            self.host,
            self.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )

    def _failures(self, store: TCPStore) -> list[str]:
        keys = [
            f"{self.prefix}/failed/{rank}" for rank in range(self.nnodes) if rank != self.node_rank
        ]
        return [store.get(key).decode() for key in keys if store.check([key])]

    def _run(self) -> None:
        try:
            store = self._store = self._connect(self.connect_timeout)
        except Exception as err:  # the job runs on without cross-host stops
            if not self._stop.is_set():
                logger.warning("tpu-launch: cannot reach the job store for failure watch: %s", err)
            return
        while not self._stop.wait(self.interval):
            try:
                failures = self._failures(store)
            except Exception:  # the store's host is gone: the job is ending
                return
            if failures and not self._stop.is_set():
                self.remote_failure = "; ".join(failures)
                try:
                    store.set(f"{self.prefix}/done/{self.node_rank}", "stopped")
                except Exception:
                    pass
                logger.error("tpu-launch: stopping this host's workers: %s", self.remote_failure)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def report_failure(self, reason: str) -> None:
        """Tells the other launchers this host failed; waits (bounded) until they noticed."""
        self._stop.set()
        if self.remote_failure is not None:
            return  # we are stopping because of someone else; nothing new to tell
        try:
            store = self._store or self._connect(self.linger)
            store.set(f"{self.prefix}/failed/{self.node_rank}", reason)
            store.set(f"{self.prefix}/done/{self.node_rank}", "failed")
        except Exception as err:  # best effort: the others fail on their own
            logger.warning("tpu-launch: could not tell the other hosts about the failure: %s", err)
            return
        keys = [f"{self.prefix}/done/{rank}" for rank in range(self.nnodes)]
        deadline = time.monotonic() + self.linger
        try:
            while time.monotonic() < deadline and not store.check(keys):
                time.sleep(min(self.interval, 0.2))
        except Exception:  # the store's host exited: it had noticed
            return
