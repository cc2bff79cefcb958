"""A persistent world of worker processes for multi-process ``torch.distributed`` tests.

Starting a rank costs 2-3 s (importing torch and JAX), so a :class:`World` starts its N worker
processes once, initialises the default process group once in each, and then runs many *test
bodies* on them: one per :meth:`World.run` call, on every rank at the same time.

Usage, from a test module::

    import pytest
    import torch
    import torch.distributed as dist

    from tests.harness import World


    def _all_reduce_sum(rank: int, world_size: int, n: int) -> list[float]:
        # Module level (or a plain function in a test class): it is sent to the workers by
        # reference (file path + qualified name), and its arguments and result are pickled.
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t.tolist()


    @pytest.fixture(scope="module")
    def world2():
        with World(2, backend="gloo") as world:  # "tpu": the workers import tpu_dist
            yield world


    def test_all_reduce(world2: World) -> None:
        results = world2.run(_all_reduce_sum, 3)  # one result per rank, indexed by rank
        assert results == [[1.0, 1.0, 1.0]] * 2

``tests/conftest.py`` has fixtures that share worlds across a module's tests: ``worlds`` (a
cache: ``worlds(3, backend="tpu")``) and ``world`` (2 ranks of gloo, or an indirect parameter)::

    @pytest.mark.parametrize("n", [2, 3])
    def test_x(worlds: Callable[..., World], n: int) -> None:
        assert worlds(n).run(_all_reduce_sum, 1) == [[n * (n - 1) / 2]] * n

What each worker process does (forked from a ``forkserver`` that has imported torch and JAX
once, so a worker starts in well under a second instead of paying 2-3 s of imports; the server
never starts JAX's runtime, whose threads would make a fork deadlock):

1. Moves itself into its own process group (so that killing the world also kills anything the
   worker started), asks the kernel to SIGKILL it if its parent (the forkserver, which ends with
   the test process) dies, and sends its stdout
   and stderr to a log file of its own.
2. Sets ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``OMP_NUM_THREADS=1`` (unless set already, as ``torchrun`` does) and the
   world's extra ``env`` (torch and JAX are imported already: variables they read only at
   import time, such as ``XLA_FLAGS``, do not take effect; ``OMP_NUM_THREADS`` is applied with
   ``torch.set_num_threads``, as a fresh process's import would); then imports the backend's
   module (``tpu_dist`` for ``"tpu"``).
3. Calls ``dist.init_process_group(backend, rank=..., world_size=..., **init_kwargs)`` once.
   Rank 0 hosts the ``TCPStore`` on a port the kernel picks (port 0), so concurrent worlds, such
   as those of ``pytest -n 2``, never collide; the store is wrapped as ``env://`` would wrap it.
4. Runs bodies ``fn(rank, world_size, *args, **kwargs)`` until the world is closed, then calls
   ``dist.destroy_process_group()`` and exits.

Failures, all reported by :meth:`World.run` as a :class:`WorldError` (an ``AssertionError``):

* A body raises on some ranks, and every rank returns: the message names each failing rank with
  its full traceback (asserts in bodies are rewritten as pytest rewrites them). The world stays
  up for the next run.
* A rank does not return within the run's timeout (or within ``failure_grace`` seconds after
  another rank failed): every live rank's Python stacks are dumped with ``faulthandler``
  (SIGUSR1) and put in the message, the world is killed, and the next run starts a fresh world.
  A stopped rank (SIGSTOP) can neither return nor dump: once only such ranks are left, the
  grace ends at once and their stacks read ``(stopped: SIGSTOP, no stacks)``.
* A rank dies (``os._exit``, a signal, a segfault): detected at once; the message gives its exit
  code and the end of its output; the world is killed and restarted by the next run.

Whatever each rank prints during a run is copied to the test process's stderr with a
``[rank N]`` prefix, where pytest captures it and shows it for a failing test.

A World is not thread-safe: use it from one thread, the one that created it (the workers'
parent-death signal is tied to that thread).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import faulthandler
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import Any, NoReturn

from tests.launch_worker import free_port

__all__ = ["World", "WorldError", "close_all_worlds"]

# Backends whose module must be imported in each worker to register them with torch.
_BACKEND_MODULES: dict[str, str] = {"tpu": "tpu_dist"}

# How much of a dead rank's output a failure message keeps.
_OUTPUT_TAIL_CHARS = 6000
_NO_OUTPUT_AT_START = (
    "(no output; a worker that failed before redirecting its output, e.g. while unpickling "
    "its start arguments, wrote to the test process's stderr)"
)

# Every World not closed yet, closed at interpreter exit at the latest.
_LIVE_WORLDS: weakref.WeakSet[World] = weakref.WeakSet()


class WorldError(AssertionError):
    """A world failed to start, or a body failed on at least one rank.

    Attributes:
        errors: Rank -> formatted traceback, for each rank whose body (or startup) raised.
        exitcodes: Rank -> exit code, for each rank that died (negative: killed by that signal).
        stacks: Rank -> ``faulthandler`` dump of the rank's Python threads, for each live rank of
            a world that had to be killed (a rank timed out or died).
        timed_out: The ranks that neither returned nor died in time.
        restarted: True if the world was killed; the next :meth:`World.run` starts a fresh one.
    """

    def __init__(
        self,
        message: str,
        *,
        errors: Mapping[int, str],
        exitcodes: Mapping[int, int],
        stacks: Mapping[int, str],
        timed_out: Sequence[int],
        restarted: bool,
    ) -> None:
        super().__init__(message)
        self.errors = dict(errors)
        self.exitcodes = dict(exitcodes)
        self.stacks = dict(stacks)
        self.timed_out = list(timed_out)
        self.restarted = restarted


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WorkerConfig:
    """What a worker needs to start; pickled into the spawned process."""

    world_size: int
    backend: str
    backend_module: str | None
    env: dict[str, str | None]
    init: bool
    """Whether the worker calls ``init_process_group`` (else the bodies do)."""
    init_kwargs: dict[str, Any]
    master_port: int | None
    """Preset port when ``init`` is False; else rank 0's store picks one."""
    log_path: str
    parent_pid: int


