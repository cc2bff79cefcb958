"""Random message sizes: where a new size's time goes on "tpu", beside gloo (issue 34, item 7).

Measured: docs/decisions/0012-new-message-sizes-compile.md.

Every new (op, group, size, dtype) needs its own XLA program on the "tpu" backend: compiled, or
loaded from the on-disk compile cache (``TPU_DIST_COMPILE_CACHE``) or from another rank's compile
turn. gloo has no per-size step. This script all_reduces ``--sizes`` random sizes (float32,
1..``--max-elems`` elements, the same on every rank) once each on "tpu" and on a gloo group of the
same ranks, in the same processes, and times for every size: the first "tpu" call (program built
or loaded, then run), a second "tpu" call of the same size (run only), and the gloo call. Where
each rank's program came from is read from the backend's program table (``compiled``: XLA
compiled it in this process; ``disk``: the on-disk cache, written by an earlier run or by the
other rank's compile turn; ``reused``: another group's program of the same size). Each result is
checked against the sum a numpy reference gives.

With ``--bucket`` a second, different set of random sizes is timed as a user could bucket them
(not the backend): each tensor is copied into a zero-padded buffer of the next power of two
(at least 256 elements), the buffer all_reduced, the first elements copied back; only about
log2(max) programs are ever built.

Run under tpu-launch (2 ranks; the three runs in this order share one cache directory)::

    export TPU_DIST_COMPILE_CACHE=$(mktemp -d)              # empty: every size compiles
    python -m tpu_dist.launch --nproc-per-node 2 benchmarks/random_sizes.py --bucket
    python -m tpu_dist.launch --nproc-per-node 2 benchmarks/random_sizes.py --bucket  # warm
    TPU_DIST_COMPILE_CACHE=0 python -m tpu_dist.launch --nproc-per-node 2 benchmarks/random_sizes.py

Rank 0 prints per phase the median and 90th percentile of each time, the slower rank's first call
per size (a collective waits for its slowest rank), the programs' origins per rank, and the
totals: the same N calls on gloo against on "tpu", as calls per second, which is what a loop of
random sizes sees (``--json FILE`` writes everything).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import tpu_dist  # noqa: F401  (registers "tpu")
from tpu_dist.collectives import _runtime


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, default=60, help="random sizes per phase (default 60)")
    p.add_argument("--max-elems", type=int, default=1 << 18, help="largest size, float32 elements")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bucket", action="store_true", help="also time power-of-two bucketing")
    p.add_argument("--json", default=None, help="write the results to this file (rank 0)")
    return p.parse_args()


def _origins() -> dict:
    return dict(_runtime.get().programs.origins)


def _random_sizes(rng: np.random.Generator, n: int, high: int, avoid: set[int]) -> list[int]:
    sizes: list[int] = []
    while len(sizes) < n:
        s = int(rng.integers(1, high + 1))
        if s not in avoid and s not in sizes:
            sizes.append(s)
    return sizes


def _bucket(n: int) -> int:
    return max(256, 1 << (n - 1).bit_length())


def _phase(sizes: list[int], gloo: dist.ProcessGroup, control: dist.ProcessGroup,
           bucket: bool) -> list[dict]:
    """Times every size: first "tpu" call, second "tpu" call, gloo call; checks the sums."""
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2  # every rank contributes rank + 1
    rows = []
    for size in sizes:
        rows.append({"size": size})
        for label in ("tpu_first", "tpu_run", "gloo"):
            t = torch.full((size,), float(rank + 1))
            before = _origins() if label == "tpu_first" else None
            dist.barrier(group=control)
            start = time.perf_counter()
            if label == "gloo":
                dist.all_reduce(t, group=gloo)
            elif bucket:
                buf = torch.zeros(_bucket(size))
                buf[:size] = t
                dist.all_reduce(buf)
                t.copy_(buf[:size])
            else:
                dist.all_reduce(t)
            rows[-1][label] = time.perf_counter() - start
            if not np.allclose(t.numpy(), np.full(size, expected, dtype=np.float32)):
                raise AssertionError(f"rank {rank}: wrong all_reduce of {size} ({label})")
            if before is not None:
                new = [o for k, o in _origins().items() if k not in before]
                rows[-1]["origin"] = new[0] if new else "cached"
    return rows


def _stats(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    return f"{statistics.median(values) * 1e3:8.1f} {q[8] * 1e3:8.1f}"


def _report(name: str, per_rank: list[list[dict]]) -> dict:
    n = len(per_rank[0])
    slow_first = [max(r[i]["tpu_first"] for r in per_rank) for i in range(n)]
    slow_run = [max(r[i]["tpu_run"] for r in per_rank) for i in range(n)]
    slow_gloo = [max(r[i]["gloo"] for r in per_rank) for i in range(n)]
    origins = [
        {o: sum(row["origin"] == o for row in rows) for o in sorted({x["origin"] for x in rows})}
        for rows in per_rank
    ]
    print(f"\n{name}: {n} new sizes, slowest rank per call, ms (median, p90)")
    print(f"  tpu, first call of the size (build or load + run) {_stats(slow_first)}")
    print(f"  tpu, same size again (run)                        {_stats(slow_run)}")
    print(f"  gloo                                              {_stats(slow_gloo)}")
    for rank, counts in enumerate(origins):
        by_origin = {o: [row["tpu_first"] for row in per_rank[rank] if row["origin"] == o]
                     for o in counts}
        detail = ", ".join(f"{o} {c} (median {statistics.median(by_origin[o]) * 1e3:.1f} ms)"
                           for o, c in counts.items())
        print(f"  rank {rank} programs: {detail}")
    total_tpu, total_gloo = sum(slow_first), sum(slow_gloo)
    print(f"  {n} calls: tpu {total_tpu:.2f} s, gloo {total_gloo:.3f} s: gloo does "
          f"{total_tpu / total_gloo:.1f}x the calls per second")
    return {
        "sizes": [r["size"] for r in per_rank[0]],
        "tpu_first_s": slow_first, "tpu_run_s": slow_run, "gloo_s": slow_gloo,
        "origins": origins, "per_rank": per_rank,
    }


def main() -> None:
    args = _parse()
    dist.init_process_group("tpu")
    gloo = dist.new_group(backend="gloo")
    control = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    warm = torch.ones(4)
    dist.all_reduce(warm)
    dist.all_reduce(warm, group=gloo)
    rng = np.random.default_rng(args.seed)
    phases = {"random sizes": (_random_sizes(rng, args.sizes, args.max_elems, set()), False)}
    if args.bucket:
        seen = set(phases["random sizes"][0])
        phases["random sizes, bucketed to powers of two"] = (
            _random_sizes(rng, args.sizes, args.max_elems, seen), True)
    results = {"cache": os.environ.get("TPU_DIST_COMPILE_CACHE", "auto"),
               "world": dist.get_world_size(), "phases": {}}
    for name, (sizes, bucket) in phases.items():
        rows = _phase(sizes, gloo, control, bucket)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows, group=control)
        if rank == 0:
            results["phases"][name] = _report(name, gathered)
    if rank == 0:
        print(f"\nTPU_DIST_COMPILE_CACHE={results['cache']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
