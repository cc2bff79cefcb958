"""Where the time of a restart goes under ``tpu-launch --max-restarts``: "tpu" beside gloo.

Runs a two-worker job with ``--max-restarts 1`` whose rank 1 fails once (``sys.exit(1)``) after
the group of attempt 0 worked, then prints, per backend and run, the seconds of each stage from
that fault to the moment both ranks of attempt 1 finished their first all_reduce::

    python benchmarks/restart_timeline.py [RUNS]        # default 3 runs per backend

Stages (``t`` = seconds since the fault; the launcher's elastic agent is instrumented in its own
process, the workers print a time stamp at each stage):

* ``fault``: rank 1 of attempt 0 calls ``sys.exit(1)`` (rank 0 waits in a barrier).
* ``exit-handlers``: its last exit handler ran (the runtime's and JAX's exit work is done).
* ``stopped``: elastic's monitor loop (every 0.1 s) saw the failed worker and stopped the
  others (SIGTERM, wait for them to exit, SIGKILL after the shutdown timeout), all inside the
  same poll.
* ``rendezvous``: the agent's re-rendezvous returned.
* ``spawned``: the agent started attempt 1's processes.
* ``proc-start``: the (later) attempt-1 worker process started (``/proc``, 10 ms resolution).
* ``script``: the user's script runs (after Python's and the worker entry's start-up).
* ``imports``: ``import torch`` (and ``import tpu_dist`` on "tpu") done.
* ``init``: ``init_process_group`` returned on both ranks (the later one).
* ``resumed``: the first all_reduce of attempt 1 returned on both ranks (the later one).

On gloo both ranks of attempt 0 import torch, rank 0 then sleeps, and rank 1 fails: the same
teardown of a process that imported torch, without a group. (This plain form dates from when
gloo could not restart after its group worked, torch's own store keys not being per attempt;
tpu-launch now gives each attempt its own store, and tests/test_launch_restart.py restarts gloo
after init.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))


def _now() -> str:
    return f"{time.time():.3f}"


# -- worker ------------------------------------------------------------------------------------


def _proc_start() -> float:
    """This process's start time (epoch seconds, clock-tick resolution)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def worker(backend: str, marker: str) -> None:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def phase(name: str, t: str | None = None) -> None:
        print(f"PHASE attempt={attempt} rank={rank} {name} t={t or _now()}", flush=True)

    import atexit

    atexit.register(lambda: phase("exit-handlers"))  # registered first: runs last
    phase("proc-start", f"{_proc_start():.3f}")
    phase("script")
    import torch
    import torch.distributed as dist

    if backend == "tpu":
        import tpu_dist  # noqa: F401
    phase("imports")
    failing = rank == 1 and not os.path.exists(marker)
    if backend == "gloo" and attempt == 0:
        if failing:  # after the imports, before any store key of attempt 0 exists
            with open(marker, "w") as f:
                f.write("failed once\n")
            phase("fault")
            sys.exit(1)
        time.sleep(600)  # rank 0 waits to be stopped, outside init_process_group
    dist.init_process_group(backend)
    phase("init")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    phase("resumed")
    if t.item() != 3.0:
        sys.exit(f"rank {rank}: all_reduce gave {t.item()}, expected 3")
    if failing:
        with open(marker, "w") as f:
            f.write("failed once\n")
        phase("fault")
        sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


# -- launcher with an instrumented elastic agent -------------------------------------------------


def launcher(args: list[str]) -> None:
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea
    from torch.distributed.elastic.agent.server.api import WorkerState

    agent = lea.LocalElasticAgent

    def mark(name: str) -> None:
        sys.stderr.write(f"AGENT {name} t={_now()}\n")
        sys.stderr.flush()

    def wrap(method: str, after: str | None, when=None) -> None:
        original = getattr(agent, method)

        def wrapped(self, *a, **k):
            result = original(self, *a, **k)
            if after and (when is None or when(result)):
                mark(after)
            return result

        setattr(agent, method, wrapped)

    wrap("_monitor_workers", "stopped",
         lambda r: r.state in (WorkerState.FAILED, WorkerState.UNHEALTHY))
    wrap("_rendezvous", "rendezvous")
    wrap("_start_workers", "spawned")
    from tpu_dist.launch import main

    sys.argv = ["tpu-launch", *args]
    main()


# -- driver --------------------------------------------------------------------------------------

STAGES = ("fault", "exit-handlers", "stopped", "rendezvous", "spawned",
          "proc-start", "script", "imports", "init", "resumed")


def one(backend: str) -> dict[str, float] | None:
    """One restart; stage -> seconds since the fault (None if it did not recover)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TPU_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.Popen(
            [sys.executable, HERE, "--launcher", "--nproc-per-node", "2", "--max-restarts", "1",
             HERE, "--worker", backend, os.path.join(tmp, "marker")],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        try:
            text, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            sys.stderr.write(f"{backend}: no recovery within 120 s\n{text[-3000:]}\n")
            return None
    if proc.returncode != 0:
        sys.stderr.write(f"{backend}: launcher exited {proc.returncode}\n{text[-3000:]}\n")
        return None
    worker = [(int(a), int(r), name, float(t)) for a, r, name, t in
              re.findall(r"PHASE attempt=(\d) rank=(\d) (\S+) t=([\d.]+)", text)]
    agent = [(name, float(t)) for name, t in re.findall(r"AGENT (\S+) t=([\d.]+)", text)]
    fault = next(t for a, r, name, t in worker if name == "fault")
    when: dict[str, float] = {"fault": fault}
    when["exit-handlers"] = next(t for a, r, name, t in worker
                                 if a == 0 and r == 1 and name == "exit-handlers")
    for name, t in agent:
        if t >= fault and name not in when:
            when[name] = t
    for stage in ("proc-start", "script", "imports", "init", "resumed"):
        when[stage] = max(t for a, r, name, t in worker if a == 1 and name == stage)
    return {stage: when[stage] - fault for stage in STAGES if stage in when}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print("seconds since the fault at the end of each stage (2 workers, --max-restarts 1)")
    print(f"{'':6s}" + "".join(f"{s:>14s}" for s in STAGES))
    results: dict[str, list[dict[str, float]]] = {"gloo": [], "tpu": []}
    for _ in range(runs):
        for backend in ("gloo", "tpu"):  # interleaved: both see the same machine load
            r = one(backend)
            if r is not None:
                results[backend].append(r)
            row = "".join(f"{r[s]:14.2f}" if r and s in r else f"{'-':>14s}" for s in STAGES)
            print(f"{backend:6s}{row}", flush=True)
    for backend, rs in results.items():
        if rs:
            med = sorted(r["resumed"] for r in rs)[len(rs) // 2]
            print(f"{backend}: recovered {len(rs)}/{runs}, fault->resumed median {med:.2f} s")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--launcher":
        launcher(sys.argv[2:])
    else:
        main()
