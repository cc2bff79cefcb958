"""From a :class:`~._config.LaunchSpec` to running workers: the hand-off to torch's elastic agent.

Also the ``--dry-run`` report, and the launcher's exit codes:

====  =====================================================================================
0     every worker of this host exited 0 (and, with several hosts, all agents passed elastic's
      exit barrier)
1     a worker failed for good (after ``--max-restarts``), another host's failure stopped this
      one, or the rendezvous failed
2     bad flags or environment, or a pre-flight error; nothing was started
128+N the launcher got signal N (SIGINT, SIGTERM, ...) and stopped its workers
====  =====================================================================================
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tpu_dist import _settings
from tpu_dist.launch import _gloo_lines, _worker, _zygote
from tpu_dist.launch._chips import placement
from tpu_dist.launch._config import DEFAULT_MASTER_PORT, LaunchSpec
from tpu_dist.launch._env import WorkerEnv, compute_worker_env, elastic_vars
from tpu_dist.launch._preflight import Problem
from tpu_dist.launch._watch import JobWatch

__all__ = ["DEFAULT_LOG_LINE_PREFIX", "elastic_config", "format_dry_run", "format_failure", "launch"]

logger = logging.getLogger("tpu_dist.launch")

DEFAULT_LOG_LINE_PREFIX = "[rank${rank}]:"
"""Each tee'd output line starts with its global rank, e.g. ``[rank3]:loss 0.1`` (override with
torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``)."""

_DRY_RUN_MAX_NODES = 4


def _placement(spec: LaunchSpec, rank: int) -> str:
    """Where a rank sits in the (emulated) slice: one worker per device, ranks in host order."""
    if spec.slice is None or not (spec.mode == "emulate" or spec.one_chip_per_process):
        return ""
    if spec.mode == "emulate" and spec.topology is not None:
        where = placement(spec.topology, spec.num_slices, rank)
        if where is not None:
            return where
    per_slice = spec.slice.num_devices
    per_host = spec.slice.chips_per_host * spec.slice.devices_per_chip
    within = rank % per_slice
    return f"slice {rank // per_slice} host {within // per_host} chip {within % per_host}"


def format_dry_run(
    spec: LaunchSpec, environ: Mapping[str, str], problems: Sequence[Problem]
) -> str:
    """The ``--dry-run`` report: the resolved launch, then per host and rank each worker's
    environment (elastic's variables and tpu-launch's), then notes and pre-flight findings."""
    prov = spec.provenance
    lines = ["tpu-launch --dry-run: nothing was started.", "", "launch"]

    def row(name: str, value: str) -> None:
        lines.append(f"  {name:<14}{value}")

    if spec.mode == "emulate" and spec.slice is not None:
        s = spec.slice
        row(
            "mode",
            f"emulate: CPU workers emulating {spec.topology} ({s.generation}, {s.num_chips} chips "
            f"in a {s.bounds_str.replace(',', 'x')} grid, {s.num_hosts} host(s) x "
            f"{s.chips_per_host} chips) [{prov.get('topology')}]",
        )
    elif spec.mode == "tpu":
        what = spec.slice.name if spec.slice else "unknown accelerator type"
        row("mode", f"tpu: {what} [{prov.get('topology', 'discovery')}]")
    else:
        row("mode", "cpu: plain CPU workers (no TPU found, no --emulate)")
    if spec.mode == "tpu":
        row("runtime", f"{spec.runtime} [{prov.get('runtime')}]")
    row("slices", f"{spec.num_slices} [{prov.get('num_slices')}]")
    nodes = (
        f"{spec.min_nodes}:{spec.max_nodes}"
        if spec.min_nodes != spec.max_nodes
        else str(spec.max_nodes)
    )
    row(
        "nodes",
        f"{nodes} [{prov.get('nnodes')}]; this is node {spec.node_rank} [{prov.get('node_rank')}]",
    )
    row("workers/node", f"{spec.nproc_per_node} [{prov.get('nproc_per_node')}]")
    row("world size", str(spec.world_size))
    if spec.rdzv_backend == "static":
        where = prov.get("master_addr")
        rdzv = f"static at {spec.master_addr}:{spec.master_port} [master_addr: {where}]"
    else:
        rdzv = f"{spec.rdzv_backend} at {spec.rdzv_endpoint} (id {spec.rdzv_id})"
    row("rendezvous", rdzv)
    row("restarts", str(spec.max_restarts))
    row("command", shlex.join(spec.entry.command()))
    tee = "both streams" if spec.tee == "3" else f"--tee {spec.tee}"
    row("output", f"{tee}, lines prefixed {DEFAULT_LOG_LINE_PREFIX.replace('${rank}', '<RANK>')}")
    if "platform" in prov:
        name = _settings.PLATFORM.env
        value = spec.platform or environ.get(name, "")  # shown as given
        row("platform", f"{name}={value} [{prov['platform']}]")

    this = compute_worker_env(spec, environ)
    lines += ["", "environment shared by every worker (besides the user's)"]
    lines += [f"  {k}={v}" for k, v in sorted(this.shared.items())] or ["  (none)"]

    shown = list(range(min(spec.max_nodes, _DRY_RUN_MAX_NODES)))
    if spec.node_rank not in shown:
        shown.append(spec.node_rank)
    for node in shown:
        wenv = this if node == spec.node_rank else compute_worker_env(spec, environ, node_rank=node)
        mark = " (this host)" if node == spec.node_rank else ""
        lines += ["", f"node {node}{mark}"]
        for local_rank in range(spec.nproc_per_node):
            env = {**elastic_vars(spec, node, local_rank), **wenv.per_rank[local_rank]}
            rank = int(env["RANK"])
            where = _placement(spec, rank)
            head = f"  rank {rank}" + (f" [{where}]" if where else "")
            lines.append(head + ": " + " ".join(f"{k}={v}" for k, v in env.items()))
    if spec.max_nodes > len(shown):
        lines.append(f"  ... {spec.max_nodes - len(shown)} more node(s) follow the same pattern")
    if spec.rdzv_backend != "static":
        lines.append("  (with a c10d rendezvous, node ranks are assigned when the nodes meet)")

    if problems:
        lines += ["", "pre-flight"]
        lines += [f"  {p.severity}: {p.message}" for p in problems]
    return "\n".join(lines) + "\n"


def elastic_config(spec: LaunchSpec) -> tuple[Any, Callable[..., Any] | str, list[str]]:
    """torch's ``LaunchConfig``, entrypoint and arguments for ``spec``.

    Built by torchrun's own ``config_from_args`` from the parsed flags with tpu_dist's resolved
    values written back, so that every torchrun flag keeps its torchrun meaning; the entrypoint
    is then wrapped by :mod:`._worker`, and the rendezvous by :mod:`._rendezvous` (a separate
    c10d store for every attempt).
    """
    from torch.distributed.run import config_from_args

    from tpu_dist.launch import _rendezvous

    if spec.torchrun is None:
        raise ValueError("LaunchSpec.torchrun is required to launch; build the spec with resolve()")
    ns = copy.copy(spec.torchrun)
    ns.nnodes = f"{spec.min_nodes}:{spec.max_nodes}"
    ns.nproc_per_node = str(spec.nproc_per_node)
    ns.node_rank = spec.node_rank
    ns.master_addr = spec.master_addr
    ns.master_port = spec.master_port if spec.master_port is not None else DEFAULT_MASTER_PORT
    ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id = (
        spec.rdzv_backend,
        spec.rdzv_endpoint,
        spec.rdzv_id,
    )
    ns.standalone = False
    ns.tee = spec.tee
    ns.run_path = ns.module = ns.no_python = False  # the entrypoint is ours, built below
    config, _, _ = config_from_args(ns)
    # Each attempt's workers get their own c10d store (torch's keys are not per attempt).
    config.rdzv_backend = _rendezvous.wrap_backend(config.rdzv_backend)
    # ... and node 0's launcher hosts each attempt's JAX coordination service for them.
    config.rdzv_configs[_rendezvous.NPROC_CONFIG] = spec.nproc_per_node
    if config.log_line_prefix_template is None:
        config.log_line_prefix_template = DEFAULT_LOG_LINE_PREFIX

    entry = spec.entry
    if entry.kind == "run_path":
        return config, _worker.run_script_path, [entry.target, *entry.args]
    worker_file = os.path.abspath(_worker.__file__)
    return config, entry.python, ["-u", worker_file, entry.kind, entry.target, *entry.args]


def _export(worker_env: WorkerEnv, verbose: bool) -> None:
    """Puts the workers' variables into this (launcher) process's environment; elastic's
    workers inherit it. Each is logged with ``--verbose`` (``--dry-run`` always lists them)."""
    for var, value in sorted(worker_env.shared.items()):
        if verbose:
            logger.info("tpu-launch: setting %s=%s for the workers", var, value)
        os.environ[var] = value
    if any(worker_env.per_rank):
        os.environ[_worker.WORKER_ENV_VAR] = json.dumps([dict(r) for r in worker_env.per_rank])
    os.environ[_worker.LAUNCHER_PID_VAR] = str(os.getpid())
    os.environ[_worker.EXIT_TIME_DIR_VAR] = tempfile.mkdtemp(prefix="tpu_dist_exits_")


_ELASTIC_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_ELASTIC_SIGNALS = (
    "Sending process %s closing signal %s",  # a worker started from a command
    "Closing process %s via signal %s",  # a worker started from a function (--run-path)
    "Unable to shutdown process %s via %s, forcefully exiting via %s",
)
"""elastic's messages as it signals a worker to stop it (the pid is the first argument)."""
_ELASTIC_STOP_MESSAGES = _ELASTIC_SIGNALS[:2] + (
    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
)
"""The per-worker stop messages the failure report restates (dropped unless --verbose)."""

