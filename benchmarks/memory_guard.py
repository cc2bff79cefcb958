"""Run a command and kill it, with every process it started, when their summed RSS passes a limit.

A guard for measurements on a shared machine: many ranks at real model shapes can take the
machine's memory, and ``prlimit --as`` suits JAX processes badly (their virtual reservations
are far above what they use). Polls every 0.2 s; on the limit (or ``--timeout``) it SIGKILLs the
whole tree and says so on stderr; exits with the command's code (137 when it killed it).

    python benchmarks/memory_guard.py --limit-gib 10 -- tpu-launch --nproc-per-node 4 train.py
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def rss_kib(pid: int) -> int:
    """``pid``'s resident memory in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_guarded(proc: subprocess.Popen, limit_kib: int, timeout: float) -> dict:
    """Watch ``proc`` until it exits; kill its tree past ``limit_kib`` or ``timeout`` seconds.
    Returns ``{"killed": why or None, "max_sum_kib": ...}``."""
    killed, max_sum, start = None, 0, time.monotonic()
    while proc.poll() is None:
        pids = descendants(proc.pid)
        total = sum(rss_kib(p) for p in pids)
        max_sum = max(max_sum, total)
        over_time = time.monotonic() - start > timeout
        if total > limit_kib or over_time:
            killed = "time" if over_time else f"memory ({total / 2**20:.2f} GiB)"
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()
            break
        time.sleep(0.2)
    return {"killed": killed, "max_sum_kib": max_sum}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit-gib", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    proc = subprocess.Popen(command, start_new_session=True)
    result = run_guarded(proc, int(a.limit_gib * 2**20), a.timeout)
    if result["killed"]:
        print(f"memory_guard: killed the command ({result['killed']}; limit "
              f"{a.limit_gib:g} GiB)", file=sys.stderr, flush=True)
        sys.exit(137)
    print(f"memory_guard: the command's processes held at most "
          f"{result['max_sum_kib'] / 2**20:.2f} GiB in sum", file=sys.stderr, flush=True)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
