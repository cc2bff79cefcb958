"""Time to a usable world: "tpu" beside gloo, in one run (issue 17).

Starts the same script under torchrun once per backend and reports, per step, rank 0's
seconds and the slowest rank's::

    python benchmarks/startup.py                 # 4 ranks; gloo, tpu (cold cache), tpu (warm)
    python benchmarks/startup.py --nproc 2 --repeat 3 --json results/startup.json

Steps, each timed on every rank:

* ``import``: ``import torch``, ``import jax``, ``import tpu_dist`` (gloo: torch only);
* ``init``: ``init_process_group``, started when every rank has arrived (a barrier on
  torchrun's store first, so a slow import elsewhere is not counted as init);
* ``first_all_reduce``: 4 KiB, the first collective; ``steady_all_reduce``: the same again;
* ``new_shape``: the first ``all_gather_into_tensor`` of a shape not seen before;
* ``new_group``: ``new_group([0, 1])`` and its first all_reduce (ranks 0 and 1);
* ``reinit``: ``destroy_process_group()``, ``init_process_group`` again (on a fresh prefix of
  the store), one all_reduce.

"tpu (cold)" runs with an empty compile cache (``TPU_DIST_COMPILE_CACHE`` set to a fresh
directory), "tpu (warm)" with the cache the cold run filled: a restarted job, or the next test.

``--felt`` measures instead what a user feels (issue 35, item 4): a job that initialises, does
one all_reduce of 4 KiB and exits, started by ``torchrun`` with gloo and by ``tpu-launch`` with
"tpu", alternating (A B, B A, ...) for ``--repeat`` rounds, with a warm compile cache (the first
job of the run fills it and is not counted)::

    python benchmarks/startup.py --felt --repeat 4
    python benchmarks/startup.py --felt --repeat 4 --kinds gloo,tpu,tpu-fresh

Per job: its wall time, from just before the launcher command starts to its exit; per rank,
from the rank's process start (``/proc/self/stat``; for a worker tpu-launch forked from its
zygote, the fork) to its first collective done, split into the interpreter's own start (to the
script's first line), ``import`` (torch, and tpu_dist for "tpu"), ``init_process_group`` and the
first ``all_reduce``; and from the launcher's start to the rank's process start (the launcher's
own start-up, and for forked workers the zygote's imports). Medians over the jobs of the slowest
rank; the ratio of each to the first kind's; the 1-minute load average at each job's start.
``tpu-fresh`` is tpu-launch with ``TPU_DIST_LAUNCH_PRELOAD=0``: every worker a fresh interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

_WORKER = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
marks = {"import_torch": time.perf_counter() - t0}
backend = sys.argv[1]
if backend == "tpu":
    s = time.perf_counter(); import jax; marks["import_jax"] = time.perf_counter() - s
    s = time.perf_counter(); import tpu_dist; marks["import_tpu_dist"] = time.perf_counter() - s
    marks["tpu_dist_file"] = tpu_dist.__file__
import torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      is_master=False)
store.add("startup_bench/arrived", 1)
store.wait(["startup_bench/arrived"])
while int(store.add("startup_bench/arrived", 0)) < world:
    time.sleep(0.001)

def timed(name, fn):
    s = time.perf_counter(); fn(); marks[name] = time.perf_counter() - s

timed("init", lambda: dist.init_process_group(backend))
x = torch.ones(1024)
timed("first_all_reduce", lambda: dist.all_reduce(x))
timed("steady_all_reduce", lambda: dist.all_reduce(x))
part, whole = torch.ones(333), torch.empty(333 * world)
timed("new_shape", lambda: dist.all_gather_into_tensor(whole, part))
def pair():
    group = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(x, group=group)
timed("new_group", pair)
dist.barrier()
def reinit():
    # A fresh key prefix: after destroy, gloo's second env:// init on the same store can read
    # the first group's stale addresses (connection refused), a race of the benchmark's own.
    dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore("startup_bench/reinit", store),
                            rank=rank, world_size=world)
    dist.all_reduce(x)
timed("reinit", reinit)
dist.barrier()
with open(os.environ["STARTUP_BENCH_OUT"], "a") as out:
    out.write(json.dumps({"rank": rank, **marks}) + "\n")
dist.destroy_process_group()
"""

