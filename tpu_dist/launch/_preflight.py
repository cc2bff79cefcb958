"""Pre-flight checks: cheap, local, before anything starts. Skip them with ``--skip-preflight``.

Errors (the launcher stops with exit code 2 and prints every one):

* the host count does not match the topology (TPU: ``--nnodes`` vs hosts x slices);
* the master port is taken on node 0 (static rendezvous), naming the process that holds it;
* a ``TPU_PROCESS_PORT`` of this host is taken (TPU);
* a TPU device file (``/dev/accel*``, ``/dev/vfio/N``) or ``/tmp/libtpu_lockfile`` is held by a
  live process (TPU), naming its pid and command line.

Warnings (printed, the launch goes on): a ``/tmp/libtpu_lockfile`` no live process holds (libtpu
may refuse to start: remove it), and every conflict between the user's environment and the
computed worker variables (:attr:`tpu_dist.launch._env.WorkerEnv.notes`).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from tpu_dist.launch._config import LaunchSpec
from tpu_dist.mesh import tpu_device_files
from tpu_dist.launch._env import WorkerEnv

__all__ = ["Problem", "find_holders", "port_is_free", "preflight"]

LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One finding."""

    severity: Literal["error", "warning"]
    message: str


def port_is_free(port: int) -> bool:
    """Whether a TCP server could listen on ``port`` on all interfaces (as TCPStore does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _cmdline(proc_root: str, pid: int) -> str:
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def find_holders(
    targets: Iterable[str], *, proc_root: str = "/proc", exclude: Iterable[int] = ()
) -> dict[str, list[tuple[int, str]]]:
    """Which live processes have ``targets`` (paths, or ``socket:[inode]``) open.

    Returns target -> [(pid, command line)], for the processes this user may inspect.
    """
    wanted = set(targets)
    skip = {os.getpid(), *exclude}
    found: dict[str, list[tuple[int, str]]] = {}
    if not wanted:
        return found
    for fd_dir in glob.glob(os.path.join(proc_root, "[0-9]*", "fd")):
        pid = int(os.path.basename(os.path.dirname(fd_dir)))
        if pid in skip:
            continue
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if link in wanted:
                holders = found.setdefault(link, [])
                if all(p != pid for p, _ in holders):
                    holders.append((pid, _cmdline(proc_root, pid)))
    return found


def _listening_inodes(port: int, proc_root: str) -> set[str]:
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            with open(os.path.join(proc_root, table)) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    return inodes


def _port_holder(port: int, proc_root: str) -> str:
    holders = find_holders(_listening_inodes(port, proc_root), proc_root=proc_root)
    pids = sorted({entry for entries in holders.values() for entry in entries})
    if not pids:
        return ""
    return " by " + ", ".join(f"pid {pid} ({cmd})" for pid, cmd in pids)


def _describe(holders: Sequence[tuple[int, str]]) -> str:
    return ", ".join(f"pid {pid} ({cmd})" for pid, cmd in holders)


def preflight(
    spec: LaunchSpec,
    worker_env: WorkerEnv,
    *,
    proc_root: str = "/proc",
    lockfile: str = LIBTPU_LOCKFILE,
    dev_root: str = "/dev",
    port_free: Callable[[int], bool] = port_is_free,
) -> list[Problem]:
    """Runs every check that applies to ``spec``; returns errors and warnings (empty: all fine)."""
    problems = [Problem("warning", note) for note in (*spec.notes, *worker_env.notes)]

    if spec.mode == "tpu" and spec.expected_nodes and spec.max_nodes != spec.expected_nodes:
        what = spec.slice.name if spec.slice else "this slice"
        problems.append(
            Problem(
                "error",
                f"{what} x {spec.num_slices} slice(s) has {spec.expected_nodes} hosts, but "
                f"--nnodes is {spec.max_nodes} ({spec.provenance.get('nnodes')}): run tpu-launch "
                "once on every host (e.g. gcloud ... ssh --worker=all) and drop --nnodes, or fix "
                "TPU_WORKER_HOSTNAMES",
            )
        )

    if spec.node_rank == 0 and spec.rdzv_backend == "static" and spec.master_port is not None:
        if not port_free(spec.master_port):
            problems.append(
                Problem(
                    "error",
                    f"the master port {spec.master_port} is in use on this host"
                    f"{_port_holder(spec.master_port, proc_root)}: pick another with "
                    "--master-port (on every host) or stop that process",
                )
            )

    if spec.one_chip_per_process:
        for local_rank in range(spec.nproc_per_node):
            port = spec.tpu_base_port + local_rank
            if not port_free(port):
                problems.append(
                    Problem(
                        "error",
                        f"TPU_PROCESS_PORT {port} (local rank {local_rank}) is in use on this host"
                        f"{_port_holder(port, proc_root)}: stop that process or move the range "
                        "with --tpu-base-port",
                    )
                )

    if spec.mode == "tpu":
        devices = tpu_device_files(dev_root)
        holders = find_holders([*devices, lockfile], proc_root=proc_root)
        for path in sorted(holders):
            problems.append(
                Problem(
                    "error",
                    f"{path} is held by {_describe(holders[path])}: another program is using "
                    "this host's TPU; stop it (kill the pid) before launching",
                )
            )
        if os.path.exists(lockfile) and lockfile not in holders:
            problems.append(
                Problem(
                    "warning",
                    f"{lockfile} exists but no live process holds it (left by a crashed TPU "
                    f"program); if the TPU runtime refuses to start, remove it: rm {lockfile}",
                )
            )
    return problems