_stopped_pids: set[int] = set()
"""Workers this launcher's elastic agent sent a signal to stop (from its log records)."""

_paused_pids: set[int] = set()
"""Of those, the workers that were stopped (SIGSTOP: Ctrl-Z, a debugger, a freezer) when the
agent began stopping them: they could not have failed by themselves, their peers waited."""


class _ElasticStops(logging.Filter):
    """Notes which workers elastic signals (:data:`_stopped_pids`), and drops its per-worker
    stop messages when ``quiet``; every other elastic message, warnings and errors included,
    passes.

    A worker that is stopped (SIGSTOP) when elastic is about to signal it is noted
    (:data:`_paused_pids`) and resumed: a stopped process holds SIGTERM until it runs again
    (elastic would wait its whole shutdown timeout, then SIGKILL), as a shell resumes a stopped
    job it kills."""

    def __init__(self, quiet: bool) -> None:
        super().__init__()
        self.quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in _ELASTIC_SIGNALS and record.args:
            pid = int(record.args[0])
            _stopped_pids.add(pid)
            if _process_state(pid) in ("T", "t"):
                _paused_pids.add(pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
        return not (self.quiet and record.msg in _ELASTIC_STOP_MESSAGES)


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``; "" when gone or unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


_ERROR_LINES = 6
"""Lines of the failing rank's traceback the failure report shows (its end)."""


_STOP_SIGNALS = (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT)
"""Exit codes of a worker the agent stopped (signals it sends), or one killed from outside."""


def _stopped_by_the_launcher(failure: Any) -> bool:
    """Whether the worker died of a signal this launcher's agent sent it. A worker killed by
    SIGKILL/SIGTERM/SIGINT that the agent never signalled (the OOM killer, a user's
    ``kill``) was not; when elastic's stop messages are not logged (its logger's level is
    above WARNING) every such death counts as the agent's, as torchrun would have it."""
    if failure.exitcode not in _STOP_SIGNALS:
        return False
    if not logging.getLogger(_ELASTIC_LOGGER).isEnabledFor(logging.WARNING):
        return True
    return failure.pid in _stopped_pids


def _how(failure: Any) -> str:
    if failure.pid in _paused_pids:
        return (
            "was stopped (SIGSTOP: Ctrl-Z, a debugger, a freezer) when the job failed, so the "
            "other ranks waited for it; tpu-launch resumed it to end it"
        )
    if failure.exitcode in _STOP_SIGNALS and not _stopped_by_the_launcher(failure):
        return (
            f"was killed by {failure.signal_name()}, not sent by tpu-launch (the kernel's OOM "
            "killer, or a kill from outside)"
        )
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def _exit_time(failure: Any) -> tuple[int, float]:
    """When the worker's program ended, as (whole second, exact time): the time tpu-launch's
    worker entry noted (in the folder :data:`._worker.EXIT_TIME_DIR_VAR`), else elastic's
    timestamp (whole seconds, taken when elastic noticed the exit). Without a noted time a
    worker killed by a signal from outside (SIGKILL, SIGTERM, SIGINT) counts as dead one second
    before elastic noticed, first within that second: it died at some time before, and the
    others' failures noticed with it are its consequence (their collectives fail at once when a
    peer on their host dies), even when the second turned between their exits and elastic's
    look. Any other signal sorts last within its second: a worker killed by, say, SIGABRT the
    same second another failed by itself is more often a consequence (JAX ending the processes
    whose coordinator left)."""
    folder = os.environ.get(_worker.EXIT_TIME_DIR_VAR)
    if folder:
        try:
            with open(os.path.join(folder, str(failure.pid))) as f:
                exact = float(f.read())
            return int(exact), exact
        except (OSError, ValueError):
            pass
    second = int(failure.timestamp)
    if failure.exitcode in _STOP_SIGNALS:
        return second - 1, float(second - 1)
    return second, float("inf")


def _root_cause(err: Any) -> tuple[int, Any]:
    """The failure that started it: a worker that ended by itself, not one the agent stopped.

    elastic orders failures by time, and a worker stopped by the agent (SIGTERM, SIGKILL)
    often wrote its error file (a collective failing because the first worker left) before
    the first worker's exit was observed: prefer the earliest worker that exited on its own
    (any exit code, or a signal the agent did not send: SIGABRT, SIGSEGV, or a SIGKILL from
    the OOM killer). Two workers that failed within the same second (the second one's
    collective failed because the first left) are ordered by :func:`_exit_time`.

    A worker that was stopped (SIGSTOP) when the agent began stopping the workers comes first:
    it could not run, so its peers' failures (timeouts waiting for it) are its consequence.
    """
    paused = [(rank, f) for rank, f in sorted(err.failures.items()) if f.pid in _paused_pids]
    if paused:
        return paused[0]
    own = [
        (_exit_time(failure), rank, failure)
        for rank, failure in err.failures.items()
        if failure.exitcode is not None and not _stopped_by_the_launcher(failure)
    ]
    if not own:
        return err.get_first_failure()
    _, rank, failure = min(own, key=lambda item: (item[0], item[1]))
    return rank, failure


def _failure_summary(spec: LaunchSpec, err: Any) -> str:
    rank, failure = _root_cause(err)
    return (
        f"node {spec.node_rank}: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
        f"{_how(failure)}"
    )


def _last_error_lines(rank: int, failure: Any) -> list[str]:
    """The end of the rank's recorded traceback, or why there is none."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")
    text = ""
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    elif isinstance(message, str):
        text = message
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    if not lines or lines == ["<NONE>"]:  # elastic's placeholder when there is no error file
        why = (
            "it was killed by a signal"
            if failure.exitcode is not None and failure.exitcode < 0
            else "it exited without an uncaught Python exception (sys.exit, os._exit)"
        )
        return [f"(no Python traceback: {why}; its last [rank{rank}]: lines above say more)"]
    return (["..."] if len(lines) > _ERROR_LINES else []) + lines[-_ERROR_LINES:]


def _rank_ranges(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-9, 11-15``."""
    from tpu_dist.launch._rendezvous import format_ranges

    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + format_ranges(ranks)


def format_failure(spec: LaunchSpec, err: Any, verbose: bool = False) -> str:
    """The failure report, short and root cause first (torchrun's "Root Cause (first observed
    failure)"): the failing rank, its exit code and the end of its traceback; then one line for
    the other ranks; then where the full record is."""
    rank, failure = _root_cause(err)
    lines = [
        f"tpu-launch: worker failed: {_failure_summary(spec, err)}",
        f"Root Cause (first observed failure): {spec.entry.target} on rank {rank} "
        f"(host {socket.getfqdn()}):",
    ]
    lines += [f"  {line}" for line in _last_error_lines(rank, failure)]
    outcomes: dict[str, list[int]] = {}
    for r, f in sorted(err.failures.items()):
        if r != rank:
            stopped = _stopped_by_the_launcher(f) and f.pid not in _paused_pids
            how = _how(f) + (" (stopped by the launcher)" if stopped else "")
            outcomes.setdefault(how, []).append(r)
    if outcomes:
        lines.append(
            "Other ranks: "
            + "; ".join(f"{_rank_ranges(rs)}: {how.removeprefix('was ')}" for how, rs in outcomes.items())
        )
    has_file = bool(failure.error_file) and os.path.exists(failure.error_file)
    lines.append(
        "Each rank's whole output is above, lines prefixed [rankN]:"
        + (f"; rank {rank}'s error file: {failure.error_file}" if has_file else "")
        + ("" if verbose else "; --verbose prints torchrun's full failure table")
        + "."
    )
    return "\n".join(lines) + "\n"


_STOP_MARGIN_S = 5.0
"""Seconds beyond elastic's shutdown timeout that node 0's launcher waits for another host's
launcher to stop its workers (its poll interval, signal delivery, process exit)."""


def _raise_signal_exception(signum: int, frame: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(
        f"tpu-launch got {signal.Signals(signum).name}", sigval=signal.Signals(signum)
    )


def _store_address(spec: LaunchSpec) -> tuple[str, int] | None:
    if spec.max_nodes <= 1:
        return None
    if spec.rdzv_backend == "static":
        return spec.master_addr, spec.master_port or DEFAULT_MASTER_PORT
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or int(port) == 0:
        return None
    return host.strip("[]"), int(port)


def _start_zygote(spec: LaunchSpec) -> _zygote.Zygote | None:
    """This launch's zygote (:mod:`._zygote`), started with the workers' shared environment
    (and DTensor preloaded for a script that imports it, :func:`._zygote.script_preload`), or
    None where workers start as fresh interpreters. The zygote ``tpu-launch``'s entry forked
    after its torch import (``_tpu_dist_launch``) is used where it can be, else ended."""
    launch_entry = sys.modules.get("_tpu_dist_launch")
    early = launch_entry.take_early_zygote() if launch_entry is not None else None
    if spec.entry.kind not in ("python", "module") or not _zygote.enabled():
        if early is not None:
            _zygote.end_early(early)
        return None
    also = _zygote.script_preload(spec.entry.target) if spec.entry.kind == "python" else ()
    if early is not None:
        why = _zygote.early_usable(early, spec.entry.python, os.environ)
        if why is None:
            try:
                return _zygote.Zygote(spec.entry.python, os.environ, also, early=early)
            except OSError as err:
                why = f"it ended ({err})"
        else:
            _zygote.end_early(early)
        logger.debug("tpu-launch: the zygote forked after the launcher's import is not used: %s",
                     why)
    try:
        return _zygote.Zygote(spec.entry.python, os.environ, also)
    except OSError as err:
        logger.warning("tpu-launch: workers start without a zygote: %s", err)
        return None


@contextlib.contextmanager
def _quiet_gloo(verbose: bool) -> Any:
    """While elastic runs the workers, the tails that copy their stdout to the console (``--tee``)
    leave out jaxlib's healthy gloo connection lines (:mod:`._gloo_lines`; kept with
    ``--verbose``, and in the log files). Filtered here, as the launcher reads the lines, and
    not in the worker: a line a worker printed before it was killed always reaches the console.
    (elastic's ``TailLog`` replaced in its ``api`` module for the duration, as
    :func:`_forked_from` does its subprocess handler.)"""
    if verbose:
        yield
        return
    from torch.distributed.elastic.multiprocessing import api

    original = api.TailLog

    class QuietTailLog(original):  # type: ignore[misc, valid-type]
        def __init__(self, name: str, log_files: Any, dst: Any, *args: Any, **kwargs: Any):
            if dst is sys.stdout and not args[2:] and "log_line_filter" not in kwargs:
                kwargs["log_line_filter"] = _gloo_lines.shows_line
            super().__init__(name, log_files, dst, *args, **kwargs)

    api.TailLog = QuietTailLog
    try:
        yield
    finally:
        api.TailLog = original


@contextlib.contextmanager
def _forked_from(zygote: _zygote.Zygote | None, verbose: bool) -> Any:
    """While elastic starts workers, it forks them from ``zygote`` (elastic's per-worker
    handler, ``get_subprocess_handler``, replaced in its module for the duration)."""
    if zygote is None:
        yield
        return
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    said = False

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            nonlocal said
            proc = zygote.spawn(args, env, self._stdout, self._stderr)
            if proc is not None:
                return proc
            if zygote.why_not and not said and verbose:
                said = True
                logger.info("tpu-launch: workers start without a zygote: %s", zygote.why_not)
            return super()._popen(args, env)

    def handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str, stderr: str,
                local_rank_id: int, numa_options: Any = None) -> SubprocessHandler:
        return ForkedHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout,
                             stderr=stderr, local_rank_id=local_rank_id,
                             numa_options=numa_options)

    original = api.get_subprocess_handler
    api.get_subprocess_handler = handler
    try:
        yield
    finally:
        api.get_subprocess_handler = original
        zygote.close()


