"""A worker script for the tpu-launch tests: ``tpu-launch tests/launch_worker.py MODE [options]``.

Modes (one per behaviour under test):

* ``allreduce``: ``init_process_group(--backend)``, all-reduce ``rank + 1`` and check the sum
  is ``world * (world + 1) / 2``; prints ``ALLREDUCE rank=R world=W sum=S`` (and ``ENV {json}``
  of the launcher-given variables). The backend is a flag so the tests can move from "gloo" to
  "tpu" by changing one parameter.
* ``fail``: rank ``--fail-rank`` exits with ``--exit-code`` (or raises with ``--raise``) after
  ``--delay`` seconds (with ``--wait-pids N``: once N ranks wrote their pid, then the delay);
  the others write their pid to ``--pid-dir`` and sleep.
* ``fail-once``: resumes from a checkpoint: the first attempt (no marker file yet) of rank
  ``--fail-rank`` (with ``--after-init``: after initialising the group and all-reducing) writes
  the marker and exits 1 (without ``--after-init`` the other ranks sleep ``--sleep`` s meanwhile,
  outside any collective); later attempts run ``allreduce`` (rank 0 after ``--delay`` seconds).
* ``steps``: a training loop that checkpoints: state ``x`` (4 floats, from ``[1, 2, 3, 4]``);
  step ``s`` all-reduces ``x * (rank + 1) + s`` and divides by the world size; rank 0 saves
  ``(step, x)`` to ``--marker`` after every step. In attempt 0, rank ``--fail-rank`` exits 1
  after step ``--fail-step``; every attempt resumes from the checkpoint and prints
  ``STEPS rank=R attempt=A from=S x=[...]`` after ``--steps`` steps.
* ``env``: print ``ENV {json}`` of the launcher-given variables (no torch import: cheap).
* ``sleep``: write the pid to ``--pid-dir`` and sleep (for signal tests).

Fault modes (``--backend`` gloo or tpu; each prints ``READY rank=R`` once the group works):

* ``exit-early``: after one all_reduce, rank ``--fail-rank`` exits with ``--exit-code``; the
  others enter a barrier it never joins.
* ``late-finish``: all ranks all_reduce and ``destroy_process_group()``; then rank
  ``--fail-rank`` works alone for ``--sleep`` seconds (a checkpoint write) and every rank exits 0.
* ``timeout-exit``: group timeout ``--timeout`` s; rank ``--fail-rank`` stays away from the
  second all_reduce for ``--sleep`` s (with ``--stop``: stopped by SIGSTOP first); the others
  catch the timeout's error and exit with ``--exit-code`` (run "tpu" with
  TPU_DIST_TIMEOUT_POLICY=raise).
* ``rank0-dies``: after one all_reduce, rank 0 sleeps ``--delay`` s and ends with
  ``os._exit(--exit-code)`` (no Python teardown, as a crash); the others wait in an all_reduce
  it never joins, catch its error and print ``CAUGHT rank=R <error type>``. A SIGTERM (the
  launcher stopping them once rank 0 failed) is held (from before the group is created) until
  then, as a program that saves a checkpoint in its handler would, so the test does not race
  the launcher's poll. With ``--kill`` rank 0 ends by SIGKILL instead (as the OOM killer
  would); with ``--caught-exit-code`` the others exit with that code right after ``CAUGHT``.
* ``loop``: all_reduce in a loop until killed (for the Ctrl-C test); writes pids to ``--pid-dir``.
* ``stall``: rank ``--fail-rank`` sleeps ``--sleep`` s while the others wait in a barrier (for
  the Ctrl-C test); writes pids to ``--pid-dir``.

The bottom of this file also holds the helpers the ``tests/test_launch_*.py`` modules use to run
``python -m tpu_dist.launch`` as a subprocess (always with a timeout, in its own session, killed
with its workers if it overruns).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TPU_DIST_PLATFORM",
    "TPU_DIST_TOPOLOGY",
    "TPU_DIST_NUM_SLICES",
    "TPU_VISIBLE_CHIPS",
    "TPU_PROCESS_PORT",
    "CLOUD_TPU_TASK_ID",
    "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_ADDRESSES",
    "TORCHELASTIC_RESTART_COUNT",
    "TPU_DIST_LAUNCH_WORKER_ENV",
)


def _write_pid(pid_dir: str | None) -> None:
    """``RANK.pid`` in ``pid_dir``, whole or not at all: written beside the directory and
    renamed into it, so a test that lists the directory never reads a file still empty (it
    did once, in CI) nor a temporary one."""
    if pid_dir:
        rank = os.environ["RANK"]
        aside = f"{os.path.normpath(pid_dir)}.{rank}.{os.getpid()}.tmp"
        with open(aside, "w") as f:
            f.write(str(os.getpid()))
        os.replace(aside, os.path.join(pid_dir, f"{rank}.pid"))


def _allreduce(backend: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "tpu":
        import tpu_dist  # noqa: F401  (registers the backend)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    if t.item() != expected:
        sys.exit(f"rank {rank}: all_reduce gave {t.item()}, expected {expected}")
    env = {k: os.environ[k] for k in LAUNCH_VARS if k in os.environ}
    print(f"ALLREDUCE rank={rank} world={world} sum={t.item():g}", flush=True)
    print("ENV " + json.dumps(env, sort_keys=True), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _init(backend: str, timeout: float | None = None):
    import datetime

    import torch
    import torch.distributed as dist

    if backend == "tpu":
        import tpu_dist  # noqa: F401  (registers the backend)
    kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group(backend, **kwargs)
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"READY rank={dist.get_rank()} t={time.time():.2f}", flush=True)
    return torch, dist


def _fault(args: argparse.Namespace, rank: int) -> None:
    if args.mode == "exit-early":
        torch, dist = _init(args.backend)
        if rank == args.fail_rank:
            sys.exit(args.exit_code)
        dist.barrier()
    elif args.mode == "late-finish":
        torch, dist = _init(args.backend)
        dist.destroy_process_group()
        if rank == args.fail_rank:
            time.sleep(args.sleep)
        print(f"DONE rank={rank}", flush=True)
    elif args.mode == "timeout-exit":
        torch, dist = _init(args.backend, args.timeout)
        if rank == args.fail_rank:
            if args.stop:
                os.kill(os.getpid(), signal.SIGSTOP)  # as Ctrl-Z or a debugger would
            time.sleep(args.sleep)
            return
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as err:  # DistBackendError on "tpu", a gloo timeout error on gloo
            print(f"CAUGHT rank={rank} {type(err).__name__} t={time.time():.2f}", flush=True)
            sys.exit(args.exit_code)
    elif args.mode == "rank0-dies":
        # The others hold SIGTERM from before the group exists (rank 0 dies only after _init's
        # all_reduce, which waits for them), so no stop by the launcher can come before the
        # handler. Twice in a busy CI run rank 1 was nevertheless stopped by SIGTERM without a
        # CAUGHT line on gloo (docs/decisions/0030-test-suite-time.md): what it printed instead
        # says why.
        terms: list[int] = []
        if rank != 0:
            signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
        torch, dist = _init(args.backend)
        if rank == 0:
            time.sleep(args.delay)
            print(f"LAST rank={rank}", flush=True)  # printed: it must reach the console
            if args.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(args.exit_code)
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as err:  # gloo's connection error; DistBackendError on "tpu"
            print(f"CAUGHT rank={rank} {type(err).__name__} t={time.time():.2f}", flush=True)
            if args.caught_exit_code is not None:
                sys.exit(args.caught_exit_code)
        else:
            print(f"RETURNED rank={rank} (the all_reduce rank 0 never joined) "
                  f"t={time.time():.2f} sigterm={bool(terms)}", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if terms:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(args.sleep)
    elif args.mode == "stall":
        torch, dist = _init(args.backend)
        _write_pid(args.pid_dir)
        if rank == args.fail_rank:
            time.sleep(args.sleep)
        dist.barrier()
    elif args.mode == "loop":
        torch, dist = _init(args.backend)
        _write_pid(args.pid_dir)
        t = torch.ones(1024)
        while True:
            dist.all_reduce(t)


def _steps(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    if args.backend == "tpu":
        import tpu_dist  # noqa: F401
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start, x = 0, torch.tensor([1.0, 2.0, 3.0, 4.0])
    if os.path.exists(args.marker):  # read before the first collective: rank 0 writes after it
        saved = torch.load(args.marker)
        start, x = saved["step"], saved["x"]
    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    for step in range(start, args.steps):
        y = x * (rank + 1) + step
        dist.all_reduce(y)
        x = y / world
        if rank == 0:
            torch.save({"step": step + 1, "x": x}, args.marker + ".tmp")
            os.replace(args.marker + ".tmp", args.marker)
        if attempt == 0 and rank == args.fail_rank and step + 1 == args.fail_step:
            print(f"rank {rank}: failing on purpose after step {step + 1}", flush=True)
            sys.exit(1)
    print(f"STEPS rank={rank} attempt={attempt} from={start} x={x.tolist()}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode",
        choices=["allreduce", "env", "fail", "fail-once", "sleep",
                 "exit-early", "late-finish", "timeout-exit", "rank0-dies", "loop", "stall",
                 "steps"],
    )
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--after-init", action="store_true")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--raise", dest="raise_", action="store_true")
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--stop", action="store_true")
    parser.add_argument("--caught-exit-code", type=int, default=None)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--pid-dir")
    parser.add_argument("--wait-pids", type=int, default=0)
    parser.add_argument("--marker")
    parser.add_argument("--sleep", type=float, default=120.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fail-step", type=int, default=3)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])

    if args.mode == "allreduce":
        _allreduce(args.backend)
    elif args.mode == "env":
        env = {k: os.environ[k] for k in LAUNCH_VARS if k in os.environ}
        print("ENV " + json.dumps(env, sort_keys=True), flush=True)
    elif args.mode == "fail":
        _write_pid(args.pid_dir)
        if rank == args.fail_rank:
            deadline = time.monotonic() + 120
            while args.wait_pids and time.monotonic() < deadline and len(
                [n for n in os.listdir(args.pid_dir) if n.endswith(".pid")]
            ) < args.wait_pids:
                time.sleep(0.05)
            time.sleep(args.delay)
            if args.raise_:
                raise RuntimeError(f"deliberate failure on rank {rank}")
            sys.exit(args.exit_code)
        time.sleep(args.sleep)
    elif args.mode == "fail-once":
        if rank == args.fail_rank and not os.path.exists(args.marker) and args.after_init:
            # The first attempt gets going (its store keys are written), then this rank fails.
            import torch
            import torch.distributed as dist

            if args.backend == "tpu":
                import tpu_dist  # noqa: F401
            dist.init_process_group(args.backend)
            dist.all_reduce(torch.tensor([float(rank + 1)]))  # the peers' first all_reduce
        if rank == args.fail_rank and not os.path.exists(args.marker):
            with open(args.marker, "w") as f:
                f.write("failed once\n")
            print(f"rank {rank}: failing on purpose (attempt 0) t={time.time():.2f}", flush=True)
            sys.exit(1)
        if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and not args.after_init:
            # Plain case: the peers of attempt 0 work outside any collective until the launcher
            # stops them. Had they initialised gloo, attempt 1 could connect to their dead
            # addresses: torch's gloo keys in elastic's store are not per attempt (seen once
            # in CI under load: connectFullMesh "Connection refused" in attempt 1).
            time.sleep(args.sleep)
        if rank == 0 and os.path.exists(args.marker):
            time.sleep(args.delay)  # a slow-to-start rank 0: its peers look for it first
        _allreduce(args.backend)
        print(f"RESUMED rank={rank} restart={os.environ['TORCHELASTIC_RESTART_COUNT']} "
              f"attempt={os.environ.get('TPU_DIST_LAUNCH_ATTEMPT')} t={time.time():.2f}",
              flush=True)
    elif args.mode == "steps":
        _steps(args, rank)
    elif args.mode == "sleep":
        _write_pid(args.pid_dir)
        print(f"SLEEPING rank={rank}", flush=True)
        time.sleep(args.sleep)
    else:
        _fault(args, rank)


# -- helpers for the tests that drive tpu-launch -------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.abspath(__file__)
_SCRUB = ("TPU_", "PET_", "MEGASCALE_", "TORCHELASTIC_", "JOB_COMPLETION_INDEX")
_SCRUB_EXACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher/TPU variables, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(_SCRUB) and k not in _SCRUB_EXACT
    }
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


_HANDED_OUT: set[int] = set()
"""Ports :func:`free_port` returned in this process: never returned twice."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now, below the kernel's ephemeral range,
    never returned before in this process, and from this pytest-xdist worker's own share of
    those ports.

    A port the kernel picks (bind to port 0) comes from that range, from which every outgoing
    connection and every port-0 listener of the tests running beside this one also draw: one
    took it in the seconds before a launcher bound it (node 0 of a two-host test then stopped
    at its pre-flight check, "the master port ... is in use", and node 1 waited for it until the
    test's timeout). Below the range only ports picked here are bound; but a port is free when
    it is picked and bound only seconds later, so two tests running at once (the two workers
    of ``pytest -n 2``, or the launches of one module's fixture) could pick the same one (a
    rank's store then failed with EADDRINUSE): so each worker draws from its own share of the
    range (``PYTEST_XDIST_WORKER`` of ``PYTEST_XDIST_WORKER_COUNT``), and each process hands a
    port out once."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports = range(max(1024, low - 12000), low)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        share = len(ports) // int(count)
        start = ports.start + int(worker[2:]) % int(count) * share
        ports = range(start, start + share)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(ports)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_launcher(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, module: str = "_tpu_dist_launch"
) -> subprocess.Popen:
    """``tpu-launch ARGS`` (``python -m _tpu_dist_launch``, what the command runs; or ``python -m
    MODULE``) in its own session, output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """Waits for a launcher; on overrun kills it (its workers die with it) and raises."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"tpu-launch did not finish within {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}"
        ) from None
    return proc.returncode, out, err


def run_launcher(
    args: Sequence[str], *, timeout: float = 150.0, env: Mapping[str, str] | None = None,
    module: str = "_tpu_dist_launch",
) -> tuple[int, str, str]:
    """Runs ``tpu-launch ARGS`` (or ``python -m MODULE ARGS``) to completion: (exit code,
    stdout, stderr)."""
    return finish(start_launcher(args, env=env, module=module), timeout)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    main()
