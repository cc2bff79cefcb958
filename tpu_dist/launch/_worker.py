"""Worker entry: sets this worker's own TPU variables, then runs the user's program.

torch.distributed.elastic starts every local worker with the same command and the same
environment except for the variables it sets itself (``RANK``, ``LOCAL_RANK``, ...). The
variables that differ per chip (``TPU_VISIBLE_CHIPS``, ``TPU_PROCESS_PORT``,
``CLOUD_TPU_TASK_ID``) are therefore applied here, in the worker, from a table the launcher
passes in ``TPU_DIST_LAUNCH_WORKER_ENV`` (a JSON list indexed by ``LOCAL_RANK``; removed from the
environment before the user's code runs).

The launcher runs this file by path (``python -u .../_worker.py MODE TARGET ARGS...``), so that
it imports only the standard library: the user's program pays no extra import. Modes:

* ``python TARGET``: runs the script in this interpreter as ``python -u TARGET`` would
  (``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]`` = the script's folder).
* ``module TARGET``: as ``python -u -m TARGET``.
* ``exec TARGET``: replaces this process with ``TARGET`` (``--no-python``).

In the first two modes ``faulthandler`` is on (a native crash prints every thread's stack) and
an uncaught exception is printed as Python prints it and also written to
``TORCHELASTIC_ERROR_FILE`` in torch.distributed.elastic's format, so the launcher reports the
failing rank's traceback without the script having to use ``@record``. A program that fails
(an uncaught exception, or ``sys.exit`` with a non-zero code) leaves without the interpreter's
teardown, after its ``atexit`` handlers and a flush of its open files (:func:`_leave`): the
launcher notices a failure only once the process is gone, so a failing worker is gone 1-2 s
sooner and the job stops or restarts that much sooner.

Every mode first asks the kernel to kill this worker if the launcher dies (Linux
``PR_SET_PDEATHSIG``), so a launcher killed with SIGKILL leaves no orphaned workers behind.

A worker's output goes where elastic sends it, unchanged (jaxlib's gloo connection lines are
left out by the launcher, as it copies the output to its console: ``_gloo_lines``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from types import TracebackType

WORKER_ENV_VAR = "TPU_DIST_LAUNCH_WORKER_ENV"
LAUNCHER_PID_VAR = "TPU_DIST_LAUNCH_PID"
EXIT_TIME_DIR_VAR = "TPU_DIST_LAUNCH_EXIT_TIMES"
"""A folder of the launcher's where a failing worker writes a file named by its pid holding
the time (``time.time()``) its program ended. elastic's failure timestamps have one-second
resolution, too coarse to tell which of two ranks that failed together failed first (the
launcher's root cause)."""

# tpu_dist._settings.EXIT_CODE's name, spelled out: importing anything under tpu_dist first
# runs tpu_dist/__init__.py (torch, JAX and the backend's registration, 1.4 s) before the user's
# program. tests/test_launch_failures.py checks both that the names agree and that the entry
# imports nothing outside the standard library.
EXIT_CODE_VAR = "TPU_DIST_EXIT_CODE"
"""The exit code the user's program is leaving with, set here when it ends. A process whose
collective program is stuck in XLA cannot go through JAX's teardown and leaves with
``os._exit`` instead; tpu_dist.collectives reads this variable to keep the program's own code."""


def apply_worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Sets this worker's row of the launcher's table; returns what was set."""
    env = os.environ if environ is None else environ
    table = env.pop(WORKER_ENV_VAR, None)
    if not table:
        return {}
    rows = json.loads(table)
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if not 0 <= local_rank < len(rows):
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but tpu-launch computed variables for {len(rows)} workers"
        )
    row = {str(k): str(v) for k, v in rows[local_rank].items()}
    env.update(row)
    return row


def _die_with_launcher() -> None:
    """PR_SET_PDEATHSIG(SIGKILL): the kernel kills us when the launcher exits. Linux only."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_PID_VAR)
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        # The launcher died before prctl took effect: nobody is left to manage this worker.
        sys.exit(f"tpu-launch worker: the launcher (pid {launcher}) is gone; exiting")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Skips the frames of this file and runpy, as ``python script.py`` would show none."""
    import runpy

    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}

    def ours(filename: str) -> bool:
        return filename in skip or os.path.abspath(filename) in skip

    while tb is not None and ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _record_and_exit(exc: BaseException) -> None:
    _note_exit_time()
    exc.__traceback__ = _user_frames(exc.__traceback__)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(text)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and not os.path.exists(error_file):  # the script's own @record came first
        data = {
            "message": {
                "message": f"{type(exc).__name__}: {exc}",
                "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
            }
        }
        # Written whole or not at all (a new file moved into place): a worker stopped while
        # writing left an empty file, and elastic's failure report then raised JSONDecodeError
        # in the launcher instead of restarting the job (seen once in a CI run).
        partial = f"{error_file}.{os.getpid()}.partial"
        try:
            with open(partial, "w") as f:
                json.dump(data, f)
            os.replace(partial, error_file)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(partial)
    sys.stderr.flush()
    _leave(1)


def _flush_open_files() -> None:
    """Flushes every Python file object still open (interpreter teardown would close them)."""
    import _io
    import gc
    import warnings

    # _io._IOBase is the C base class of every file object; isinstance against io.IOBase (an
    # ABC) takes ~7x longer over the ~170k objects of a process that imported torch. Some
    # objects warn when touched (torch's deprecated ``reduce_op`` prints a FutureWarning on
    # its ``__class__``): the scan must not print anything the program did not.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, _io._IOBase):
                try:
                    if not obj.closed and obj.writable():
                        obj.flush()
                except (OSError, ValueError):
                    pass


def _note_exit_time() -> None:
    """Writes this worker's exit time (once) into the launcher's :data:`EXIT_TIME_DIR_VAR`."""
    folder = os.environ.get(EXIT_TIME_DIR_VAR)
    if not folder:
        return
    path = os.path.join(folder, str(os.getpid()))
    if os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            f.write(f"{time.time():.6f}\n")
    except OSError:
        pass


def _leave(code: int) -> None:
    """Ends a worker whose program failed (exit code ``code`` != 0) without the interpreter's
    teardown.

    The teardown of a process that imported torch (freeing thousands of modules, C++ static
    destructors) takes 1-2 s on a loaded 2-core host, and the launcher learns of the failure
    only when the process is gone: the whole job (or its restart) waits for it. What the
    program can observe of the ordinary exit is kept, in its order: other non-daemon threads
    are joined, every ``atexit`` handler runs (tpu_dist's exit notes, logging's flush, the
    user's), then open file objects and the standard streams are flushed; only the freeing of
    memory the OS reclaims anyway is skipped.
    """
    import atexit
    import threading

    _note_exit_time()
    os.environ[EXIT_CODE_VAR] = str(code)
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    _flush_open_files()
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> None:
    """Flush the standard streams and end the process with ``code`` (``os._exit``): no
    interpreter finalization. The caller has run what must run first (``atexit`` handlers)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _run(mode: str, target: str, args: list[str]) -> None:
    import runpy

    sys.argv = [target, *args]
    os.environ[EXIT_CODE_VAR] = "1"
    try:
        if mode == "module":
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = _note_exit_code(exc.code)
        if code == 0:
            raise
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # what the interpreter prints for sys.exit("...")
        _leave(code)
    except KeyboardInterrupt:
        os.environ[EXIT_CODE_VAR] = str(128 + signal.SIGINT)
        raise
    except BaseException as exc:  # reported, then the worker exits 1
        _record_and_exit(exc)
    os.environ[EXIT_CODE_VAR] = "0"


def _note_exit_code(code: object) -> int:
    """What ``sys.exit(code)`` makes the interpreter exit with, noted in :data:`EXIT_CODE_VAR`."""
    if code is None:
        value = 0
    elif isinstance(code, int):
        value = code & 0xFF
    else:
        value = 1  # sys.exit("message") prints the message and exits 1
    os.environ[EXIT_CODE_VAR] = str(value)
    return value


def run_script_path(script: str, *args: str) -> None:
    """``--run-path`` entry: runs in the worker process elastic spawned (a picklable function)."""
    apply_worker_env()
    sys.argv = [script, *args]
    import runpy

    runpy.run_path(script, run_name="__main__")


def main(argv: list[str]) -> None:
    """``python -u _worker.py MODE TARGET [ARGS...]``."""
    if len(argv) < 2 or argv[0] not in ("python", "module", "exec"):
        sys.exit("usage: _worker.py {python|module|exec} TARGET [ARGS...]")
    _die_with_launcher()
    apply_worker_env()
    mode, target, args = argv[0], argv[1], argv[2:]
    if mode != "exec":
        import faulthandler

        faulthandler.enable(all_threads=True)  # a crash in native code still shows a stack
    if mode == "exec":
        try:
            os.execvp(target, [target, *args])
        except OSError as err:
            sys.exit(f"tpu-launch worker: cannot execute {target!r}: {err}")
    _run(mode, target, args)


if __name__ == "__main__":
    main(sys.argv[1:])
