"""``tpu-launch --compile-only``: run the script once as one rank, then compile its collectives.

The launcher side (:func:`run_compile_only`) checks the request and runs ONE compile-only
process, :func:`main`, with the environment the chosen rank would get on the real job (``RANK``,
``WORLD_SIZE`` = every device of the topology, ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` /
``GROUP_RANK`` of its host, ``TPU_DIST_TOPOLOGY``, ``TPU_DIST_NUM_SLICES``) plus
``TPU_DIST_COMPILE_ONLY=1``. That process hosts a c10d store for itself (every rank of the world
would otherwise have to connect), runs the script, then compiles and reports through
:mod:`tpu_dist.compile_job`.

The launcher runs that process as a child it waits for: forked (it has imported torch already, and a
fresh interpreter would import it again: about 2 CPU-s of a 10 s run,
docs/decisions/0029-compile-only-job-beside-the-launcher.md) when it can (:func:`_in_process_ok`:
JAX is not imported yet, the job's interpreter is this one, ``TPU_DIST_LAUNCH_PRELOAD`` is not 0,
and the job's environment differs from the launcher's only in variables read after start-up,
:data:`_LATE_VARS`; ``OMP_NUM_THREADS`` is applied with ``torch.set_num_threads``, as an import
would), else as ``python -u -m tpu_dist.launch._compile_only`` (for instance with
``--default-for-cpu``, which ``import tpu_dist`` reads). So a job that ends abruptly still gets an
honest exit code and a message from the launcher: killed by a signal (a self-kill, the OOM killer),
or ended by the script before the run finished. A script's ``os._exit`` from its main thread ends
the script only: what it recorded is compiled and reported, and the run exits with its code. The
job's compiler process (:class:`tpu_dist.compile_job.Session`) dies with it.

A dry run writes nothing the user owns: checkpoint saves (``torch.save``, DCP's ``save``)
raise ``tpu_dist.compile_job.SaveRefused`` before any file is opened, and libtpu's logs go to a
folder of the run's own (removed after a run that succeeded, kept and named after one that
failed), unless ``TPU_LOG_DIR`` is set.

Exit code: 0 when the script finished (exit 0) and every collective compiled; the script's own
code when it failed; 1 when a collective did not compile or nothing was recorded, or when the
job ended before it finished with code 0; ``128 + N`` when it was killed by signal N; 2 for a
bad request (nothing started), and when libtpu is missing or cannot describe the topology
(checked before the script runs: that message is then the only error).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from tpu_dist import _settings
from tpu_dist.launch._config import LaunchSpec
from tpu_dist.launch._env import compute_worker_env
from tpu_dist.launch._zygote import early_differences

__all__ = ["run_compile_only"]


def _check(spec: LaunchSpec, rank: int) -> int:
    """The world size; raises ValueError for a request compile-only mode cannot run."""
    if spec.mode != "emulate" or spec.slice is None or spec.topology is None:
        raise ValueError(
            "--compile-only compiles for a TPU topology: pass --emulate TOPOLOGY (e.g. "
            "--emulate v5p:4x4x4 or --emulate tpu7x:16x16x16) and, for multislice, --num-slices"
        )
    if spec.entry.kind not in ("python", "module", "run_path"):
        raise ValueError(
            "--compile-only runs a Python script or module in one process; --no-python "
            f"({spec.entry.target}) cannot be run that way"
        )
    world = spec.slice.num_devices * spec.num_slices
    if not 0 <= rank < world:
        raise ValueError(
            f"--compile-rank {rank} is outside 0..{world - 1} for {spec.topology} x "
            f"{spec.num_slices} slice(s) ({world} devices, one rank each)"
        )
    return world


def run_compile_only(
    spec: LaunchSpec,
    environ: Mapping[str, str],
    *,
    rank: int,
    report: str | None,
    tensors: str = "fake",
    tpu_device: str = "emulate",
) -> int:
    """Run the compile-only process for ``spec`` as global ``rank``; returns the exit code.

    ``tpu_device``: ``"emulate"`` gives the script TorchTPU's ``"tpu"`` device
    (:mod:`tpu_dist.compile_job._tpu_device`), ``"none"`` does not.

    Raises:
        ValueError: not an emulated topology, a non-Python entry point, or a rank outside the
            world (nothing is started).
    """
    world = _check(spec, rank)
    per_host = spec.slice.chips_per_host * spec.slice.devices_per_chip
    env = dict(environ)
    env.update(compute_worker_env(spec, environ).shared)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % per_host),
        LOCAL_WORLD_SIZE=str(per_host),
        GROUP_RANK=str(rank // per_host),
        ROLE_RANK=str(rank),
        TORCHELASTIC_RESTART_COUNT="0",
        TPU_DIST_COMPILE_ONLY="1",
        # libtpu's one-process-per-machine lock guards real chips; there are none here.
        ALLOW_MULTIPLE_LIBTPU_LOAD=env.get("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
        # JAX's persistent cache cannot load compile-only executables back (libtpu:
        # docs/reference/libtpu.md):
        # writing them costs time and every later read warns.
        JAX_ENABLE_COMPILATION_CACHE="false",
        JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
        # A gloo backend named first in a per-device config ("cpu:gloo,tpu:tpu") would wait for
        # the world's absent ranks when created; lazily it never connects (the recording group,
        # named next, serves the group).
        TORCH_GLOO_LAZY_INIT=env.get("TORCH_GLOO_LAZY_INIT", "1"),
    )
    logs = None
    if _LIBTPU_LOG_DIR not in env:  # libtpu's default, /tmp/tpu_logs, is every user's
        logs = env[_LIBTPU_LOG_DIR] = tempfile.mkdtemp(prefix="tpu_dist_libtpu_logs_")
    if tpu_device == "emulate" and importlib.util.find_spec("torch_tpu") is not None:
        # TorchTPU loads inside `import torch` on a TPU host; the job emulates its device.
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    entry = spec.entry
    mode = "module" if entry.kind == "module" else "python"
    done_r, done_w = os.pipe()
    args = ["--done-fd", str(done_w)]
    if report:
        args += ["--report", os.path.abspath(report)]
    if tensors == "real":
        args += ["--real-tensors"]
    if tpu_device != "emulate":
        args += ["--no-tpu-device"]
    args += [mode, entry.target, *entry.args]
    try:
        proc = None
        if _in_process_ok(entry.python, env, environ):
            pid = _fork_the_job(env, args, done_r)
        else:
            command = [entry.python, "-u", "-m", "tpu_dist.launch._compile_only", *args]
            proc = subprocess.Popen(command, env=env, pass_fds=[done_w])
            pid = proc.pid
        os.close(done_w)
        status = _wait_for(pid)
        if proc is not None:
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here
        finished = os.read(done_r, 1) == b"1"
    finally:
        os.close(done_r)
    code = _outcome(status, finished)
    if logs is not None:
        if code == 0 or not os.listdir(logs):
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print(f"tpu-launch --compile-only: libtpu's logs: {logs}", file=sys.stderr)
    return code


_LIBTPU_LOG_DIR = "TPU_LOG_DIR"
"""Where libtpu writes its log files (default ``/tmp/tpu_logs``)."""


def _fork_the_job(env: Mapping[str, str], args: list[str], done_r: int) -> int:
    """Fork the compile-only process (module doc); returns its pid. The child never returns."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.close(done_r)
        _become_the_job(env)
        code = main(args)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - shown as Python would, then the process ends
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _wait_for(pid: int) -> int:
    """The wait status of the job ``pid``. Ctrl-C reaches the job (the terminal signals the
    whole process group), so the launcher ignores it while it waits; a SIGTERM or SIGHUP sent
    to the launcher alone is passed on to the job."""

    def pass_on(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)

    on_main = threading.current_thread() is threading.main_thread()
    handlers = {}
    if on_main:
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM,
                                                            signal.SIGHUP)}
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, pass_on)
        signal.signal(signal.SIGHUP, pass_on)
    try:
        return os.waitpid(pid, 0)[1]
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _outcome(status: int, finished: bool) -> int:
    """The run's exit code from the job's wait status; says why when the job did not finish."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        print(
            f"tpu-launch --compile-only: the job was killed by {signal.Signals(number).name} "
            "before it finished (the kernel's OOM killer, the script itself, or a kill from "
            "outside); what it recorded was in that process: nothing was compiled or reported.",
            file=sys.stderr,
        )
        return 128 + number
    code = os.waitstatus_to_exitcode(status)
    if not finished:
        print(
            f"tpu-launch --compile-only: the job ended with code {code} before it finished "
            "(the script ended the process: os._exit from a thread, or an exit from native "
            "code); nothing was compiled or reported.",
            file=sys.stderr,
        )
        return code or 1
    return code


_LATE_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "TORCHELASTIC_RESTART_COUNT", "ALLOW_MULTIPLE_LIBTPU_LOAD", _settings.COMPILE_ONLY.env,
    "JAX_ENABLE_COMPILATION_CACHE", "JAX_PLATFORMS", "OMP_NUM_THREADS", "GLIBC_TUNABLES",
    "TORCH_GLOO_LAZY_INIT",
    _settings.TOPOLOGY.env, _settings.NUM_SLICES.env, _settings.PLATFORM.env,
})
"""What the compile-only job's environment may set differently from the launcher's for the
launcher to run it itself: read after start-up (elastic's rank variables, tpu_dist's topology
and platform, JAX's and libtpu's, read when JAX is first imported, after this), applied by
hand (``OMP_NUM_THREADS``) or without effect here (``GLIBC_TUNABLES``, read only when a
process starts, tunes the allocator for large real buffers: compile-only moves no data), or read
when a gloo backend is made (``TORCH_GLOO_LAZY_INIT``)."""


def _in_process_ok(python: str, env: Mapping[str, str], environ: Mapping[str, str]) -> bool:
    """Whether this launcher may run the compile-only job itself (module doc)."""
    if "jax" in sys.modules or not _settings.LAUNCH_PRELOAD.get(environ):
        return False
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return False
    return not early_differences(env, os.environ, _LATE_VARS)


def _become_the_job(env: Mapping[str, str]) -> None:
    """Make this process look like the fresh one :func:`run_compile_only` would start: its
    environment, torch's thread count, ``-u``-like streams, and no launcher log handler."""
    import logging

    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    launcher_log = logging.getLogger("tpu_dist.launch")
    for handler in list(launcher_log.handlers):
        launcher_log.removeHandler(handler)
    launcher_log.setLevel(logging.NOTSET)
    launcher_log.propagate = True


