"""The watchdog: no collective hangs silently.

XLA's CPU collectives take no timeout, and a collective whose peer died or
stopped blocks inside XLA where Python cannot reach it. Two daemon threads per
process watch instead:

* the *heartbeat* thread writes ``tpu_dist/heartbeat/<rank>`` = ``"<count> <progress>"``
  into the default group's c10d store every ``interval`` seconds (progress: the
  last sequence number this rank issued in each group), and while a
  collective is in flight it reads the heartbeats of that group's ranks;
* the *watchdog* thread looks at every collective in flight. A peer whose
  heartbeat has not changed for ``TPU_DIST_HEARTBEAT_TIMEOUT`` seconds (default
  10) is gone (exited, killed, or stopped); a collective older than its
  group's timeout has timed out, and the ranks whose progress is below its
  sequence number are the ones that did not arrive.

What happens then is ``TPU_DIST_TIMEOUT_POLICY``:

* ``abort`` (default, as NCCL's async error handling): print the error, dump
  the flight record, and end the process with exit code 1 so the launcher can
  restart the group. The XLA program cannot be unwound, so this is the only
  way to free the process.
* ``raise``: the waiting ``work.wait()`` raises ``DistBackendError``; the XLA
  program stays stuck in the background and the group is unusable, so the
  program should dump state and exit itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist

from tpu_dist.collectives import flight_recorder

if TYPE_CHECKING:
    from tpu_dist.collectives._work import TPUWork

logger = logging.getLogger(__name__)

POLICY_ENV = "TPU_DIST_TIMEOUT_POLICY"
HEARTBEAT_TIMEOUT_ENV = "TPU_DIST_HEARTBEAT_TIMEOUT"
_KEY = "tpu_dist/heartbeat/"

Policy = Literal["abort", "raise"]


def policy_from_env() -> Policy:
    """``TPU_DIST_TIMEOUT_POLICY``: ``abort`` (default) or ``raise``."""
    raw = os.environ.get(POLICY_ENV, "abort").strip().lower()
    if raw not in ("abort", "raise"):
        raise ValueError(f"{POLICY_ENV}={raw!r}: use 'abort' (default) or 'raise'.")
    return raw  # type: ignore[return-value]


def heartbeat_timeout_from_env() -> float:
    """``TPU_DIST_HEARTBEAT_TIMEOUT`` seconds (default 10)."""
    raw = os.environ.get(HEARTBEAT_TIMEOUT_ENV, "10")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={raw!r} must be positive seconds, e.g. 10.")
    return value


@dataclass
class InFlight:
    """A collective the watchdog is watching."""

    work: TPUWork
    """The watchdog completes it once its program finished (nobody may wait on it) or
    calls its ``_fail(error)``."""
    group: str
    group_ranks: list[int]
    seq: int
    op: str
    started: float
    timeout: float


class Watchdog:
    """Heartbeats and the in-flight watch of one process (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        policy: Policy,
        heartbeat_timeout: float,
        interval: float = 1.0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.heartbeat_timeout = heartbeat_timeout
        self.interval = min(interval, heartbeat_timeout / 4)
        self._store = store
        self._lock = threading.Lock()
        self._in_flight: dict[int, InFlight] = {}
        self._progress: dict[str, int] = {}
        self._beats = 0
        # rank -> (heartbeat value, local time it last changed)
        self._seen: dict[int, tuple[str, float]] = {}
        self._watch_ranks: set[int] = set()
        self._io_alive = time.monotonic()
        self._fired: set[int] = set()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watchdog")):
            threading.Thread(target=target, name=f"tpu_dist-{name}", daemon=True).start()

    # -- called by the backend -----------------------------------------------

    def issued(self, group: str, seq: int) -> None:
        """Note that this rank issued collective ``seq`` of ``group``."""
        self._progress[group] = seq

    def watch(self, item: InFlight) -> None:
        with self._lock:
            self._in_flight[id(item.work)] = item

    def done(self, work: object) -> None:
        with self._lock:
            self._in_flight.pop(id(work), None)

    def finish_in_flight(self) -> None:
        """Complete every collective still in flight; registered with ``atexit``.

        A helper thread that is inside XLA when the interpreter finalizes dies on its way
        back into Python, and glibc then aborts the process ("FATAL: exception not
        rethrown", exit code 134). So at exit the main thread first waits for every work
        in flight (an async_op call nobody waited on, a future's work): the dispatcher
        thread starts the queued programs meanwhile. A peer that never arrives is this
        watchdog's to report, as for any wait; once it has failed a collective (raise
        policy), a program is stuck for good and nothing after it can finish, so this
        returns.
        """
        while not self._fired:
            with self._lock:
                items = list(self._in_flight.values())
            if not items:
                return
            for item in items:
                item.work._complete(flush=False)
                self.done(item.work)

    def _report_failure(self, group: str, seq: int, group_ranks: list[int], wait: float) -> list[int]:
        prefix = f"tpu_dist/failed/{group}/{seq}/"
        self._store.set(f"{prefix}{self.rank}", "1")
        deadline = time.monotonic() + wait
        missing = [r for r in group_ranks if r != self.rank]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not self._store.check([f"{prefix}{r}"])]
            if missing:
                time.sleep(0.05)
        return missing

    # -- threads ----------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while True:
            try:
                self._beats += 1
                progress = ",".join(f"{g}={s}" for g, s in list(self._progress.items()))
                self._store.set(f"{_KEY}{self.rank}", f"{self._beats} {progress}")
                for peer in list(self._watch_ranks):
                    value = self._store.get(f"{_KEY}{peer}").decode() if self._store.check(
                        [f"{_KEY}{peer}"]) else ""
                    old = self._seen.get(peer)
                    if old is None or old[0] != value:
                        self._seen[peer] = (value, time.monotonic())
                self._io_alive = time.monotonic()
            except Exception as err:  # the store is gone: the watch loop reports it
                logger.debug("tpu_dist heartbeat: %s", err)
            time.sleep(self.interval)

    def _watch_loop(self) -> None:
        while True:
            time.sleep(self.interval)
            now = time.monotonic()
            with self._lock:
                items = list(self._in_flight.values())
            # Watch peers only while something waits on them (reads cost store traffic).
            old_enough = [i for i in items if now - i.started > self.interval]
            self._watch_ranks = {r for i in old_enough for r in i.group_ranks if r != self.rank}
            for item in old_enough:
                if id(item.work) in self._fired:
                    continue
                # A finished program whose work nobody waits on (async_op=True, never
                # waited) is not in flight: complete it, do not time it out.
                if item.work._complete_if_finished():
                    continue
                message = self._diagnose(item, now)
                if message is not None:
                    self._fired.add(id(item.work))
                    self._act(item, message)

    def _diagnose(self, item: InFlight, now: float) -> str | None:
        where = (
            f"{item.op} (collective #{item.seq} of group {item.group!r}, ranks "
            f"{item.group_ranks}) on rank {self.rank}"
        )
        if now - self._io_alive > self.heartbeat_timeout:
            return (
                f"{where}: the c10d store has not answered for {now - self._io_alive:.0f} s; "
                "the rank hosting it (rank 0 with env:// rendezvous) is gone or stopped."
            )
        gone = []
        for peer in item.group_ranks:
            if peer == self.rank:
                continue
            seen = self._seen.get(peer)
            since = item.started if seen is None else max(seen[1], item.started)
            if now - since > self.heartbeat_timeout:
                gone.append(peer)
        if gone:
            return (
                f"{where}: rank(s) {gone} stopped responding (no heartbeat for more than "
                f"{self.heartbeat_timeout:.0f} s; {HEARTBEAT_TIMEOUT_ENV}): they exited, were "
                "killed, or are stopped."
            )
        if now - item.started > item.timeout:
            behind = []
            for peer in item.group_ranks:
                seen = self._seen.get(peer)
                progress = _parse_progress(seen[0]) if seen else {}
                if peer != self.rank and progress.get(item.group, -1) < item.seq:
                    behind.append(peer)
            return (
                f"{where} timed out after {item.timeout:.0f} s (the group's timeout); ranks "
                f"that did not arrive: {behind or 'unknown (all issued it; a rank may be stuck)'}."
            )
        return None

    def _act(self, item: InFlight, message: str) -> None:
        recorder = flight_recorder.recorder()
        try:
            path = recorder.dump(reason=message)
            message += f" Flight record: {path}."
        except OSError as err:
            message += f" (flight record not written: {err})"
        if self.policy == "abort":
            print(
                f"tpu_dist: {message} Ending this process ({POLICY_ENV}=abort): the XLA "
                "collective cannot be unwound. Set "
                f"{POLICY_ENV}=raise to get a DistBackendError instead.",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        item.work._fail(dist.DistBackendError(f"tpu_dist: {message}"))


def explain_failure(
    error: BaseException, op: str, group: str, seq: int, group_ranks: list[int], rank: int,
    wait: float = 3.0,
) -> dist.DistBackendError:
    """Turn a failed XLA collective into a DistBackendError that names the missing ranks.

    Every rank whose copy of the collective failed reports in through the
    store; the ranks that do not report within ``wait`` seconds are the ones
    that are gone (a dead peer makes every survivor's collective fail at once).
    """
    where = f"{op} (collective #{seq} of group {group!r}, ranks {group_ranks}) failed on rank {rank}"
    watchdog = _watchdog
    missing: list[int] | None = None
    if watchdog is not None:
        result: list[list[int]] = []
        probe = threading.Thread(
            target=lambda: result.append(watchdog._report_failure(group, seq, group_ranks, wait)),
            daemon=True,
        )
        probe.start()
        probe.join(wait + 2.0)
        missing = result[0] if result else None
    if missing is None:
        who = "the c10d store did not answer, so the rank hosting it (rank 0) is probably gone"
    elif missing:
        who = f"rank(s) {missing} did not report the failure and are probably gone"
    else:
        who = "every rank of the group saw the failure"
    return dist.DistBackendError(f"tpu_dist: {where}: {who}. XLA said: {error}")


def _parse_progress(value: str) -> dict[str, int]:
    parts = value.split(" ", 1)
    if len(parts) < 2 or not parts[1]:
        return {}
    progress = {}
    for pair in parts[1].split(","):
        group, _, seq = pair.rpartition("=")
        progress[group] = int(seq)
    return progress


_watchdog: Watchdog | None = None


def start(store: dist.Store, rank: int, world_size: int) -> Watchdog:
    """Start this process's watchdog once (with the default group's store)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(store, rank, world_size, policy_from_env(), heartbeat_timeout_from_env())
        # Registered after jax.distributed.initialize (the runtime starts first), so it runs
        # before JAX's own exit handlers take the runtime down.
        atexit.register(_watchdog.finish_in_flight)
    else:
        _watchdog._store = store
    return _watchdog


def get() -> Watchdog | None:
    """This process's watchdog, once a default group exists."""
    return _watchdog


def seconds(timeout: timedelta) -> float:
    """A group timeout in seconds."""
    return timeout.total_seconds()