@dataclasses.dataclass
class _Gathered:
    """What :meth:`World._gather` got back from the ranks it waited for."""

    replies: dict[int, tuple[Any, ...]]
    dead: list[int]
    timed_out: list[int]


class World:
    """N worker processes with an initialised default process group, running test bodies.

    Args:
        world_size: Number of ranks (processes), all on this host.
        backend: The ``torch.distributed`` backend name passed to ``init_process_group``.
        backend_module: Module each worker imports before ``init_process_group`` (it registers
            the backend). Default: ``"tpu_dist"`` for ``"tpu"``, none otherwise.
        env: Extra environment variables for the workers, set when the worker starts (for
            example ``TPU_DIST_PLATFORM`` or ``TORCH_DISTRIBUTED_DEBUG``). A ``None`` value
            removes the variable.
        init_kwargs: Extra keyword arguments for ``init_process_group`` (for example
            ``timeout=datetime.timedelta(seconds=20)``); ``timeout`` is also the store's timeout.
        init: If False, workers do not call ``init_process_group``; ``MASTER_PORT`` is a free
            port picked by the test process, for bodies that initialise the group themselves.
        timeout: Default seconds a :meth:`run` waits for all ranks.
        start_timeout: Seconds to wait for all workers to start and initialise.
        failure_grace: Seconds the other ranks get to return once a rank failed or died (a rank
            that raised usually leaves its peers blocked in a collective).
        close_timeout: Seconds :meth:`close` waits for workers to exit before killing them.

    The world starts on ``__enter__`` (or :meth:`start`, or the first :meth:`run`). Use it as a
    context manager, or call :meth:`close`; any world left open is closed at interpreter exit.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        *,
        backend_module: str | None = None,
        env: Mapping[str, str | None] | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
        init: bool = True,
        timeout: float = 60.0,
        start_timeout: float = 120.0,
        failure_grace: float = 5.0,
        close_timeout: float = 10.0,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size=}")
        for name, value in (
            ("timeout", timeout),
            ("start_timeout", start_timeout),
            ("close_timeout", close_timeout),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive seconds, got {value}")
        if failure_grace < 0:
            raise ValueError(f"failure_grace must be >= 0 seconds, got {failure_grace}")
        reserved = _RESERVED_INIT_KWARGS.intersection(init_kwargs or {})
        if reserved:
            raise ValueError(
                f"init_kwargs must not set {sorted(reserved)}: the World sets them itself"
            )
        self.world_size = world_size
        self.backend = backend
        self.backend_module = (
            backend_module if backend_module is not None else _BACKEND_MODULES.get(backend)
        )
        self.env = dict(env or {})
        self.init_kwargs = dict(init_kwargs or {})
        self.init = init
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.failure_grace = failure_grace
        self.close_timeout = close_timeout
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._log_paths: list[str] = []
        self._log_dir: str | None = None
        self._generation = 0

    def __repr__(self) -> str:
        return f"World({self.world_size}, backend={self.backend!r})"

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, indexed by rank; empty when the world is not running."""
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> None:
        """Start the workers and initialise the process group; a no-op if already running.

        Raises:
            WorldError: A worker raised, died or hung while starting; the workers are killed.
        """
        if self._procs:
            return
        self._generation += 1
        if self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix=f"world{self.world_size}_")
        _LIVE_WORLDS.add(self)
        try:
            self._spawn()
            self._await_ready()
        except BaseException:
            # A WorldError has cleaned up already; anything else (e.g. KeyboardInterrupt) has not.
            self._kill()
            self._discard()
            raise

    def _spawn(self) -> None:
        """Start one worker process per rank."""
        assert self._log_dir is not None
        ctx = _worker_context()
        master_port = None if self.init else free_port()
        for rank in range(self.world_size):
            log_path = os.path.join(self._log_dir, f"gen{self._generation}_rank{rank}.log")
            open(log_path, "wb").close()
            config = _WorkerConfig(
                world_size=self.world_size,
                backend=self.backend,
                backend_module=self.backend_module,
                env=self.env,
                init=self.init,
                init_kwargs=self.init_kwargs,
                master_port=master_port,
                log_path=log_path,
                parent_pid=_forkserver_pid(ctx),
            )
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, config, child_conn),
                name=f"world{self.world_size}-rank{rank}",
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._log_paths.append(log_path)

    def _await_ready(self) -> None:
        """Relay rank 0's store port to the other ranks, then wait until all are initialised."""
        offsets = [0] * self.world_size
        what = f"starting {self!r}"
        late = f"did not start in {self.start_timeout:g} s"
        deadline = time.monotonic() + self.start_timeout
        if self.init:
            # Rank 0 binds the store to a port of the kernel's choosing and tells us which.
            got = self._gather([0], deadline)
            reply = got.replies.get(0)
            if reply is None or reply[0] != "port":
                # Collect the other ranks' errors too (they often fail the same way).
                grace = min(deadline, time.monotonic() + self.failure_grace)
                others = self._gather(range(1, self.world_size), grace)
                got = _Gathered(
                    replies={**others.replies, **got.replies},
                    dead=sorted(got.dead + others.dead),
                    timed_out=sorted(got.timed_out + others.timed_out),
                )
                self._fail(what, got, offsets, late, starting=True)
            for rank in range(1, self.world_size):
                self._send(rank, ("port", reply[1]))
        got = self._gather(range(self.world_size), deadline)
        if got.dead or got.timed_out or any(r[0] != "ready" for r in got.replies.values()):
            self._fail(what, got, offsets, late, starting=True)
        self._echo_output(offsets)

    def restart(self) -> None:
        """Close the world (gracefully if it is healthy) and start a fresh one."""
        self.close()
        self.start()

    def close(self) -> None:
        """Stop the workers: each destroys its process group and exits; stragglers are killed.

        Waits up to ``close_timeout`` seconds, then SIGTERMs and finally SIGKILLs each worker's
        process group. Idempotent.
        """
        if self._procs:
            for rank in range(self.world_size):
                self._send(rank, ("stop",))
            deadline = time.monotonic() + self.close_timeout
            pending = {p.sentinel for p in self._procs}
            while pending and (left := deadline - time.monotonic()) > 0:
                pending -= set(multiprocessing.connection.wait(list(pending), left))
            if pending:
                self._signal_all(signal.SIGTERM)
                deadline = time.monotonic() + 2.0
                while pending and (left := deadline - time.monotonic()) > 0:
                    pending -= set(multiprocessing.connection.wait(list(pending), left))
            self._kill()  # Also kills whatever the workers left behind in their groups.
            self._discard()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
        _LIVE_WORLDS.discard(self)

    # -- running bodies ----------------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank and gather the results.

        All ranks start the body at about the same time; the call returns when every rank has
        returned. (A body argument named ``timeout`` must be passed positionally.)

        Args:
            fn: A module-level function, or a plain function defined in a class body, of a module
                that has a file; it is imported by the workers from that file.
            *args: Positional arguments for ``fn`` after ``rank, world_size``; pickled.
            timeout: Seconds the body may run, from when every rank has loaded it (importing
                the test module in a worker the first time does not count; that is bounded by
                ``start_timeout``); default: the world's ``timeout``.
            **kwargs: Keyword arguments for ``fn``; pickled.

        Returns:
            The return values of ``fn``, indexed by rank (each must be picklable).

        Raises:
            WorldError: The body raised on some rank (the world stays up), or a rank did not
                return in time or died (the world is killed and the next run starts a fresh one).
            TypeError: ``fn`` cannot be sent by reference, or the arguments cannot be pickled.
        """
        timeout = self.timeout if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        module_name, path, qualname = _body_ref(fn)
        try:
            message = pickle.dumps(
                ("run", module_name, path, qualname, args, kwargs), pickle.HIGHEST_PROTOCOL
            )
        except Exception as err:
            raise TypeError(
                f"the arguments of {qualname} cannot be pickled for the workers: {err}"
            ) from err
        self._restart_if_dead()
        self.start()

        offsets = [_file_size(p) for p in self._log_paths]
        what = f"{self!r}.run({module_name}.{qualname})"
        try:
            for rank in range(self.world_size):
                self._send(rank, message, pickled=True)
            # Each rank first says that it has the body: importing a test module in a worker
            # the first time can take seconds on a loaded machine, and does not count against
            # the body's timeout.
            loaded = self._gather(range(self.world_size), time.monotonic() + self.start_timeout)
            if loaded.dead or loaded.timed_out:
                late = f"did not load the body in {self.start_timeout:g} s"
                self._fail(what, loaded, offsets, late)
            running = sorted(r for r, reply in loaded.replies.items() if reply[0] == "loaded")
            got = self._gather(
                running,
                time.monotonic() + timeout,
                failed=len(running) < self.world_size,
            )
        except WorldError:
            raise
        except BaseException:
            # Interrupted (e.g. KeyboardInterrupt) with replies in flight: the world is unusable.
            self._kill()
            self._discard()
            raise
        for rank, reply in loaded.replies.items():
            if reply[0] != "loaded":  # The rank could not load the body (or its arguments).
                got.replies[rank] = reply
        if got.dead or got.timed_out or self._any_dead():
            self._fail(what, got, offsets, f"did not return within {timeout:g} s")
        errors = {r: reply[1] for r, reply in sorted(got.replies.items()) if reply[0] == "error"}
        self._echo_output(offsets)
        if errors:
            ranks = ", ".join(map(str, errors))
            parts = [
                f"{what} raised on rank{'s' if len(errors) > 1 else ''} {ranks} "
                f"of {self.world_size}; every rank returned, so the world stays up."
            ]
            parts += [f"=== rank {r}: raised ===\n{tb.rstrip()}" for r, tb in errors.items()]
            raise WorldError(
                "\n\n".join(parts),
                errors=errors,
                exitcodes={},
                stacks={},
                timed_out=[],
                restarted=False,
            )
        return [got.replies[r][1] for r in range(self.world_size)]

    # -- internals ---------------------------------------------------------------------------

    def _send(self, rank: int, message: Any, *, pickled: bool = False) -> None:
        """Send a message to a rank, ignoring a closed pipe (its death is detected elsewhere)."""
        data = message if pickled else pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with contextlib.suppress(OSError):
            self._conns[rank].send_bytes(data)

    def _gather(self, ranks: Iterable[int], deadline: float, *, failed: bool = False) -> _Gathered:
        """Wait for one message from each of ``ranks``, or its death, or the deadline.

        Once a rank has raised or died (or from the start, if ``failed``), the others get at
        most ``failure_grace`` more seconds.
        """
        ranks = list(ranks)
        replies: dict[int, tuple[Any, ...]] = {}
        dead: list[int] = []
        failed_at: float | None = time.monotonic() if failed else None
        while pending := [r for r in ranks if r not in replies and r not in dead]:
            limit = deadline if failed_at is None else min(deadline, failed_at + self.failure_grace)
            left = limit - time.monotonic()
            if left <= 0:
                break
            if failed_at is not None:
                # A stopped rank (SIGSTOP) cannot return: once only such ranks are left, the
                # grace is over. Look again every half second while others may still return.
                if all(self._stopped(r) for r in pending):
                    break
                left = min(left, 0.5)
            by_handle: dict[Any, tuple[int, bool]] = {}
            for rank in pending:
                by_handle[self._conns[rank]] = (rank, True)
                by_handle[self._procs[rank].sentinel] = (rank, False)
            for handle in multiprocessing.connection.wait(list(by_handle), left):
                rank, is_conn = by_handle[handle]
                if rank in replies or rank in dead:
                    continue
                conn = self._conns[rank]
                # A process that exited may have sent its reply first: read it if so.
                if is_conn or conn.poll():
                    try:
                        replies[rank] = _load_reply(conn.recv_bytes())
                    except (EOFError, OSError):
                        dead.append(rank)
                else:
                    dead.append(rank)
                if rank in dead or replies[rank][0] == "error":
                    failed_at = failed_at or time.monotonic()
        timed_out = [r for r in ranks if r not in replies and r not in dead]
        return _Gathered(replies=replies, dead=sorted(dead), timed_out=timed_out)

    def _any_dead(self) -> bool:
        """Whether any worker has exited (without reaping it)."""
        sentinels = [p.sentinel for p in self._procs]
        return bool(multiprocessing.connection.wait(sentinels, 0))

    def _restart_if_dead(self) -> None:
        """Restart a world a worker of which died between runs, with a warning."""
        if not self._procs or not self._any_dead():
            return
        self._kill()
        codes = {r: p.exitcode for r, p in enumerate(self._procs)}
        self._discard()
        warnings.warn(
            f"{self!r}: a worker died between runs (exit codes by rank: {codes}); restarting it",
            RuntimeWarning,
            stacklevel=3,
        )

    def _fail(
        self,
        what: str,
        got: _Gathered,
        offsets: Sequence[int],
        late: str,
        *,
        starting: bool = False,
    ) -> NoReturn:
        """Kill the broken world and raise a WorldError with everything known about it.

        ``late`` says what the ranks that timed out did not do, e.g. "did not return in 2 s".
        """
        alive = [
            r
            for r, p in enumerate(self._procs)
            if not multiprocessing.connection.wait([p.sentinel], 0)
        ]
        stack_offsets = [_file_size(p) for p in self._log_paths]
        # On a hang, every live rank's stacks (where the others wait matters too); after a
        # death with all other ranks accounted for, there is nothing to learn from them.
        stacks = self._dump_stacks(alive, stack_offsets) if alive and got.timed_out else {}
        self._kill()
        exitcodes = {r: p.exitcode for r, p in enumerate(self._procs)}
        errors = {r: reply[1] for r, reply in sorted(got.replies.items()) if reply[0] == "error"}
        died = sorted(set(got.dead) | {r for r in exitcodes if r not in alive})
        outputs = {r: _read(self._log_paths[r], offsets[r]) for r in died}
        self._echo_output(offsets, stack_offsets)
        self._discard()

        summary = []
        if errors:
            summary.append(f"rank(s) {', '.join(map(str, errors))} raised")
        for rank in died:
            summary.append(f"rank {rank} {_describe_exit(exitcodes[rank])}")
        if got.timed_out:
            summary.append(
                f"rank(s) {', '.join(map(str, got.timed_out))} {late}"
                + (f" (or {self.failure_grace:g} s after the failure)" if errors or died else "")
            )
        parts = [
            f"{what} failed on {self.world_size} ranks: {'; '.join(summary)}. The world was "
            "killed; the next run() starts a fresh one."
        ]
        for rank in range(self.world_size):
            if rank in errors:
                parts.append(f"=== rank {rank}: raised ===\n{errors[rank].rstrip()}")
            if rank in died:
                tail = outputs[rank][-_OUTPUT_TAIL_CHARS:].rstrip()
                tail = tail or (_NO_OUTPUT_AT_START if starting else "(no output)")
                parts.append(
                    f"=== rank {rank}: {_describe_exit(exitcodes[rank])}; its output ===\n{tail}"
                )
            if rank in stacks:
                state = "did not return" if rank in got.timed_out else "returned"
                parts.append(
                    f"=== rank {rank} ({state}): Python stacks (faulthandler) ===\n"
                    f"{stacks[rank].rstrip() or '(no dump: the rank did not respond to SIGUSR1)'}"
                )
        raise WorldError(
            "\n\n".join(parts),
            errors=errors,
            exitcodes={r: exitcodes[r] for r in died},
            stacks=stacks,
            timed_out=got.timed_out,
            restarted=True,
        )

    def _stopped(self, rank: int) -> bool:
        """Whether ``rank``'s worker is stopped (SIGSTOP: state T), so it can run no handler."""
        try:
            with open(f"/proc/{self._procs[rank].pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return False

    def _dump_stacks(self, ranks: Sequence[int], offsets: Sequence[int]) -> dict[int, str]:
        """SIGUSR1 the ranks (faulthandler dumps all threads to stderr) and read the dumps.

        A stopped rank cannot dump: it gets a note saying so instead of a 5 s wait.
        """
        stopped = {rank: "(stopped: SIGSTOP, no stacks)" for rank in ranks if self._stopped(rank)}
        ranks = [rank for rank in ranks if rank not in stopped]
        if not ranks:
            return stopped
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        dumps = {rank: "" for rank in ranks}
        stable = dict.fromkeys(ranks, 0)
        deadline = time.monotonic() + 5.0
        while any(n < 3 for n in stable.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            for rank in ranks:
                text = _read(self._log_paths[rank], offsets[rank])
                # faulthandler writes the whole dump from the signal handler: a dump that has
                # not grown for 0.3 s is complete.
                stable[rank] = stable[rank] + 1 if text and text == dumps[rank] else 0
                dumps[rank] = text
        return {**dumps, **stopped}

    def _signal_all(self, sig: signal.Signals) -> None:
        """Signal each worker's process group (the worker and anything it started).

        Only workers whose exit has not been reported are signalled: the pid of a reaped worker
        may belong to an unrelated process by now. (Workers are children of the forkserver,
        which reaps them and reports their exit codes.)
        """
        for proc in self._procs:
            if proc.pid is None or proc.exitcode is not None:
                continue
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(proc.pid, sig)

    def _kill(self) -> None:
        """SIGKILL every worker's process group, reap the workers and close the pipes."""
        self._signal_all(signal.SIGKILL)
        for proc in self._procs:
            proc.join(10.0)
        for conn in self._conns:
            conn.close()
        survivors = [p.pid for p in self._procs if p.exitcode is None]
        if survivors:
            raise RuntimeError(f"{self!r}: workers {survivors} survived SIGKILL for 10 s")

    def _discard(self) -> None:
        """Forget the (killed and reaped) workers, so that the next run starts new ones."""
        self._procs, self._conns, self._log_paths = [], [], []

    def _echo_output(self, offsets: Sequence[int], ends: Sequence[int] | None = None) -> None:
        """Copy what each rank wrote since ``offsets`` to stderr, prefixed with its rank."""
        for rank, path in enumerate(self._log_paths):
            text = _read(path, offsets[rank], None if ends is None else ends[rank])
            for line in text.splitlines():
                sys.stderr.write(f"[rank {rank}] {line}\n")


def close_all_worlds() -> None:
    """Close every World not closed yet (run at interpreter exit, and by ``tests/conftest.py``)."""
    for world in list(_LIVE_WORLDS):
        world.close()


# Registered after multiprocessing's own exit handler (imported above), so it runs first: that
# handler joins every child process, which would wait forever on a hung worker.
atexit.register(close_all_worlds)


# -- helpers of the test process -------------------------------------------------------------


def _body_ref(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """The (module name, module file, qualified name) by which workers import ``fn``."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname:
        raise TypeError(
            f"{fn!r} cannot be sent to the workers by reference: a body must be a module-level "
            "function, or a plain function in a class body (not a lambda, closure, nested "
            "function, bound method or partial)"
        )
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path:
        raise TypeError(
            f"{module_name}.{qualname} cannot be sent to the workers: its module {module_name!r} "
            "has no file to import it from; define bodies in a module file"
        )
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        raise TypeError(
            f"{module_name}.{qualname} does not resolve to {fn!r}, so the workers would run "
            "something else; pass a module-level function (not a bound method)"
        )
    return module_name, os.path.abspath(path), qualname


def _load_reply(data: bytes) -> tuple[Any, ...]:
    """Unpickle a worker's reply; a result that cannot be unpickled here becomes an error."""
    try:
        return pickle.loads(data)
    except Exception:
        return ("error", f"the rank's reply could not be unpickled:\n{traceback.format_exc()}")


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, start: int, end: int | None = None) -> str:
    """The text of a log file from byte ``start`` to ``end`` (default: its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
    return f"exited with code {code}"


# -- the worker process ----------------------------------------------------------------------

_RESERVED_INIT_KWARGS = frozenset({"backend", "init_method", "store", "rank", "world_size"})


def _worker_main(
    rank: int, config: _WorkerConfig, conn: multiprocessing.connection.Connection
) -> None:
    """Entry point of a worker: start, then run bodies until told to stop."""
    os.setpgid(0, 0)
    _set_parent_death_signal(config.parent_pid)
    fd = os.open(config.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    try:
        _start_worker(rank, config, conn)
    except BaseException as exc:
        _reply(conn, ("error", _format_exception(exc)))
        if rank == 0 and config.init:
            _linger(conn)
        sys.exit(1)
    _serve(rank, config, conn)


def _linger(conn: multiprocessing.connection.Connection) -> None:
    """Keep rank 0, and so the store it hosts, up until the test process ends the world.

    In a real job the launcher's agent hosts the store, so a rank that fails to start leaves
    it behind; here rank 0 hosts it, and if rank 0 exited at once a slower peer would fail on
    the vanished store (a C++ connection error) instead of on whatever it was going to raise.
    Measured: ``test_settings_init``'s rank 1 did so at load 10."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        with contextlib.suppress(Exception):
            if pickle.loads(data)[0] == "stop":
                return


_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
    "jax", "jax.numpy", "numpy", "pytest",
]
"""What the forkserver imports once, so that no worker does. Beyond torch and JAX: DTensor
(``torch.distributed.tensor``: FSDP2, TP and DTensor bodies), ``torch._dynamo`` (which torch's
functional collectives import at their first call, and DTensor through them) and pytest (every
worker imports its test module, which imports pytest). Each worker imported those itself
before: about 1.6 CPU-s per worker of a DTensor or funcol module; six collective and DTensor
modules took 235-241 CPU-s and 156-159 s without them, 165-171 CPU-s and 121-126 s with them
(docs/decisions/0030-test-suite-time.md). None of them starts a thread."""


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers fork from a server that has imported :data:`_PRELOAD` once (JAX not started).

    Importing torch and JAX costs a worker 2-3 s of CPU; the forkserver pays it once per test
    process. Nothing in the server starts JAX's runtime threads (fork after that deadlocks):
    each worker starts JAX itself, as a spawned process would.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _forkserver_pid(ctx: multiprocessing.context.BaseContext) -> int:
    """The pid of the forkserver, the workers' parent (it exits when this process does)."""
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_pid


def _set_parent_death_signal(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # The parent died before the prctl took effect.
        os._exit(1)


def _apply_thread_count() -> None:
    """Make the worker's ``OMP_NUM_THREADS`` the size of torch's intra-op pool.

    torch (its OpenMP runtime) reads the variable when it is imported, which for a worker was
    in the forkserver, before the worker's environment was set; ``torch.set_num_threads`` is
    what a fresh process's import would have done with it. Without it each rank of a world ran
    torch's ops on as many threads as the machine has cores: on 2 cores a 4-rank world's
    threads spun against each other, and ``tests/test_fsdp_tp_ddp.py`` took 64 s instead of 35
    (docs/decisions/0030-test-suite-time.md)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        if torch.get_num_threads() != int(value):
            torch.set_num_threads(int(value))


def _start_worker(
    rank: int, config: _WorkerConfig, conn: multiprocessing.connection.Connection
) -> None:
    """Set the environment, import the backend and initialise the default process group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(config.world_size),
    )
    if config.master_port is not None:
        os.environ["MASTER_PORT"] = str(config.master_port)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for key, value in config.env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _apply_thread_count()

    if config.backend_module:
        importlib.import_module(config.backend_module)
    import torch.distributed as dist

    if not config.init:
        _reply(conn, ("ready",))
        return
    # What init_process_group("env://") would build, except that rank 0's store binds a port of
    # the kernel's choosing, which no other world can race for.
    timeout = config.init_kwargs.get("timeout") or datetime.timedelta(minutes=30)
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            config.world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
        port = store.port
        _reply(conn, ("port", port))
    else:
        message = pickle.loads(conn.recv_bytes())
        port = message[1]
        store = dist.TCPStore(
            "127.0.0.1", port, config.world_size, is_master=False, timeout=timeout
        )
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        config.backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=config.world_size,
        **config.init_kwargs,
    )
    _reply(conn, ("ready",))


