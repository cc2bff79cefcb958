"""The watchdog: no collective hangs silently, and every rank can exit.

XLA's CPU collectives take no timeout, and a collective whose peer died or
stopped blocks inside XLA where Python cannot reach it. Two daemon threads per
process watch instead:

* the *heartbeat* thread writes ``heartbeat/<rank>`` =
  ``"<count>|<progress>|<waiting>"`` into the default group's c10d store every
  ``interval`` seconds (progress: the last sequence number this rank issued in
  each group; waiting: the ranks its collectives in flight wait for), reads the
  heartbeats and exit notes of the ranks it waits for, and the failure notes of
  its groups;
* the *watchdog* thread looks at every collective in flight. A peer is *gone*
  when it has exited (each rank notes its exit in the store), or when it runs
  on this host and its process is dead, with no heartbeat for
  ``TPU_DIST_HEARTBEAT_TIMEOUT`` seconds (default 10). A peer that is only
  stopped or silent is not declared gone: the group's timeout decides, as on
  gloo. That covers a rank paused by SIGSTOP (a debugger, Ctrl-Z, a cgroup
  freezer) or a VM pause, a rank on another host, and one holding the GIL in a
  long C call (the heartbeat thread needs the GIL). The same holds for the c10d
  store: one that answers with errors (its host is gone) fails the collectives
  after ``TPU_DIST_HEARTBEAT_TIMEOUT``, one that does not answer (its host is
  paused) gets the group's timeout. A collective older than its group's
  timeout has timed out, and the ranks whose progress is below its sequence
  number are the ones that did not arrive (the error says which of them are
  stopped or silent).

What happens then is ``TPU_DIST_TIMEOUT_POLICY``:

* ``abort`` (default, as NCCL's async error handling): print the error, dump
  the flight record, and end the process with exit code 1 so the launcher can
  restart the group. The XLA program cannot be unwound, so this is the only
  way to free the process.
* ``raise``: the waiting ``work.wait()`` raises ``DistBackendError`` and the
  group is marked failed in the store: on every rank of the group its
  collectives in flight and every later one raise ``DistBackendError`` (a late
  rank does not run the collective its peers gave up on) until the group is
  re-created. The XLA program stays stuck in the background, so the program
  should dump state and exit; it can, with its own exit code.

At exit (``atexit``, before JAX's own teardown) :meth:`Watchdog.at_exit`
completes the collectives still in flight, notes the exit in the store, and on
rank 0 when it hosts JAX's coordination service (not under tpu-launch, whose
launcher hosts it: ``_runtime`` module doc), waits until every other rank has
exited, died, or is blocked on a collective rank 0 will never join: JAX ends
any process whose coordination service went away.

Every key lives under the launch attempt's prefix (the runtime hands the watchdog a store
wrapped in it), so a restarted job never reads an earlier attempt's notes.

The process's one :class:`Watchdog` belongs to the runtime (started with the default group,
which hands it to every group's pipeline); :func:`track` is the *track* stage of every call
(flight recorder, then the watchdog), which the pipelines run before dispatch.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from tpu_dist import _settings
from tpu_dist.collectives import flight_recorder
from tpu_dist.collectives._types import Call

if TYPE_CHECKING:
    from tpu_dist.collectives._work import TPUWork

logger = logging.getLogger(__name__)

POLICY_ENV = _settings.TIMEOUT_POLICY.env
HEARTBEAT_TIMEOUT_ENV = _settings.HEARTBEAT_TIMEOUT.env
_KEY = "heartbeat/"
_EXITED = "exited/"
_PROCESS = "process/"
_FAILED_GROUP = "failed_group/"

Policy = _settings.Policy


def policy_from_env() -> Policy:
    """``TPU_DIST_TIMEOUT_POLICY``: ``abort`` (default) or ``raise``."""
    return _settings.TIMEOUT_POLICY.get()  # type: ignore[return-value]


def heartbeat_timeout_from_env() -> float:
    """``TPU_DIST_HEARTBEAT_TIMEOUT`` seconds (default 10)."""
    return _settings.HEARTBEAT_TIMEOUT.get()


@dataclass
class InFlight:
    """A collective the watchdog is watching."""

    work: TPUWork
    """The watchdog completes it once its program finished (nobody may wait on it) or
    interrupts it (``work.interrupt(error)``)."""
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
        *,
        hosts_service: Callable[[], bool] = lambda: False,
        disconnect: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        threads: bool = True,
    ) -> None:
        """``hosts_service``: whether this process hosts JAX's coordination service (then it
        waits for the others at exit); ``disconnect``: leaves that service (at exit, before
        the exit note). Both are the runtime's, handed down by it. ``clock``: the seconds the
        heartbeat and the watch go by; ``threads``: start the heartbeat and watch threads,
        which call :meth:`beat` and :meth:`look` every ``interval`` (a test without them calls
        those itself, with a clock of its own)."""
        self._clock = clock
        self._hosts_service = hosts_service
        self._disconnect = disconnect
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
        # When the store last answered every request of a heartbeat, and the error of the
        # requests since then, if one failed (None: they are still waiting for an answer).
        self._io_alive = clock()
        self._io_error: str | None = None
        self._fired: set[int] = set()
        # Peers that noted their exit (rank -> local time first seen), and where each peer
        # runs (rank -> pid on this host, or None elsewhere).
        self._exited: dict[int, float] = {}
        self._pids: dict[int, int | None] = {}
        # group name -> how many groups of that name this process created (a re-created
        # group starts clean), and the failure notes seen for the current one.
        self._epochs: dict[str, int] = {}
        self._failed_groups: dict[str, str] = {}
        self.group_timeout = 1800.0
        """The default group's timeout: how long rank 0 waits at exit for a silent peer."""
        try:
            self._store.set(f"{_PROCESS}{rank}", f"{_host_id()} {os.getpid()}")
        except Exception as err:  # the watch loop reports a store that does not answer
            logger.debug("tpu_dist watchdog: %s", err)
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=target, name=f"tpu_dist-{name}", daemon=True)
            for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watchdog"))
        ] if threads else []
        for thread in self._threads:
            thread.start()

    def now(self) -> float:
        """The watchdog's clock (a call's start is read from it)."""
        return self._clock()

    # -- called by the backend -----------------------------------------------

    def issued(self, group: str, seq: int) -> None:
        """Note that this rank issued collective ``seq`` of ``group``."""
        self._progress[group] = seq

    def group_created(self, group: str) -> None:
        """A group named ``group`` was (re-)created on this rank: it starts usable."""
        self._epochs[group] = self._epochs.get(group, -1) + 1
        self._failed_groups.pop(group, None)

    def check_usable(self, group: str, op: str) -> None:
        """Raise ``DistBackendError`` if a collective of ``group`` failed (raise policy).

        Raises:
            torch.distributed.DistBackendError: the group is failed on this or another rank.
        """
        reason = self._failed_groups.get(group)
        if reason is not None:
            raise dist.DistBackendError(
                f"tpu_dist: {op} on group {group!r} refused on rank {self.rank}: the group "
                f"failed earlier ({reason}). Its ranks disagree on which collectives "
                "completed, so it cannot be used again: destroy it and create a new group "
                "(or restart the job)."
            )

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
                item.work.complete(flush=False)
                self.done(item.work)

    def at_exit(self) -> None:
        """Registered with ``atexit`` (it runs before JAX's own exit handlers).

        Completes the collectives in flight, notes this rank's exit in the store (a peer
        waiting for this rank fails at once instead of at its timeout), and on the rank that
        hosts JAX's coordination service (rank 0 outside tpu-launch) waits for the other
        ranks (see the module docstring).
        """
        self.finish_in_flight()
        hosts_service = self._hosts_service()
        try:
            if not hosts_service and not self._fired:
                # Leave JAX's coordination service before the exit note: rank 0 stops
                # waiting on the note, and a disconnect that finds the service gone ends
                # the process (JAX's client treats it as a fatal error).
                self._disconnect()
            self._store.set(f"{_EXITED}{self.rank}", "1")
            # A process that fails (a failed collective, or a non-zero exit code noted by
            # tpu-launch's worker entry) leaves at once, with its own exit code: the job is
            # failing, and the launcher stops the others.
            try:
                failing = _settings.EXIT_CODE.read() not in (None, 0)
            except ValueError:  # not a number: not an exit code tpu-launch wrote
                failing = True
            if hosts_service and self.world_size > 1 and not self._fired and not failing:
                self._linger()
        except Exception:  # the store is gone: nobody is left to tell or wait for
            pass
        finally:
            self._stop_threads()

    def stuck(self) -> bool:
        """Whether this process gave up on a collective whose XLA program may still run."""
        return bool(self._fired)

    def _stop_threads(self) -> None:
        # A daemon thread that is inside a C++ call (a store request) when the interpreter
        # finalizes is unwound by force on its way back and glibc aborts the process
        # ("FATAL: exception not rethrown"): stop ours first.
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5.0)

    def _linger(self) -> None:
        peers = set(range(1, self.world_size))
        started = time.monotonic()
        said = False
        seen: dict[int, tuple[str, float]] = {}
        blocked: dict[int, float] = {}
        while peers:
            now = time.monotonic()
            try:
                for peer in sorted(peers):
                    if self._store.check([f"{_EXITED}{peer}"]):
                        peers.discard(peer)
                        continue
                    value = self._read_heartbeat(peer)
                    if seen.get(peer, ("", 0.0))[0] != value:
                        seen[peer] = (value, now)
                    silent = now - seen[peer][1]
                    state = self._process_state(peer)
                    # A stopped or silent peer gets the group's timeout, as in a collective.
                    if state == "dead" or (state != "running" and silent > self.group_timeout):
                        peers.discard(peer)
                        continue
                    waits = self.rank in _parse_heartbeat(value)[2]
                    if not waits:
                        blocked.pop(peer, None)
                    elif now - blocked.setdefault(peer, now) > self.heartbeat_timeout + 10:
                        # It waits for this rank in a collective; its watchdog fails that
                        # collective on seeing this rank's exit note, unless it cannot.
                        print(
                            f"tpu_dist: rank {self.rank} exits while rank {peer} waits for it "
                            "in a collective; JAX's coordination service (on rank 0) goes "
                            "with it, which ends the ranks still running.",
                            file=sys.stderr, flush=True,
                        )
                        return
            except Exception:  # the store went away: the job is over
                return
            if not said and now - started > 2.0:
                said = True
                print(
                    f"tpu_dist: rank 0 waits for rank(s) {sorted(peers)} to exit before "
                    "exiting itself: it hosts JAX's coordination service, which they use "
                    "until they exit.",
                    file=sys.stderr, flush=True,
                )
            time.sleep(0.1)

    def _read_heartbeat(self, peer: int) -> str:
        key = f"{_KEY}{peer}"
        return self._store.get(key).decode() if self._store.check([key]) else ""

    def _process_state(self, peer: int, fetch: bool = True) -> str | None:
        """``"dead"``, ``"stopped"`` or ``"running"`` for a peer on this host, else None.

        The peer's pid is read from the store the first time (``fetch``; without it, a peer
        whose pid is not known yet is None: the watch thread never waits for the store).
        """
        if peer not in self._pids:
            if not fetch:
                return None
            key = f"{_PROCESS}{peer}"
            if not self._store.check([key]):
                return None
            host, _, pid = self._store.get(key).decode().rpartition(" ")
            self._pids[peer] = int(pid) if host == _host_id() else None
        pid = self._pids[peer]
        return None if pid is None else _pid_state(pid)

    def _report_failure(self, group: str, seq: int, group_ranks: list[int], wait: float) -> list[int]:
        prefix = f"failed/{group}/{seq}/"
        self._store.set(f"{prefix}{self.rank}", "1")
        deadline = time.monotonic() + wait
        missing = [r for r in group_ranks if r != self.rank]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not self._store.check([f"{prefix}{r}"])]
            if missing and all(self._gone(r) for r in missing):
                # None of them will ever report: raise now, not after ``wait``, so the
                # caller's except handler runs before a launcher stops this process too.
                break
            if missing:
                time.sleep(0.05)
        return missing

    def _gone(self, peer: int) -> bool:
        """Whether ``peer`` noted its exit, or is a dead process of this host."""
        return self._store.check([f"{_EXITED}{peer}"]) or self._process_state(peer) == "dead"

    # -- threads ----------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            self.beat()
            self._stopping.wait(self.interval)

    def _watch_loop(self) -> None:
        while not self._stopping.wait(self.interval):
            self.look()

    def beat(self) -> None:
        """One heartbeat: write this rank's into the store, read those of the ranks waited for
        (and their exit notes, and where they run) and this rank's groups' failure notes."""
        try:
            self._beats += 1
            progress = ",".join(f"{g}={s}" for g, s in list(self._progress.items()))
            waiting = ",".join(str(r) for r in sorted(self._watch_ranks))
            self._store.set(f"{_KEY}{self.rank}", f"{self._beats}|{progress}|{waiting}")
            for peer in list(self._watch_ranks):
                value = self._read_heartbeat(peer)
                old = self._seen.get(peer)
                if old is None or old[0] != value:
                    self._seen[peer] = (value, self._clock())
                if peer not in self._exited and self._store.check([f"{_EXITED}{peer}"]):
                    self._exited[peer] = self._clock()
                if peer not in self._pids:
                    self._process_state(peer)  # reads its pid, for the watch thread
            for group in list(self._progress):
                key = f"{_FAILED_GROUP}{group}/{self._epochs.get(group, 0)}"
                if group not in self._failed_groups and self._store.check([key]):
                    self._failed_groups[group] = self._store.get(key).decode()
            self._io_alive = self._clock()
            self._io_error = None
        except Exception as err:  # the store is gone: the watch reports it
            logger.debug("tpu_dist heartbeat: %s", err)
            self._io_error = f"{type(err).__name__}: {err}".strip()

    def look(self, now: float | None = None) -> None:
        """One look at the collectives in flight (``now``: the clock's, by default): fail those
        of a failed group, complete finished ones nobody waits on, and act on the others that
        will not complete (:meth:`_diagnose`, :meth:`_act`)."""
        now = self._clock() if now is None else now
        with self._lock:
            items = list(self._in_flight.values())
        # Watch peers only while something waits on them (reads cost store traffic).
        old_enough = [i for i in items if now - i.started > self.interval]
        self._watch_ranks = {r for i in old_enough for r in i.group_ranks if r != self.rank}
        for item in items:
            reason = self._failed_groups.get(item.group)
            if reason is not None and id(item.work) not in self._fired:
                self._fired.add(id(item.work))
                message = (
                    f"tpu_dist: {item.op} (collective #{item.seq} of group "
                    f"{item.group!r}) failed on rank {self.rank}: the group failed "
                    f"({reason})."
                )
                # Every rank whose collective fails writes its record, not only the one
                # that timed out first: the analyzer needs them all to say who is behind.
                try:
                    path = flight_recorder.recorder().dump(reason=message)
                    message += f" Flight record: {path}."
                except OSError as err:
                    message += f" (flight record not written: {err})"
                item.work.interrupt(dist.DistBackendError(message))
        for item in old_enough:
            if id(item.work) in self._fired:
                continue
            # A finished program whose work nobody waits on (async_op=True, never
            # waited) is not in flight: complete it, do not time it out.
            if item.work.complete_if_finished():
                continue
            diagnosis = self._diagnose(item, now)
            if diagnosis is not None:
                self._fired.add(id(item.work))
                self._act(item, *diagnosis)

    def _diagnose(self, item: InFlight, now: float) -> tuple[str, bool] | None:
        """Why ``item`` will not complete, and whether only exited peers are to blame.

        Early (before the group's timeout) only for what cannot come back: a peer that noted
        its exit, a dead process of this host, a store that fails every request. A peer that
        is stopped or silent, and a store that does not answer, get the group's timeout
        (this process may itself have been the one paused: everything looks silent then).
        """
        where = (
            f"{item.op} (collective #{item.seq} of group {item.group!r}, ranks "
            f"{item.group_ranks}) on rank {self.rank}"
        )
        store_quiet = now - self._io_alive
        error = self._io_error
        if error is not None and store_quiet > self.heartbeat_timeout:
            return (
                f"{where}: the c10d store has failed every request for {store_quiet:.0f} s "
                f"({error}); the process hosting it (rank 0 with env:// rendezvous, else the "
                "launcher) is gone.",
                False,
            )
        gone = []
        silent = []
        stopped = []
        for peer in item.group_ranks:
            if peer == self.rank:
                continue
            seen = self._seen.get(peer)
            since = item.started if seen is None else max(seen[1], item.started)
            quiet = now - since > self.heartbeat_timeout
            # XLA's own error (a closed connection) comes first for a peer that exited or
            # died; this catches the rest: rank 0 waiting at exit for the others (its
            # connections stay open), a peer gone before it connected.
            exited = self._exited.get(peer)
            if exited is not None and now - exited > 2 * self.interval:
                gone.append(f"{peer} (exited)")
                continue
            if not quiet:
                continue
            # The pid is known once the heartbeat thread has read it (no store call here).
            state = self._process_state(peer, fetch=False)
            if state == "dead":
                gone.append(f"{peer} (its process is gone)")
            elif state == "stopped":
                stopped.append(peer)
            else:
                silent.append(peer)
        if gone:
            return (
                f"{where}: rank(s) {', '.join(gone)} will not join it "
                f"(heartbeats and exit notes in the c10d store; {HEARTBEAT_TIMEOUT_ENV}).",
                all(g.endswith("(exited)") for g in gone),
            )
        if now - item.started > item.timeout:
            behind = []
            for peer in item.group_ranks:
                seen = self._seen.get(peer)
                progress = _parse_heartbeat(seen[0])[1] if seen else {}
                if peer != self.rank and progress.get(item.group, -1) < item.seq:
                    behind.append(peer)
            notes = ""
            if stopped:
                notes += (
                    f"; rank(s) {stopped} are stopped (SIGSTOP: a debugger, Ctrl-Z, a cgroup "
                    "freezer)"
                )
            if silent:
                notes += (
                    f"; rank(s) {silent} sent no heartbeat for more than "
                    f"{self.heartbeat_timeout:g} s (paused, hung, or holding the GIL)"
                )
            if store_quiet > self.heartbeat_timeout:
                notes += (
                    f"; the c10d store has not answered for {store_quiet:.0f} s (its host, "
                    "rank 0 with env:// rendezvous, may be paused)"
                )
            return (
                f"{where} timed out after {item.timeout:.0f} s (the group's timeout); ranks "
                f"that did not arrive: {behind or 'unknown (all issued it; a rank may be stuck)'}"
                f"{notes}.",
                False,
            )
        return None

    def _act(self, item: InFlight, message: str, peers_exited: bool) -> None:
        """End the process (abort policy) or fail the work and its group.

        A collective whose peers exited fails with ``DistBackendError`` under either policy,
        as one whose peer died does: this process is not the one at fault.
        """
        recorder = flight_recorder.recorder()
        try:
            path = recorder.dump(reason=message)
            message += f" Flight record: {path}."
        except OSError as err:
            message += f" (flight record not written: {err})"
        if self.policy == "abort" and not peers_exited:
            # The exit note tells rank 0 (waiting at exit) not to wait for this process.
            try:
                self._store.set(f"{_EXITED}{self.rank}", "1")
            except Exception:
                pass
            print(
                f"tpu_dist: {message} Ending this process ({POLICY_ENV}=abort): the XLA "
                "collective cannot be unwound. Set "
                f"{POLICY_ENV}=raise to get a DistBackendError instead.",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        self._failed_groups[item.group] = message
        try:
            key = f"{_FAILED_GROUP}{item.group}/{self._epochs.get(item.group, 0)}"
            self._store.set(key, f"on rank {self.rank}: {message}")
        except Exception as err:  # the store is gone: the peers time out on their own
            logger.debug("tpu_dist watchdog: %s", err)
        item.work.interrupt(dist.DistBackendError(f"tpu_dist: {message}"))


def explain_failure(
    watchdog: Watchdog | None, error: BaseException, call: Call, rank: int, wait: float = 3.0
) -> dist.DistBackendError:
    """Turn ``call``'s failed XLA program (on global ``rank``) into a DistBackendError that
    names the missing ranks.

    Every rank whose copy of the collective failed reports in through ``watchdog``'s store;
    the ranks that do not report within ``wait`` seconds are the ones that are gone (a dead
    peer makes every survivor's collective fail at once).
    """
    op, group, seq, group_ranks = call.op, call.group, call.seq, list(call.ranks)
    where = f"{op} (collective #{seq} of group {group!r}, ranks {group_ranks}) failed on rank {rank}"
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
        who = (f"rank(s) {missing} did not report the failure: they are gone, or called "
               f"another collective as #{seq} of this group (a call that torch rejected on "
               "them only, or ranks calling different collectives: docs/guides/"
               "troubleshooting.md)")
    else:
        who = "every rank of the group saw the failure"
    return dist.DistBackendError(f"tpu_dist: {where}: {who}. XLA said: {error}")


def _parse_heartbeat(value: str) -> tuple[int, dict[str, int], set[int]]:
    """``"<count>|<progress>|<waiting>"`` -> (count, group -> last seq, ranks waited for)."""
    parts = value.split("|")
    if len(parts) != 3:
        return 0, {}, set()
    progress = {}
    for pair in filter(None, parts[1].split(",")):
        group, _, seq = pair.rpartition("=")
        progress[group] = int(seq)
    waiting = {int(r) for r in parts[2].split(",") if r}
    return int(parts[0] or 0), progress, waiting


def _host_id() -> str:
    """This host and PID namespace: peers with the same id see each other's processes."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def _pid_state(pid: int) -> str:
    """``"dead"``, ``"stopped"`` or ``"running"`` for a process of this host (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:
            return "running"
        return "running"
    if state in ("Z", "X"):
        return "dead"
    return "stopped" if state in ("T", "t") else "running"


def track(
    watchdog: Watchdog | None, work: TPUWork, call: Call
) -> Callable[[BaseException | None], None]:
    """The *track* stage: record ``call`` in the flight recorder and put its ``work`` under
    ``watchdog``; every call, p2p included, before it is dispatched (the first call of a
    program sets up XLA's communicators inside dispatch and blocks there until every peer
    arrives).

    Returns the callback the caller hands to ``work.on_done``: it closes the flight-record
    entry and takes the work off the watch when the work ends.

    Raises:
        torch.distributed.DistBackendError: the group failed earlier (raise policy).
    """
    if watchdog is not None:
        watchdog.check_usable(call.group, call.op)
    entry = flight_recorder.recorder().record(
        call.group, list(call.ranks), call.seq, call.op, call.blocks, call.shown_params
    )
    if watchdog is not None:
        watchdog.issued(call.group, call.seq)
        watchdog.watch(InFlight(
            work, call.group, list(call.ranks), call.seq, call.op, watchdog.now(),
            call.timeout.total_seconds(),
        ))

    def on_done(error: BaseException | None) -> None:
        flight_recorder.FlightRecorder.finish(entry, error)
        if watchdog is not None:
            watchdog.done(work)

    return on_done