def launch(spec: LaunchSpec, worker_env: WorkerEnv, *, verbose: bool = False) -> int:
    """Runs this host's workers under torch.distributed.elastic; returns the exit code.

    ``verbose`` (``--verbose``) also logs each variable set for the workers, keeps elastic's
    per-worker stop messages and gloo's connection lines, and prints torchrun's failure table.
    How the launch ended becomes the exit code (module doc) in :func:`_workers_failed`,
    :func:`_stopped_by_signal` or :func:`_launch_failed`.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from tpu_dist.launch import _rendezvous

    _export(worker_env, verbose)
    _filter_elastic_stops(quiet=not verbose)
    config, entrypoint, args = elastic_config(spec)
    # Started now, with the environment every worker shares, so that it imports torch and JAX
    # while this launcher meets the other hosts.
    zygote = _start_zygote(spec)
    # How long a launcher hosting the JAX coordination service waits, once its own workers are
    # gone, for the other hosts' launchers to stop theirs (SIGTERM, then SIGKILL after elastic's
    # shutdown timeout): their workers abort once the service is gone (._watch).
    stop_timeout = (config.shutdown_timeout or 30) + _STOP_MARGIN_S

    def stop_wait() -> float:
        return stop_timeout if _rendezvous.hosts_a_service() else 0.0

    watch = _job_watch(spec, float(config.rdzv_configs.get("timeout", 900)))
    # Elastic installs its own handlers when workers start; until then, stop the same way.
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), _raise_signal_exception)
    if watch is not None:
        watch.start()
    try:
        with _forked_from(zygote, verbose), _quiet_gloo(verbose):
            elastic_launch(config, entrypoint)(*args)
        return 0
    except ChildFailedError as err:
        return _workers_failed(spec, err, watch, stop_wait, verbose)
    except SignalException as err:
        return _stopped_by_signal(spec, err, watch, stop_wait)
    except Exception as err:  # rendezvous errors and the like: say what, exit non-zero
        return _launch_failed(spec, err, watch, stop_wait)
    finally:
        if watch is not None:
            watch.stop()
        _rendezvous.stop_services()
        shutil.rmtree(os.environ.pop(_worker.EXIT_TIME_DIR_VAR, ""), ignore_errors=True)


def _filter_elastic_stops(quiet: bool) -> None:
    """Put this launch's :class:`_ElasticStops` on elastic's logger, in place of an earlier
    launch()'s of this process."""
    elastic_logger = logging.getLogger(_ELASTIC_LOGGER)
    for old in [f for f in elastic_logger.filters if isinstance(f, _ElasticStops)]:
        elastic_logger.removeFilter(old)
    elastic_logger.addFilter(_ElasticStops(quiet=quiet))