def _serve(rank: int, config: _WorkerConfig, conn: multiprocessing.connection.Connection) -> None:
    """Run bodies until a "stop" message (or the parent's death), then leave the group."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)  # The test process is gone: no one to report to.
        try:
            message = pickle.loads(data)
            if message[0] == "stop":
                break
            _, module_name, path, qualname, args, kwargs = message
            fn = _resolve(module_name, path, qualname)
        except BaseException as exc:
            reply: tuple[Any, ...] = ("error", _format_exception(exc))
        else:
            _reply(conn, ("loaded",))
            before = _live_groups()
            try:
                reply = ("ok", fn(rank, config.world_size, *args, **kwargs))
            except BaseException as exc:
                reply = ("error", _format_exception(exc, skip_frames=1))
            try:
                _destroy_groups_since(before)
            except BaseException as exc:  # the world is broken: the test says so
                reply = ("error", _format_exception(exc))
        sys.stdout.flush()
        sys.stderr.flush()
        _reply(conn, reply)

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _live_groups() -> list[Any]:
    """This rank's process groups (the default group's subgroups it is a member of)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map)


def _destroy_groups_since(before: list[Any]) -> None:
    """Destroy the groups the body made on this rank (whether it returned or raised), newest
    first, as a process that ends destroys them: the next body starts with the groups the
    world started with.

    Groups a body leaves behind would otherwise share their ranks with the next bodies' groups,
    and every call on ranks that two live "tpu" groups share is ordered by an agreement
    program first (``tpu_dist.collectives._dispatch.Dispatcher``): the later tests of a module
    would run slower than they do alone, and not as a user's process runs them.
    """
    import torch.distributed as dist

    known = set(map(id, before))
    for group in reversed(_live_groups()):
        if id(group) not in known and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _reply(conn: multiprocessing.connection.Connection, reply: tuple[Any, ...]) -> None:
    """Send a reply to the test process; an unpicklable result is reported as an error."""
    try:
        data = pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        data = pickle.dumps(
            ("error", f"the body's result could not be pickled:\n{_format_exception(exc)}")
        )
    conn.send_bytes(data)


def _format_exception(exc: BaseException, skip_frames: int = 0) -> str:
    """Format ``exc`` with its traceback, minus the harness's own outermost frames."""
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _resolve(module_name: str, path: str, qualname: str) -> Callable[..., Any]:
    """Find a body in this worker, importing its module from ``path`` the first time."""
    module = sys.modules.get(module_name)
    if module is None:
        module = _import_from_path(module_name, path)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _import_from_path(module_name: str, path: str) -> ModuleType:
    """Import a module from its file under its own name, rewriting asserts as pytest does.

    Registering it as ``module_name`` lets objects of that module be pickled both ways.
    """
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None:
        raise ImportError(f"cannot import {module_name!r} from {path!r}")
    module = importlib.util.module_from_spec(spec)
    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    _rewrite_asserts(tree, source, path)
    code = compile(tree, path, "exec", dont_inherit=True)
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _rewrite_asserts(tree: ast.Module, source: bytes, path: str) -> None:
    """Give failing asserts in bodies pytest's detailed messages, if pytest is available.

    Uses pytest's own rewriter (not a public API); without it, asserts stay plain.
    """
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return
    with contextlib.suppress(Exception):
        rewrite_asserts(tree, source, path)
