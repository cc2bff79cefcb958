"""Where a command's CPU goes, by kind of process (docs/decisions/0030-test-suite-time.md).

Runs a command (by default the README's test command) while reading every process's CPU time
from ``/proc`` every 0.3 s, then prints the CPU-seconds of each kind of process and the share of
the machine's cores they used over the wall time. Linux only. Processes shorter than 0.3 s may
be missed; a process that was running before the command counts only the CPU it used since.
Every process of the machine is counted, the command's or not: run it on an idle machine.

    python benchmarks/suite_cpu.py                      # the whole suite
    python benchmarks/suite_cpu.py --dump procs.jsonl   # and every process, with its test
    python benchmarks/suite_cpu.py -- python -m pytest -n 2 --dist loadfile tests/test_bench.py
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(pid: str) -> tuple[int, float, str] | None:
    """(parent pid, CPU-seconds, command line) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK, cmd


def _test_of(pid: str) -> str:
    """The test pytest was running when the process started (``PYTEST_CURRENT_TEST``, which
    children inherit), or ``""``."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return ""
    for item in env:
        if item.startswith(b"PYTEST_CURRENT_TEST="):
            return item.split(b"=", 1)[1].decode(errors="replace").split(" ")[0]
    return ""


def kind(cmd: str, parent: str) -> str:
    """The row a process is counted in, from its command line and its parent's."""
    if "multiprocessing.forkserver" in cmd:
        return "harness world workers and their forkservers"
    if "launch/_worker.py" in cmd or "torch.distributed.run" in parent:
        return "workers under tpu-launch / torchrun"
    if "-m tpu_dist.launch " in cmd or "torch.distributed.run" in cmd or "-m tpu_dist.bench" in cmd:
        return "launchers"
    if "xdist" in cmd or "exec(eval(sys.stdin" in cmd or "-m pytest" in cmd:
        return "pytest processes"
    if "python" in cmd:
        return "other Python processes"
    return "anything else"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="*",
                        default=[sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "tests"])
    parser.add_argument("--dump", metavar="FILE",
                        help="also write every process (pid, parent, CPU-s, command line, the "
                        "test that started it) to FILE as JSON lines")
    args = parser.parse_args(argv)
    seen: dict[str, tuple[int, float, str]] = {}
    tests: dict[str, str] = {}
    before = {pid: got[1] for pid in os.listdir("/proc") if pid.isdigit() and (got := _read(pid))}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit() and pid != str(os.getpid()):
                    got = _read(pid)
                    if got is not None:
                        ppid, cpu, cmd = got
                        old = seen.get(pid)
                        if old is None:
                            tests[pid] = _test_of(pid)
                        cpu -= before.get(pid, 0.0)
                        seen[pid] = (ppid, cpu, cmd if old is None else old[2])
            done.wait(0.3)

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.monotonic()
    sampler.start()
    code = subprocess.call(args.command)
    wall = time.monotonic() - started
    done.set()
    sampler.join()
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ppid, cpu, cmd in seen.values():
        parent = seen.get(str(ppid), (0, 0.0, ""))[2]
        row = rows[kind(cmd, parent)]
        row[0] += 1
        row[1] += cpu
    if args.dump:
        import json

        with open(args.dump, "w") as f:
            for pid, (ppid, cpu, cmd) in seen.items():
                f.write(json.dumps({"pid": int(pid), "ppid": ppid, "cpu": cpu, "cmd": cmd,
                                    "test": tests.get(pid, "")}) + "\n")
    total = sum(cpu for _, cpu in rows.values())
    print(f"\n{'what':45s} {'processes':>9s} {'CPU-s':>8s}")
    for name, (count, cpu) in sorted(rows.items(), key=lambda item: -item[1][1]):
        print(f"{name:45s} {int(count):9d} {cpu:8.1f}")
    cores = os.cpu_count() or 1
    print(f"{'total':45s} {len(seen):9d} {total:8.1f}   wall {wall:.1f} s, "
          f"{total / (wall * cores):.0%} of {cores} cores")
    return code


if __name__ == "__main__":
    sys.exit(main())
