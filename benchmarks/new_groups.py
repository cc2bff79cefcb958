"""The first collectives of new groups of the same size: a 2-D mesh's two dims (decision 0010).

4 ranks under torchrun, a (dp, tp) = (2, 2) ``init_device_mesh``: the tp groups are ranks
[0, 1] and [2, 3], the dp groups [0, 2] and [1, 3]. Each rank times the first all_reduce
(4 KiB) and the first all_gather_into_tensor of each dim (a barrier of the world before each;
the world's own programs are built before anything is timed), and reports how many programs
built for them (``compile_count``) and where they came from::

    python benchmarks/new_groups.py                      # gloo, tpu without a disk cache
    python benchmarks/new_groups.py --repeat 3 --disk    # and tpu on a cache: tp, then dp only

With ``--disk``, two more tpu runs share a fresh ``TPU_DIST_COMPILE_CACHE`` directory: the
first builds only the tp dim's programs, the second (new processes) only the dp dim's, whose
groups are other devices of the same size and layout. Steps, as in ``startup.py``: rank 0's
seconds and the slowest rank's. Run with ``PYTHONPATH`` at the tree to measure (the workers
print which ``tpu_dist`` they imported).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import run  # noqa: E402 - the benchmark next to this one

_WORKER = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
backend = sys.argv[1]
marks = {}
if backend == "tpu":
    import tpu_dist
    from tpu_dist.collectives import _runtime, compile_count
    marks["tpu_dist_file"] = tpu_dist.__file__
dims = os.environ.get("NEW_GROUPS_DIMS", "tp,dp").split(",")
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(1024)
dist.all_reduce(x)
dist.barrier()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
if backend == "tpu":
    built, known = compile_count(), set(_runtime.get().programs.by_key)
for dim in dims:
    group = mesh.get_group(dim)
    part, whole = torch.ones(256), torch.empty(512)
    for name, op in (("all_reduce", lambda: dist.all_reduce(x, group=group)),
                     ("all_gather", lambda: dist.all_gather_into_tensor(whole, part, group=group))):
        dist.barrier()
        s = time.perf_counter(); op(); marks[f"{dim}_{name}"] = time.perf_counter() - s
dist.barrier()
if backend == "tpu":
    marks["built"] = compile_count() - built
    origins = getattr(_runtime.get().programs, "origins", {})  # none before decision 0010's change
    origins = [o for key, o in origins.items() if key not in known]
    for origin in ("compiled", "reused", "disk"):
        marks[origin] = origins.count(origin)
with open(os.environ["STARTUP_BENCH_OUT"], "a") as out:
    out.write(json.dumps({"rank": rank, **marks}) + "\n")
dist.destroy_process_group()
"""

_TIMES = ("tp_all_reduce", "tp_all_gather", "dp_all_reduce", "dp_all_gather")


def _table(name: str, rounds: list[dict[str, dict[str, float]]], steps: tuple[str, ...]) -> None:
    print(f"\n{name}")
    for step in steps:
        cells = []
        for who in ("rank0", "max"):
            values = sorted(r[step][who] for r in rounds)
            cells.append(f"{values[len(values) // 2]:8.3f} [{values[0]:.3f}-{values[-1]:.3f}]")
        print(f"  {step:16s}" + "   ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="rounds (default 1)")
    parser.add_argument("--disk", action="store_true",
                        help="also tp, then dp only, in two runs on one fresh cache directory")
    args = parser.parse_args()
    counts = ("built", "compiled", "reused", "disk")
    rounds: dict[str, list] = {}
    for _ in range(args.repeat):
        base = {"OMP_NUM_THREADS": "1", "TPU_DIST_COMPILE_CACHE": "0"}
        rounds.setdefault("gloo", []).append(run("gloo", 4, base, _WORKER, _TIMES))
        rounds.setdefault("tpu, no disk cache", []).append(
            run("tpu", 4, base, _WORKER, _TIMES + counts))
        if args.disk:
            with tempfile.TemporaryDirectory() as cache:
                for dim in ("tp", "dp"):
                    env = {**base, "TPU_DIST_COMPILE_CACHE": cache, "NEW_GROUPS_DIMS": dim}
                    steps = (f"{dim}_all_reduce", f"{dim}_all_gather") + counts
                    rounds.setdefault(f"tpu, disk cache, {dim} only", []).append(
                        run("tpu", 4, env, _WORKER, steps))
                print(f"entries written: {len(os.listdir(cache))}", file=sys.stderr)
    print(f"4 ranks, {args.repeat} round(s), load average {os.getloadavg()[0]:.1f}; seconds: "
          "median [min-max] of rank 0, then of the slowest rank (counts: programs)")
    for name, got in rounds.items():
        _table(name, got, tuple(got[0]))


if __name__ == "__main__":
    main()