def _job_watch(spec: LaunchSpec, connect_timeout: float) -> JobWatch | None:
    """The watch that tells this job's hosts of each other's failures (:mod:`._watch`), over
    the rendezvous store; None on one node, with an elastic node count (MIN:MAX), or where the
    store's address is not known in advance."""
    address = _store_address(spec)
    if not address or spec.min_nodes != spec.max_nodes:
        return None
    return JobWatch(
        *address,
        run_id=spec.rdzv_id,
        node_rank=spec.node_rank,
        nnodes=spec.max_nodes,
        connect_timeout=connect_timeout,
    )


def _workers_failed(
    spec: LaunchSpec,
    err: Any,
    watch: JobWatch | None,
    stop_wait: Callable[[], float],
    verbose: bool,
) -> int:
    """A worker failed for good (elastic's ``ChildFailedError``): report it, tell the other
    hosts; exit code 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    summary = _failure_summary(spec, err)
    if verbose:  # torchrun's table, naming the user's program rather than our worker entry
        table = ChildFailedError(name=spec.entry.target, failures=err.failures).format_msg()
        sys.stderr.write(table + "\n")
    sys.stderr.write(format_failure(spec, err, verbose))
    sys.stderr.flush()
    if watch is not None:
        watch.report_failure(summary, wait_for_stop=stop_wait())
    return 1


def _stopped_by_signal(
    spec: LaunchSpec, err: Any, watch: JobWatch | None, stop_wait: Callable[[], float]
) -> int:
    """The launcher got a signal (elastic's ``SignalException``): 1 when the signal was the
    watch stopping this node for another host's failure, else 128 + the signal's number (and
    the other hosts are told)."""
    from tpu_dist.launch import _rendezvous

    waited_for = _rendezvous.waiting()
    if watch is not None and watch.remote_failure is not None:
        what = (
            f"node {spec.node_rank}'s workers"
            if waited_for is None
            else f"node {spec.node_rank} while it waited for {waited_for}"
        )
        sys.stderr.write(
            f"tpu-launch: stopped {what} because another host failed: "
            f"{watch.remote_failure}\n"
        )
        watch.report_stopped()
        watch.wait_until_stopped(stop_wait())
        return 1
    name = signal.Signals(err.sigval).name
    if waited_for is not None:  # no workers of this node are running
        sys.stderr.write(
            f"tpu-launch: got {name} while node {spec.node_rank} waited for {waited_for}; "
            "stopped (no workers were running)\n"
        )
    else:
        sys.stderr.write(f"tpu-launch: got {name}; stopped node {spec.node_rank}'s workers\n")
    if watch is not None:
        # In the rendezvous nobody runs workers yet: tell the nodes that joined, but do not
        # linger for nodes that may never come.
        watch.report_failure(
            f"node {spec.node_rank}: its launcher got {name}",
            wait_for_stop=stop_wait(),
            linger=waited_for is None,
        )
    return 128 + int(err.sigval)


def _launch_failed(
    spec: LaunchSpec, err: Exception, watch: JobWatch | None, stop_wait: Callable[[], float]
) -> int:
    """The launch itself failed (a rendezvous error and the like): say what (with the traceback
    unless it is a rendezvous error), tell the other hosts; exit code 1."""
    from torch.distributed.elastic.rendezvous import RendezvousError

    if not isinstance(err, RendezvousError):
        traceback.print_exc()
    sys.stderr.write(f"tpu-launch: {type(err).__name__}: {err}\n")
    if watch is not None:
        watch.report_failure(
            f"node {spec.node_rank}: {type(err).__name__}: {err}", wait_for_stop=stop_wait()
        )
    return 1
