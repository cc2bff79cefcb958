"""Job-wide failure propagation between the launchers of a multi-host job.

torch.distributed.elastic restarts or stops the workers of *one* host; with the static
rendezvous a launcher does not learn that another host's worker group failed until its own
workers trip over it in a collective (or never, if they are not communicating). tpu-launch closes
that gap with a few keys in the rendezvous store every launcher already reaches (the TCPStore at
``--master-addr:--master-port``, or the c10d rendezvous endpoint):

* a launcher whose worker group failed for good writes ``failed/<node rank>`` with a one-line
  reason (which rank, which exit code) before it exits, and lingers up to
  :attr:`JobWatch.linger` seconds until every other launcher has noticed it, because the store
  may live in its own process;
* every launcher polls the store every :attr:`JobWatch.interval` seconds; on seeing another host's
  failure it notes that it noticed (``noticed/<node rank>``), then sends itself SIGTERM, which
  elastic turns into an orderly stop of the local workers (SIGTERM, then SIGKILL after the
  shutdown timeout); once they are gone it writes ``stopped/<node rank>``
  (:meth:`JobWatch.report_stopped`);
* the launcher that hosts the job's JAX coordination service (node 0's) must outlive every
  worker connected to it: JAX's client ends its process with SIGABRT as soon as the service goes
  away, so the other hosts' workers would die of that instead of their launcher's orderly stop
  (and before an ``except`` handler of theirs ends). So that launcher, whichever host failed,
  also waits until every launcher that noticed has stopped its workers
  (``wait_for_stop`` of :meth:`JobWatch.report_failure`, :meth:`JobWatch.wait_until_stopped`),
  bounded by the shutdown timeout.

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
        linger: seconds a failed launcher waits for the other launchers to notice its failure.
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
                self._set(f"noticed/{self.node_rank}", "stopping")
                logger.error("tpu-launch: stopping this host's workers: %s", self.remote_failure)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def _set(self, key: str, value: str) -> Exception | None:
        """Sets ``<prefix>/<key>`` in the job store; the error if the store cannot be reached."""
        try:
            store = self._store or self._connect(self.linger)
            self._store = store
            store.set(f"{self.prefix}/{key}", value)
        except Exception as err:
            return err
        return None

    def report_failure(
        self, reason: str, *, wait_for_stop: float = 0.0, linger: bool = True
    ) -> None:
        """Tells the other launchers this host's workers failed (and are gone); waits until
        they noticed (at most :attr:`linger` s; with ``linger`` False not at all, and only over a
        connection the watch already has), and with
        ``wait_for_stop`` > 0 (this launcher hosts the coordination service) also until those
        that noticed stopped their workers, at most ``wait_for_stop`` s more."""
        self._stop.set()
        if self.remote_failure is not None:
            return  # we are stopping because of someone else; nothing new to tell
        if not linger and self._store is None:
            return  # the store never answered; connecting now would only delay the exit
        err = self._set(f"failed/{self.node_rank}", reason) or self._set(
            f"stopped/{self.node_rank}", "failed"
        )
        if err is not None:  # best effort: the others fail on their own
            logger.warning("tpu-launch: could not tell the other hosts about the failure: %s", err)
            return
        if linger:
            self.wait_until_stopped(wait_for_stop)

    def report_stopped(self) -> None:
        """Tells the other launchers this host's workers are gone, after it stopped them for
        another host's failure."""
        self._stop.set()
        self._set(f"stopped/{self.node_rank}", "stopped")

    def wait_until_stopped(self, wait_for_stop: float) -> None:
        """Waits until every other launcher noticed the failure or stopped its workers (at most
        :attr:`linger` s); with ``wait_for_stop`` > 0, until every other launcher stopped its
        workers, at most ``wait_for_stop`` s beyond :attr:`linger` for those that noticed (a
        launcher that did not notice within :attr:`linger` s is taken to be gone)."""
        store = self._store
        if store is None:
            return
        others = [rank for rank in range(self.nnodes) if rank != self.node_rank]
        start, poll = time.monotonic(), min(self.interval, 0.2)
        try:
            while True:
                stopped = {r for r in others if store.check([f"{self.prefix}/stopped/{r}"])}
                noticed = {r for r in others if store.check([f"{self.prefix}/noticed/{r}"])}
                waited = time.monotonic() - start
                pending = [r for r in others if r not in stopped]
                if waited < self.linger:
                    pending = [r for r in pending if wait_for_stop > 0 or r not in noticed]
                elif waited < self.linger + wait_for_stop:
                    pending = [r for r in pending if r in noticed]
                else:
                    pending = []
                if not pending:
                    break
                time.sleep(poll)
        except Exception:  # the store's host exited: it had noticed
            return
        if wait_for_stop > 0:
            # This launcher (node 0's) usually hosts the store as well: stay two polls longer,
            # so that a launcher waiting on our keys reads them before the store goes away.
            time.sleep(2 * poll)