_FELT_WORKER = r"""
import time
top = time.time()
import os, sys


def process_start():
    # Field 22 of /proc/self/stat: the process's start in clock ticks after boot (for a forked
    # process, the fork). Against /proc/uptime (10 ms resolution) -> seconds since the epoch.
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return top - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


start = process_start()
import torch
import torch.distributed as dist
backend = sys.argv[1]
if backend == "tpu":
    import tpu_dist
imported = time.time()
dist.init_process_group(backend)
initialised = time.time()
x = torch.ones(1024)
dist.all_reduce(x)
done = time.time()
assert x[0].item() == dist.get_world_size(), x[0].item()
launch = float(os.environ["STARTUP_BENCH_LAUNCH_T0"])
row = {"rank": dist.get_rank(), "launcher": start - launch, "interpreter": top - start,
       "import": imported - top, "init": initialised - imported,
       "first_all_reduce": done - initialised, "process_to_first": done - start,
       "launch_to_first": done - launch}
with open(os.environ["STARTUP_BENCH_OUT"], "a") as out:
    out.write(__import__("json").dumps(row) + "\n")
dist.destroy_process_group()
"""

FELT_STEPS = ("launcher", "interpreter", "import", "init", "first_all_reduce",
              "process_to_first", "launch_to_first")
"""Per rank (seconds): launcher start -> process start; process start -> script's first line;
imports; init_process_group; the first all_reduce; process start -> first collective done;
launcher start -> first collective done."""

FELT_KINDS = {
    "gloo": ("torch.distributed.run", "gloo", {}),
    "tpu": ("_tpu_dist_launch", "tpu", {}),
    "tpu-m": ("tpu_dist.launch", "tpu", {}),
    "tpu-fresh": ("tpu_dist.launch", "tpu", {"TPU_DIST_LAUNCH_PRELOAD": "0"}),
}
"""Job kind -> the launcher module that starts it (torchrun; ``_tpu_dist_launch`` is what the
``tpu-launch`` command runs), the backend, and variables for the launcher: ``tpu-m`` is
``python -m tpu_dist.launch`` (its zygote a new interpreter, not forked from the launcher),
``tpu-fresh`` starts every worker as a fresh interpreter (no zygote, tpu_dist.launch._zygote),
as tpu-launch did before."""
FELT_TITLES = {"gloo": "torchrun + gloo", "tpu": "tpu-launch + tpu",
               "tpu-m": "python -m tpu_dist.launch + tpu", "tpu-fresh": "tpu, fresh"}


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_felt(kind: str, nproc: int, env: dict[str, str]) -> dict[str, float]:
    """One job of ``_FELT_WORKER`` of ``kind`` (:data:`FELT_KINDS`): the job's wall seconds
    and, per :data:`FELT_STEPS`, the slowest rank's seconds."""
    launcher, backend, extra = FELT_KINDS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        script, out = os.path.join(tmp, "worker.py"), os.path.join(tmp, "marks.jsonl")
        with open(script, "w") as f:
            f.write(_FELT_WORKER)
        cmd = [sys.executable, "-m", launcher, "--nproc-per-node", str(nproc)]
        if backend == "gloo":
            cmd.append("--standalone")  # a c10d rendezvous on a free port, as tpu-launch's
        cmd += [script, backend]
        load = load_average()
        t0 = time.time()
        proc = subprocess.run(
            cmd, env={**os.environ, **env, **extra, "STARTUP_BENCH_OUT": out,
                      "STARTUP_BENCH_LAUNCH_T0": repr(t0)},
            capture_output=True, text=True, timeout=600,
        )
        wall = time.time() - t0
        rows = []
        if os.path.exists(out):
            with open(out) as f:
                rows = [json.loads(line) for line in f]
        if proc.returncode != 0 or len(rows) != nproc:
            raise RuntimeError(f"{kind} job failed ({proc.returncode}, {len(rows)} of {nproc} "
                               f"ranks wrote marks):\n{proc.stderr[-3000:]}")
    result = {step: max(r[step] for r in rows) for step in FELT_STEPS}
    result.update(wall=wall, load=load)
    return result


