"""Each test's wall time and CPU-seconds in a whole-suite run (decision 0030).

A pytest plugin: at the start and end of every test, each pytest(-xdist) worker writes the time
and the CPU-seconds used so far by itself and every process under it (live descendants' own and
reaped children's CPU from ``/proc``, plus its own reaped children's) to ``$SUITE_PER_TEST_LOG``
(JSON lines). Unlike ``suite_cpu.py`` it counts only the suite's own processes, so it can be
used on a machine other people are using too. A process that leaves the tree (reparented to
init) before it is reaped is missed. Linux only::

    SUITE_PER_TEST_LOG=/tmp/run.jsonl PYTHONPATH=.:benchmarks \\
        python -m pytest -n 2 --dist loadfile tests -p suite_per_test
    python benchmarks/suite_per_test.py /tmp/run.jsonl [BEFORE.jsonl]   # per module

With two logs, the modules of both are printed side by side (wall s, CPU-s).
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

LOG_ENV = "SUITE_PER_TEST_LOG"
_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu() -> float:
    """CPU-seconds of this process, its reaped children and every live descendant."""
    me = os.getpid()
    procs: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        # ppid; utime + stime + cutime + cstime (children this process reaped)
        procs[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK)
    total = 0.0
    for ppid, cpu in procs.values():
        up, hops = ppid, 0
        while up in procs and up != me and hops < 64:
            up, hops = procs[up][0], hops + 1
        if up == me:
            total += cpu
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_controller = False
"""Whether this is pytest-xdist's controller (its workers write; it only relays)."""


def pytest_configure(config: object) -> None:
    global _controller
    _controller = config.pluginmanager.hasplugin("dsession")  # type: ignore[attr-defined]


def _write(event: str, nodeid: str) -> None:
    path = os.environ.get(LOG_ENV)
    if not path or _controller:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    record = {"ev": event, "id": nodeid, "worker": worker, "t": time.time(),
              "cpu": _tree_cpu()}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _write("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _write("finish", nodeid)


def per_module(path: str) -> dict[str, list]:
    """Module -> [wall s, CPU-s, worker, first start s] from a log (tests' sums)."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    t0 = min(r["t"] for r in records)
    started: dict[tuple[str, str], dict] = {}
    modules: dict[str, list] = collections.OrderedDict()
    for r in sorted(records, key=lambda r: r["t"]):
        if r["ev"] == "start":
            started[(r["worker"], r["id"])] = r
            continue
        s = started.pop((r["worker"], r["id"]))
        name = r["id"].split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        row = modules.setdefault(name, [0.0, 0.0, r["worker"], s["t"] - t0])
        row[0] += r["t"] - s["t"]
        row[1] += r["cpu"] - s["cpu"]
    return modules


def main(argv: list[str]) -> None:
    if len(argv) == 1:
        rows = per_module(argv[0])
        print(f"{'module':34s} worker  start   wall s   CPU-s  CPU/wall")
        for name, (wall, cpu, worker, start) in rows.items():
            share = cpu / max(wall, 1e-9)
            print(f"{name:34s} {worker:6s} {start:6.0f} {wall:8.1f} {cpu:7.1f} {share:6.2f}")
        print(f"{'(sum)':34s} {'':13s} {sum(r[0] for r in rows.values()):8.1f} "
              f"{sum(r[1] for r in rows.values()):7.1f}")
        return
    after, before = per_module(argv[0]), per_module(argv[1])
    print(f"{'module':34s} {'before s':>8s} {'CPU-s':>7s} {'after s':>8s} {'CPU-s':>7s}")
    for name in sorted(set(after) & set(before), key=lambda n: -before[n][1]):
        b, a = before[name], after[name]
        print(f"{name:34s} {b[0]:8.1f} {b[1]:7.1f} {a[0]:8.1f} {a[1]:7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