# -- the compile-only process ---------------------------------------------------------------


def _serve_store() -> object:
    """A c10d store for this process alone; ``init_process_group`` (env://) connects to it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(store.port)
    # Every rank is a client of an outside store, as under tpu-launch / torchrun.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return store


class _ProcessExit(BaseException):
    """The script called ``os._exit(code)`` from the main thread (:func:`_ending_the_script`)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _ending_the_script() -> object:
    """While the script runs, ``os._exit`` called from the main thread ends the script only
    (:class:`_ProcessExit`, unwinding it as ``sys.exit`` would): what it recorded is still
    compiled and reported. From another thread it ends the process, as always (the launcher
    then says the job did not finish)."""
    real = os._exit

    def _exit(code: int) -> None:
        if threading.current_thread() is threading.main_thread():
            raise _ProcessExit(int(code))
        real(code)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


def _run_script(mode: str, target: str, args: list[str]) -> int:
    import runpy
    import traceback

    sys.argv = [target, *args]
    try:
        with _ending_the_script():
            if mode == "module":
                sys.path.insert(0, os.getcwd())
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
    except _ProcessExit as exc:
        print(
            f"tpu-launch --compile-only: the script called os._exit({exc.code}); what it "
            "recorded until then is compiled and reported.",
            file=sys.stderr,
        )
        return exc.code
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C stops the whole run, not only the script
        raise
    except BaseException:  # the script's own failure: show it as Python would, then report
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tpu_dist.launch._compile_only [--done-fd FD] [--report FILE] [--real-tensors]
    [--no-tpu-device] {python|module} TARGET ARGS...``; with ``--done-fd``, writes one byte to
    FD once the run finished (the launcher's sign that it was not cut short)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    done_fd = None
    if argv[:1] == ["--done-fd"]:
        done_fd, argv = int(argv[1]), argv[2:]
    try:
        return _run(argv)
    finally:
        if done_fd is not None:
            with contextlib.suppress(OSError):
                os.write(done_fd, b"1")
                os.close(done_fd)


def _run(argv: list[str]) -> int:
    options = _parse_run_argv(argv)
    if options is None:
        print(__doc__, file=sys.stderr)
        return 2
    report_path, real_tensors, tpu_device, mode, target, args = options
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    topology = _settings.TOPOLOGY.read()
    slices = _settings.NUM_SLICES.get()
    from tpu_dist import compile_job

    session = compile_job.activate()
    if not _start_session(session, rank, world, tpu_device):
        return 2
    print(
        f"tpu-launch --compile-only: running {target} as rank {rank} of {world} "
        f"({topology} x {slices} slice(s)) in one process. No TPU is used and no data moves: "
        "every collective on a 'tpu' group is recorded and returns at once with outputs of the "
        "right shape whose VALUES ARE NOT MEANINGFUL.",
        file=sys.stderr,
        flush=True,
    )
    store = _serve_store()
    started = time.monotonic()
    code, refused, fake = _run_recorded(session, mode, target, args, real_tensors, tpu_device)
    script_seconds = time.monotonic() - started
    if refused:
        print(
            f"tpu-launch --compile-only: refused {len(refused)} checkpoint save(s), nothing "
            f"written: {', '.join(refused[:3])}{' ...' if len(refused) > 3 else ''}",
            file=sys.stderr,
        )
    try:
        report = session.compile(rank, script_seconds, assumptions=_assumptions(fake))
    except RuntimeError as err:
        print(f"tpu-launch --compile-only: {err}", file=sys.stderr)
        return code or 1
    sys.stdout.write(report.format_table() + "\n")
    if report_path:
        _write_report(report, report_path)
    del store
    if code:
        print(f"tpu-launch --compile-only: the script exited with code {code}", file=sys.stderr)
        return code
    if not report.ok:
        failed = sum(not c.compiled for c in report.collectives)
        print(f"tpu-launch --compile-only: {failed} collective(s) did not compile", file=sys.stderr)
        return 1
    return 0


def _parse_run_argv(
    argv: list[str],
) -> tuple[str | None, bool, bool, str, str, list[str]] | None:
    """(report path, real tensors, emulate the tpu device, "python" or "module", target, the
    script's arguments) from the child's argv, or None when it names no script."""
    report_path, real_tensors, tpu_device = None, False, True
    if argv[:1] == ["--report"]:
        report_path, argv = argv[1], argv[2:]
    if argv[:1] == ["--real-tensors"]:
        real_tensors, argv = True, argv[1:]
    if argv[:1] == ["--no-tpu-device"]:
        tpu_device, argv = False, argv[1:]
    if len(argv) < 2 or argv[0] not in ("python", "module"):
        return None
    return report_path, real_tensors, tpu_device, argv[0], argv[1], argv[2:]


def _start_session(session: Any, rank: int, world: int, tpu_device: bool) -> bool:
    """Start what the script's run needs; False (the error printed) if it cannot start.

    The compiler process first, forked before libtpu starts threads here (a fresh one would
    import torch and JAX again: about 2 CPU-s); it describes the topology itself and waits
    for programs while the script runs. Then libtpu's devices (the "tpu" groups need them;
    cached for them): without libtpu, or for a topology it cannot describe, that is the one
    error, before the script runs (else the script's init_process_group fails with it and
    the report then blames the script).
    """
    from tpu_dist.mesh import current_topology

    try:
        session.start_compiler(current_topology(world))
        session.world(world)
        if tpu_device:
            session.emulate_tpu_device(rank)
    except (RuntimeError, ValueError) as err:
        session.stop_compiler()
        print(f"tpu-launch --compile-only: error: {err}; nothing was run", file=sys.stderr)
        return False
    return True


def _run_recorded(
    session: Any, mode: str, target: str, args: list[str], real_tensors: bool, tpu_device: bool
) -> tuple[int, list[str], Any]:
    """Run the script with checkpoint saves refused and its steps measured, its large tensors
    (and every tensor of the emulated device) fake unless ``real_tensors``: (exit code, the
    refused saves, the ``LargeTensorsFake`` used or None)."""
    from tpu_dist import compile_job
    from tpu_dist.compile_job import LargeTensorsFake

    emulated = ("tpu",) if tpu_device else ()
    fake = None
    if real_tensors and not emulated:
        with compile_job.refusing_saves() as refused, session.measure_steps():
            code = _run_script(mode, target, args)
        return code, refused, fake
    # Tensors on the emulated device are fake whatever their size (no memory holds them);
    # with --tensors real only those.
    threshold = sys.maxsize if real_tensors else 1 << 16
    with compile_job.refusing_saves() as refused, \
            LargeTensorsFake(threshold, fake_device_types=emulated) as fake, \
            session.measure_steps():
        code = _run_script(mode, target, args)
    print(
        f"tpu-launch --compile-only: ran with {'real' if real_tensors else 'fake'} tensors "
        f"({fake.faked} made fake, {fake.placeholders} value(s) read back as 0)",
        file=sys.stderr,
    )
    if code and not real_tensors:
        print(
            "tpu-launch --compile-only: the script failed with fake tensors (large tensors "
            "hold no data in this mode; the error is above). If it needs real values, run "
            "it with --tensors real.",
            file=sys.stderr,
        )
    return code, refused, fake


def _assumptions(fake: Any) -> list[str]:
    """What the report assumes because tensors were fake (balanced routing for top-k calls)."""
    if fake is None or not fake.balanced_topk:
        return []
    return [
        f"balanced routing: {fake.balanced_topk} top-k call(s) over values this run does not "
        "know (a router's scores) picked every choice equally often, and the sizes that "
        "follow from them (an MoE's tokens per expert, its all-to-all splits) are those of "
        "balanced routing; real routing is uneven"
    ]


def _write_report(report: Any, report_path: str) -> None:
    """The report as JSON to ``report_path``, and the step's picture beside it if there is a
    step."""
    from tpu_dist import compile_job

    compile_job.write_report(report, report_path)
    print(f"tpu-launch --compile-only: wrote {report_path}", file=sys.stderr)
    if report.step is not None:
        picture = compile_job.write_step_picture(report, report_path)
        print(f"tpu-launch --compile-only: wrote {picture} (where a step's time goes)",
              file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