def _median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def felt(nproc: int, repeat: int, kinds: tuple[str, ...]) -> dict[str, list[dict[str, float]]]:
    """``--felt``: rounds of one job of each kind, in order and reversed on alternate rounds
    (A B, B A, ...); prints medians [min-max] and the ratio to the first kind; returns every
    job's numbers."""
    jobs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as cache:  # mode 0700, as the cache requires
        env = {"TPU_DIST_COMPILE_CACHE": cache}
        run_felt("tpu", nproc, env)  # fills the cache; a user's second job on this host
        for i in range(repeat):
            for kind in (kinds if i % 2 == 0 else kinds[::-1]):
                jobs[kind].append(run_felt(kind, nproc, env))
                print(f"round {i} {kind}: wall {jobs[kind][-1]['wall']:.2f} s, "
                      f"load {jobs[kind][-1]['load']:.2f}", file=sys.stderr, flush=True)
    print(f"{nproc} ranks, {repeat} job(s) each, alternating, warm compile cache; seconds: "
          "median [min-max]; ranks: the slowest rank of each job; ratio: to "
          f"{FELT_TITLES[kinds[0]]}")
    print(f"  {'':18s}" + "".join(f"{FELT_TITLES[k]:>24s}{'ratio':>7s}" for k in kinds))
    for step in ("wall", *FELT_STEPS, "load"):
        line, base = f"  {step:18s}", None
        for kind in kinds:
            values = sorted(j[step] for j in jobs[kind])
            median = _median(values)
            base = median if base is None else base
            ratio = f"{median / base:7.2f}" if base > 0 and step != "load" else " " * 7
            line += f"{f'{median:.3f} [{values[0]:.3f}-{values[-1]:.3f}]':>24s}{ratio}"
        print(line)
    return jobs


STEPS = ("import", "init", "first_all_reduce", "steady_all_reduce", "new_shape", "new_group",
         "reinit")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(
    backend: str, nproc: int, env: dict[str, str], worker: str = _WORKER,
    steps: tuple[str, ...] = STEPS,
) -> dict[str, dict[str, float]]:
    """One torchrun of ``worker`` (which appends each rank's marks, a JSON line, to
    ``$STARTUP_BENCH_OUT``); per step, rank 0's seconds and the slowest rank's."""
    with tempfile.TemporaryDirectory() as tmp:
        script, out = os.path.join(tmp, "worker.py"), os.path.join(tmp, "marks.jsonl")
        with open(script, "w") as f:
            f.write(worker)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), script, backend]
        proc = subprocess.run(cmd, env={**os.environ, **env, "STARTUP_BENCH_OUT": out},
                              capture_output=True, text=True, timeout=600)
        rows = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
        if proc.returncode != 0 and len(rows) < nproc:
            raise RuntimeError(f"{backend} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        if proc.returncode != 0:
            # Every rank measured and wrote its marks; the failure came later, at exit (seen
            # under heavy load: ranks aborting in JAX's coordination-service shutdown after
            # rank 0 had gone). Counted, reported, not hidden.
            print(f"note: {backend} torchrun exited {proc.returncode} after every rank wrote "
                  "its marks (an exit-time failure)", file=sys.stderr)
    for row in rows:
        row["import"] = sum(row.pop(k, 0.0) for k in ("import_torch", "import_jax",
                                                      "import_tpu_dist"))
    files = {r.pop("tpu_dist_file") for r in rows if "tpu_dist_file" in r}
    if files:
        print(f"{backend}: workers imported {', '.join(sorted(files))}", file=sys.stderr)
    rank0 = next(r for r in rows if r["rank"] == 0)
    return {step: {"rank0": rank0[step], "max": max(r[step] for r in rows)} for step in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of gloo, tpu (cold), tpu (warm), each cold round with a "
                        "new empty cache (default 1); the table gives medians and ranges")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--felt", action="store_true",
                        help="instead: from process start and the job's wall time, torchrun + "
                        "gloo beside tpu-launch + tpu, A B B A for --repeat rounds")
    parser.add_argument("--kinds", default="gloo,tpu",
                        help="with --felt: the jobs of each round, comma-separated, of "
                        f"{', '.join(FELT_KINDS)} (default gloo,tpu; the first is the ratios' "
                        "base)")
    args = parser.parse_args()
    if args.felt:
        jobs = felt(args.nproc, args.repeat, tuple(args.kinds.split(",")))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"nproc": args.nproc, "time": time.time(), "felt": jobs}, f, indent=1)
        return
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as cache:  # mode 0700, as the cache requires
            env = {"TPU_DIST_COMPILE_CACHE": cache, "OMP_NUM_THREADS": "1"}
            rounds.setdefault("gloo", []).append(run("gloo", args.nproc, env))
            rounds.setdefault("tpu (cold)", []).append(run("tpu", args.nproc, env))
            rounds.setdefault("tpu (warm)", []).append(run("tpu", args.nproc, env))
    names = list(rounds)
    print(f"{args.nproc} ranks, {args.repeat} round(s); seconds: median [min-max] of rank 0, "
          "then of the slowest rank")
    for name in names:
        print(f"\n{name}")
        for step in STEPS:
            cells = []
            for who in ("rank0", "max"):
                values = sorted(r[step][who] for r in rounds[name])
                median = values[len(values) // 2]
                cells.append(f"{median:8.3f} [{values[0]:.3f}-{values[-1]:.3f}]")
            print(f"  {step:20s}" + "   ".join(cells))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "time": time.time(), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
