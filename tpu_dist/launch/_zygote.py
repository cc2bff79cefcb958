"""Workers forked from a process that imported torch and JAX once (a zygote), not each a fresh
interpreter that imports them itself.

Every worker of a job imports torch (1-2 s of CPU) and, at its first "tpu" group, JAX (about
1 s): each pays it, in parallel, and on a host with fewer free cores than workers one after
another. The launcher instead starts one *zygote* as soon as the workers' environment is
known: a Python that imports :data:`PRELOAD` (torch, ``torch.distributed``, JAX; no backend,
no thread), and :data:`DTENSOR_PRELOAD` too when the script imports a DTensor API
(:func:`script_preload`), while the launcher itself meets the other hosts, and then forks every
worker of every attempt. A worker forked from it is the process torch.distributed.elastic would
have started with ``python -u _worker.py MODE TARGET ARGS``, with the same

* environment (the whole of it, as elastic computed it: replaced after the fork), working
  directory, stdin/stdout/stderr (elastic's log files, or the launcher's own), argument vector
  and the ``-u`` streams; its own session (elastic stops a worker with ``killpg``);
* parent: the launcher. The zygote forks an intermediate that forks the worker and exits, and
  the launcher is a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``) while it asks, so the
  orphaned worker becomes the launcher's child: elastic waits for it, reads its exit code or
  signal, and signals it, as for a process it started itself; the worker's parent-death signal
  (``PR_SET_PDEATHSIG``, :mod:`._worker`) is tied to the launcher;
* entry: the worker runs :func:`tpu_dist.launch._worker.main`, loaded by path as the fresh
  interpreter would run it (nothing of ``tpu_dist`` imported before the user's program).

What differs: the modules of :data:`PRELOAD` are imported before the worker's own environment is
applied, so a variable they read *at import* takes the value the launcher had when it started
the zygote; a worker whose environment differs from the zygote's in any variable but those read
later (:data:`LATE_VARS`: elastic's per-worker ``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``, the
attempt's ``TPU_DIST_*``) is started fresh instead. Python's string hash seed is the zygote's,
the same in every worker (a fresh interpreter draws its own unless ``PYTHONHASHSEED`` is set);
Python's ``random``, numpy's global generator and torch's default generator are seeded from the
OS in each worker, as a fresh interpreter seeds them (each rank and each restart draws its own
numbers). The objects the preload created are frozen (``gc.freeze``: the
worker's cyclic collector never scans them, see :func:`_freeze`), but those of
:data:`AFTER_FREEZE`. With
``TPU_DIST_DEFAULT_FOR_CPU=1`` (``--default-for-cpu``), torch's import runs tpu_dist's
``torch.backends`` hook, which imports tpu_dist: in the zygote, so its notice that it became the
default CPU backend is printed once (by the zygote, without a ``[rankN]:`` prefix) instead of
once per worker. ``TPU_DIST_LAUNCH_PRELOAD=0`` turns the zygote off (every worker a fresh
interpreter, as before). Used only on Linux, for the ``python`` and ``module`` entries
(not ``--no-python`` or ``--run-path``), when the worker command is this interpreter; a zygote
that cannot start, preloads nothing or started a thread (a fork would not be safe) is not
used, and each worker is then started as before.

The zygote ends when the launcher closes its end of the socket, or when the launcher dies
(``PR_SET_PDEATHSIG``).

This file runs by path in the zygote (``python -u _zygote.py FD``), like ``_worker.py``: it
imports only the standard library before :data:`PRELOAD`.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "AFTER_FREEZE", "DTENSOR_PRELOAD", "LATE_VARS", "PRELOAD", "ForkedProcess", "Zygote",
    "close_fds", "early_differences", "early_usable", "enabled", "end_early", "open_fds",
    "open_standard_fds", "script_preload", "serve_forked",
]

PRELOAD = ("numpy", "torch", "torch.distributed", "jax")
"""What the zygote imports before it forks workers, in this order. numpy first: its BLAS starts
a pool of threads at import unless ``OMP_NUM_THREADS`` (or ``OPENBLAS_NUM_THREADS``) is 1
(tpu-launch sets 1 for several workers per host, as torchrun does), and a zygote with threads
is not used: it says so before it spends seconds on the rest."""

LATE_VARS = frozenset({
    # torch.distributed.elastic's, per worker and attempt (torchrun's own list)
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})
"""Variables a forked worker's environment may differ in from the zygote's: read only after
the worker starts (by ``init_process_group``, elastic's error handler), never while
:data:`PRELOAD` is imported; also tpu-launch's per-attempt ``TPU_DIST_LAUNCH_ATTEMPT`` and
``TPU_DIST_COORDINATION_SERVICE`` (read by tpu_dist's runtime). A worker whose environment
differs in any other variable is not forked (:meth:`Zygote.spawn`)."""


DTENSOR_PRELOAD = ("torch.distributed.tensor", "torch._dynamo")
"""What the zygote also imports for a script that uses DTensor (:func:`script_preload`): DTensor,
and ``torch._dynamo``, which torch's functional collectives (under DTensor, FSDP2 and TP) import at
their first call. In each worker of such a job they cost ~2 CPU-s; imported once in the zygote
instead, ``examples/train_fsdp.py --steps 2`` on 4 ranks took 6.6 s and 7.9 CPU-s instead of 9.4 s
and 14.3 (docs/decisions/0016-workers-forked-from-a-zygote.md). Other jobs do not import them: a
plain all_reduce job would start ~0.6 s later with them."""

AFTER_FREEZE = frozenset({"torch._dynamo"})
"""Modules the zygote imports after it froze the rest (:func:`_freeze`) where triton is
installed (torch's CUDA builds; :func:`_after_freeze`), leaving their objects to the collector.
``torch._dynamo`` imports triton, and triton 3.9's nanobind bindings (torch 2.15) check at exit
that every class they made was freed: a frozen one never is (a class is a reference cycle, and
no collection looks at frozen objects), so every worker printed ~27 ``nanobind: leaked ...``
lines at exit (issue 49). Left to the collector, as in a fresh worker, they are freed at exit:
~72,000 objects, torn down at each worker's exit (~0.25 CPU-s a worker); ~330,000 stay
frozen, and the start-up the preload saves is kept (docs/decisions/0032-torch-2.14-and-2.15.md).
Without triton (CPU builds) nothing of theirs checks, and everything is frozen."""

_DTENSOR_USERS = (
    "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed._composable",
    "torch.distributed.checkpoint", "torch.distributed.pipelining",
    "torch.distributed._functional_collectives", "torch._dynamo", "tpu_dist.dtensor_ext",
)
"""Modules (and their submodules) whose import by a script means it uses DTensor."""


def script_preload(path: str) -> tuple[str, ...]:
    """:data:`DTENSOR_PRELOAD` when the Python script at ``path`` imports (anywhere in the file:
    ``import``/``from ... import`` statements, read with :mod:`ast`, not run) a module of
    :data:`_DTENSOR_USERS` or a submodule of one, else ``()``. A script that cannot be read or
    parsed gets ``()``: its workers still start, as they would have."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if any(name == user or name.startswith(user + ".") for user in _DTENSOR_USERS):
                return DTENSOR_PRELOAD
    return ()


def _late_vars() -> frozenset[str]:
    # Imported here, in the launcher: this file runs by path in the zygote.
    from tpu_dist import _settings

    return LATE_VARS | {_settings.LAUNCH_ATTEMPT.env, _settings.COORDINATION_SERVICE.env}

def early_differences(
    env: Mapping[str, str], base: Mapping[str, str], late: frozenset[str]
) -> list[str]:
    """The variables ``env`` sets differently from ``base`` (or lacks), other than ``late``
    (read only after a process starts): a process that imported its modules with ``base``
    cannot become one started with ``env`` when any of them differ."""
    return sorted(k for k in set(env) | set(base) if env.get(k) != base.get(k) and k not in late)


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_MAX_MESSAGE = 1 << 24


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    head = len(data).to_bytes(4, "big")
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise EOFError("the other end closed the socket")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _recv(sock: socket.socket, nfds: int = 0) -> tuple[bytes, list[int]]:
    fds: list[int] = []
    if nfds:
        head, fds, _, _ = socket.recv_fds(sock, 4, nfds)
        if not head:
            raise EOFError("the other end closed the socket")
        head += _recv_exact(sock, 4 - len(head))
    else:
        head = _recv_exact(sock, 4)
    size = int.from_bytes(head, "big")
    if size > _MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes")
    return _recv_exact(sock, size), fds


# -- the launcher's process ---------------------------------------------------------------


def open_standard_fds() -> None:
    """Make each of the launcher's descriptors 0, 1 and 2 that is closed ``/dev/null``.

    Started with one of them closed (``<&-``, a daemon's environment), the launcher's next open
    file or socket would take its number, and every worker would inherit that as its stdin (a
    fresh worker a log file, a forked one the zygote's socket). As ``/dev/null``, fresh and
    forked workers alike read end-of-file from stdin, as under a shell's ``</dev/null``."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:  # a lower one was closed too and took it: the loop reaches it
                os.dup2(opened, fd)
                os.close(opened)
            os.set_inheritable(fd, True)  # Python opens files close-on-exec


def open_fds() -> list[int]:
    """This process's open descriptors above 2 (what a process it forks inherits, besides its
    standard streams)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.fstat(fd)  # the listing's own descriptor is closed by now
            except OSError:
                continue
            found.append(fd)
    return found


def close_fds(fds: Sequence[int]) -> None:
    """Close ``fds`` (those already closed are skipped): in a zygote forked from the launcher,
    what the launcher inherited from whoever started it, which a fresh worker never sees
    (elastic starts it with ``close_fds``)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- the launcher's side ---------------------------------------------------------------------


class ForkedProcess:
    """A worker forked by the zygote, now the launcher's child: what elastic uses of a
    ``subprocess.Popen`` (``pid``, ``returncode``, ``poll``, ``wait``, signals)."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere; its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, 0)
                except ChildProcessError:
                    self.returncode = 255
                    break
                except InterruptedError:
                    continue
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        end = time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            left = end - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            delay = min(delay * 2, left, 0.05)
            time.sleep(delay)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's handle on its zygote (module doc): :meth:`spawn` forks a worker."""

    def __init__(
        self, python: str, env: Mapping[str, str], also: Sequence[str] = (), early: Any = None
    ) -> None:
        """Start the zygote with ``env``; it imports :data:`PRELOAD`, then ``also`` (module
        names, e.g. :func:`script_preload`'s). With ``early`` (``_tpu_dist_launch``'s
        ``EarlyZygote``, which :func:`early_usable` accepted), the zygote forked from this
        launcher after its torch import is told to go on instead: its environment becomes
        ``env`` before it imports the rest.

        Raises:
            OSError: the zygote could not be started (or ``early`` is gone).
        """
        self.python = python
        self.env = dict(env)
        """The environment the zygote imported :data:`PRELOAD` in."""
        self._ready: bool | None = None
        self.why_not: str | None = None
        """Why the zygote is not used (after a failed :meth:`spawn`)."""
        if early is not None:
            self._sock = early.sock
            self.proc: Any = ForkedProcess(early.pid, ["tpu-launch zygote"])
            try:
                _send(self._sock, json.dumps({"env": self.env, "also": list(also)}).encode())
            except OSError:
                self.close()
                raise
            return
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [python, "-u", os.path.abspath(__file__), str(theirs.fileno()), str(os.getpid()),
                 ",".join(also)],
                env=dict(env),
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                # Not in the launcher's process group: a Ctrl-C at the terminal reaches the
                # launcher (which stops its workers), not the zygote (which would print a
                # KeyboardInterrupt); it ends with the launcher.
                start_new_session=True,
            )
        finally:
            theirs.close()

    def _check_ready(self) -> bool:
        if self._ready is None:
            try:
                data, _ = _recv(self._sock)
                ready = json.loads(data)
            except (OSError, EOFError, ValueError) as err:
                ready = {"ok": False, "why": f"the zygote ended before it was ready ({err})"}
            self._ready = bool(ready.get("ok"))
            if not self._ready:
                self.why_not = ready.get("why", "unknown")
                self.close()
        return self._ready

    def spawn(
        self, args: Sequence[str], env: Mapping[str, str], stdout: Any, stderr: Any
    ) -> ForkedProcess | None:
        """Fork a worker running ``args`` (``python -u _worker.py ...``) with ``env``, its output
        to the files ``stdout``/``stderr`` (None: the launcher's); None when the zygote cannot
        (:attr:`why_not`): the caller starts the worker itself."""
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
        if (
            len(args) < 3
            or args[0] != self.python
            or args[1] != "-u"
            or os.path.abspath(args[2]) != worker
        ):
            return None
        differ = early_differences(env, self.env, _late_vars())
        if differ:
            self.why_not = (
                f"the worker's environment differs from the zygote's in {', '.join(differ)}"
            )
            return None
        if not self._check_ready():
            return None
        fds = [
            0,
            stdout.fileno() if stdout is not None else 1,
            stderr.fileno() if stderr is not None else 2,
        ]
        request = {
            "argv": list(args[3:]), "env": dict(env), "cwd": os.getcwd(),
            "ignored": _ignored_signals(),
        }
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        try:
            _send(self._sock, json.dumps(request).encode(), fds)
            data, _ = _recv(self._sock)
            reply = json.loads(data)
        except (OSError, EOFError, ValueError) as err:
            self.why_not = f"the zygote failed ({err})"
            self.close()
            return None
        finally:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        if "pid" not in reply:
            self.why_not = reply.get("why", "unknown")
            return None
        return ForkedProcess(int(reply["pid"]), args)

    def close(self) -> None:
        """End the zygote (its workers live on: they are the launcher's children). A zygote
        still importing (the launcher stopped before its first worker: a signal, a failed
        rendezvous) reads no socket yet and is killed, so the launcher does not wait for it."""
        self._ready = False
        try:
            self._sock.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_SET_AFTER_TORCH_IMPORT = ("TPU_DIST_", "JAX_", "XLA_", "TPU_", "CLOUD_TPU_", "LIBTPU_")
"""Prefixes of the variables an early zygote's environment may lack or differ in: the launcher
sets them for the workers (platform, topology, chips, its own bookkeeping), and nothing reads
them while numpy, torch and ``torch.distributed`` are imported (JAX, libtpu and tpu_dist read
them later; with TorchTPU loaded by torch there is no early zygote). Two are read then, by
tpu_dist's ``torch.backends`` hook, and must agree: the backend's name and the default for CPU
tensors (:func:`early_usable`)."""


def early_usable(early: Any, python: str, env: Mapping[str, str]) -> str | None:
    """Why the zygote ``_tpu_dist_launch`` forked (``early``) cannot serve workers started by
    ``python`` with ``env`` (the workers' shared environment), or None when it can."""
    from tpu_dist import _settings  # in the launcher, as in _late_vars

    if python != sys.executable:
        return f"the workers run {python}, not {sys.executable}"
    read_by_hook = {_settings.BACKEND_NAME.env, _settings.DEFAULT_FOR_CPU.env}
    differ = [
        name for name in early_differences(env, early.env, _late_vars())
        if not name.startswith(_SET_AFTER_TORCH_IMPORT) or name in read_by_hook
    ]
    if differ:
        return f"torch was imported with {', '.join(differ)} other than the workers have"
    return None


def end_early(early: Any) -> None:
    """End the zygote ``_tpu_dist_launch`` forked, unused: it leaves when its socket closes."""
    early.sock.close()
    proc = ForkedProcess(early.pid, ["tpu-launch zygote"])
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether workers fork from a zygote: on Linux, unless ``TPU_DIST_LAUNCH_PRELOAD=0``.

    Raises:
        ValueError: ``TPU_DIST_LAUNCH_PRELOAD`` is not a switch.
    """
    from tpu_dist import _settings  # in the launcher, as in _late_vars

    return sys.platform.startswith("linux") and _settings.LAUNCH_PRELOAD.get(environ)


# -- the zygote's side -----------------------------------------------------------------------


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _serve(fd: int, launcher: int, also: Sequence[str] = ()) -> list[str]:
    """The zygote: preload (:data:`PRELOAD`, then ``also``), then fork a worker per request.
    Returns only in a forked worker, with the worker entry's arguments."""
    sock = socket.socket(fileno=fd)
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != launcher:
        os._exit(0)
    return _preload_and_serve(sock, (*PRELOAD, *also))


def _after_freeze(name: str) -> bool:
    """Whether the zygote imports ``name`` after the freeze (:data:`AFTER_FREEZE`)."""
    import importlib.util

    return name in AFTER_FREEZE and importlib.util.find_spec("triton") is not None


def _preload_and_serve(sock: socket.socket, names: Sequence[str]) -> list[str]:
    loaded, why, frozen = [], None, False
    gc.disable()  # see _freeze
    for name in names:
        if not frozen and _after_freeze(name):
            _freeze()
            frozen = True
        try:
            __import__(name)
            loaded.append(name)
        except ImportError:
            continue
        threads = _threads()
        if threads != 1:
            why = f"{threads} threads after importing {name} (a fork would not be safe)"
            break
    if why is None and not loaded:
        why = f"none of {', '.join(PRELOAD)} imports"
    if why is not None:
        _send(sock, json.dumps({"ok": False, "why": why}).encode())
        os._exit(0)
    if frozen:
        gc.collect()  # what AFTER_FREEZE's imports left, once; the rest to the oldest generation
    else:
        _freeze()
    gc.enable()
    _send(sock, json.dumps({"ok": True, "loaded": loaded}).encode())
    while True:
        try:
            data, fds = _recv(sock, 3)
        except (OSError, EOFError, ValueError):
            os._exit(0)
        try:
            request = json.loads(data)
            pid = _fork_worker(sock, request, fds)
        except Exception as err:  # noqa: BLE001 - reported to the launcher, which falls back
            for f in fds:
                os.close(f)
            _send(sock, json.dumps({"why": f"{type(err).__name__}: {err}"}).encode())
            continue
        if pid == 0:  # the worker
            return list(request["argv"])
        for f in fds:
            os.close(f)
        _send(sock, json.dumps({"pid": pid}).encode())


def serve_forked(fd: int, launcher: int) -> None:
    """The zygote that tpu-launch's entry (``_tpu_dist_launch``) forked from the launcher after
    importing numpy, torch and ``torch.distributed`` (in a session of its own already): made
    what the zygote started as a new interpreter is (stdin from ``/dev/null``, the ``-u``
    streams, the same ``sys.path``), it waits for the launcher's ``go`` (the workers'
    environment, and what else to preload: :class:`Zygote` with ``early``), then preloads the
    rest and serves as that zygote does. Returns only in a forked worker, once the worker entry
    returned."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != launcher:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _unbuffered_streams()
    if sys.stdin is None:  # the launcher started with fd 0 closed; a new interpreter has one
        import io

        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(
            io.BufferedReader(io.FileIO(0, "rb", closefd=False)), encoding=encoding
        )
    sys.path[0] = os.devnull  # as in the zygote's own interpreter (the __main__ block below)
    sock = socket.socket(fileno=fd)
    try:
        data, _ = _recv(sock)
        go = json.loads(data)
    except (OSError, EOFError, ValueError):
        os._exit(0)
    os.environ.clear()
    os.environ.update(go["env"])
    entry = _load_worker_entry()
    argv = _preload_and_serve(sock, (*PRELOAD, *go["also"]))
    sys.argv = [entry.__file__, *argv]
    entry.main(argv)


def _unbuffered_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` as ``python -u`` makes them (how the zygote's own
    interpreter and every fresh worker run): text written through to an unbuffered file."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if old is None or (isinstance(old.buffer, io.FileIO) and old.write_through):
            continue
        old.flush()
        new = io.TextIOWrapper(io.FileIO(fd, "wb", closefd=False), encoding=old.encoding,
                               errors=old.errors, write_through=True)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _freeze() -> None:
    """After the preload (imported with the collector off) but for :data:`AFTER_FREEZE`:
    collect its garbage once and move every object left to the collector's permanent
    generation (``gc.freeze``); the caller turns the collector back on.

    numpy, torch, ``torch.distributed`` and JAX leave ~230,000 objects. A fresh interpreter's
    collector runs about 500 times while importing them (0.36-0.40 of the ~2.5 CPU-s), and
    every full collection in a worker would scan them all again (0.13 CPU-s each) and write to
    the pages that hold them, copying those pages out of the zygote into the worker. Frozen,
    no worker's collector scans them (with the launcher's own import also collector-free, a
    4-rank job took 6.7 CPU-s instead of 8.7: decision records 0016 and 0018 in docs/decisions/).
    What differs from a
    fresh worker: a reference cycle among those objects that becomes garbage in the worker is
    never freed (none of torch's or JAX's module state becomes garbage while in use), nor at
    exit: the process ends without tearing them down (a fresh worker spends ~1 CPU-s on that),
    which is why what checks its objects at exit is left out (:data:`AFTER_FREEZE`)."""
    gc.collect()
    gc.freeze()


def _fork_worker(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
    """In the zygote: fork an intermediate that forks the worker and exits, so that the worker
    is orphaned to the launcher (a subreaper while it asks). Returns the worker's pid in the
    zygote, 0 in the worker."""
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        worker = -1
        try:
            os.close(pid_r)
            ready_r, ready_w = os.pipe()
            worker = os.fork()
            if worker != 0:
                os.close(ready_w)
                os.read(ready_r, 1)  # EOF once the worker has its own session
                os.write(pid_w, str(worker).encode())
        finally:
            if worker != 0:
                os._exit(0)  # the intermediate: its worker is orphaned to the launcher
        try:
            # The intermediate, read while it cannot exit yet (it waits for ready_w to close):
            # read after, it could be gone already, and the loop below would wait for a
            # reparenting that had happened, 10 s (2 jobs in 16;
            # docs/decisions/0016-workers-forked-from-a-zygote.md).
            parent = os.getppid()
            os.close(ready_r)
            os.close(pid_w)
            os.setsid()  # its own session and process group, as elastic's Popen gives
            os.close(ready_w)  # the intermediate may go
            deadline = time.monotonic() + 10.0
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.0005)  # until orphaned to the launcher
            _become_worker(sock, request, fds)
        except BaseException as err:  # noqa: BLE001 - never back into the zygote's loop
            os.write(2, f"tpu-launch zygote: the worker could not start: {err!r}\n".encode())
            os._exit(127)
        return 0
    os.close(pid_w)
    data = b""
    while True:
        chunk = os.read(pid_r, 64)
        if not chunk:
            break
        data += chunk
    os.close(pid_r)
    os.waitpid(middle, 0)
    if not data:
        raise RuntimeError("the intermediate process could not fork the worker")
    return int(data)


_INHERITED_SIGNALS = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM")
"""Signals whose disposition a fresh worker takes from the launcher when it is started: ignored
stays ignored across ``exec``, anything else becomes the default (Python then installs its
``KeyboardInterrupt`` handler for SIGINT). SIGPIPE and SIGXFSZ are not among them: Python
ignores both at start-up whatever it inherits."""


def _ignored_signals() -> list[str]:
    """The launcher's signals (of :data:`_INHERITED_SIGNALS`) that are ignored right now: what a
    worker it starts itself would inherit as ignored."""
    return [
        name for name in _INHERITED_SIGNALS
        if hasattr(signal, name) and signal.getsignal(getattr(signal, name)) == signal.SIG_IGN
    ]


def _take_launchers_signals(ignored: Sequence[str]) -> None:
    """In the forked worker: the dispositions a worker started by the launcher would have
    (:data:`_INHERITED_SIGNALS`), not the zygote's (which are the launcher's when it started the
    zygote, before elastic installed its handlers)."""
    for name in _INHERITED_SIGNALS:
        if not hasattr(signal, name):
            continue
        number = getattr(signal, name)
        if name in ignored:
            signal.signal(number, signal.SIG_IGN)
        elif name == "SIGINT":
            signal.signal(number, signal.default_int_handler)
        else:
            signal.signal(number, signal.SIG_DFL)


def _become_worker(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked worker: the launcher's file descriptors, environment, directory and signal
    dispositions."""
    sock.close()
    _take_launchers_signals(request.get("ignored", ()))
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _reseed()


def _reseed() -> None:
    """Seed from the OS the generators a fresh interpreter seeds from the OS when it imports
    their module: forked, every worker (of every attempt) would draw the zygote's numbers.
    numpy's global generator, and torch's default CPU generator (torch seeds it from
    ``/dev/urandom`` at import; what ``torch.initial_seed()`` reports). Python's ``random``
    reseeds itself after a fork; torch's accelerator generators start from a fixed seed in
    every process, fresh or forked, so they are left alone."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


def _load_worker_entry() -> Any:
    """``_worker.py`` as a module of its own (not through the ``tpu_dist`` package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
    spec = importlib.util.spec_from_file_location("_tpu_dist_launch_worker", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


if __name__ == "__main__":
    # Not this file's folder first on sys.path (tpu_dist/launch: its _config.py, _env.py, ...
    # would shadow modules of those names in what the zygote imports); the worker entry puts
    # the script's folder there, as in a fresh worker.
    sys.path[0] = os.devnull
    _entry = _load_worker_entry()
    _also = [name for name in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if name]
    _argv = _serve(int(sys.argv[1]), int(sys.argv[2]), _also)
    sys.argv = [_entry.__file__, *_argv]
    _entry.main(_argv)
