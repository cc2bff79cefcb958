"""FSDP-style all_gather + reduce_scatter on both dimensions of a 2-D mesh, on "tpu".

Run under ``tpu-launch --nproc-per-node 4`` (a (2, 2) mesh of ``tpu_dist.mesh.init_device_mesh``).
Each rank, per dimension and size: ``--iters`` rounds of one ``all_gather_into_tensor`` of
``size`` bytes per rank and one ``reduce_scatter_tensor`` back to ``size`` bytes, timed from a
barrier of the dimension's group to the end of the pair; rank 0 prints the median over rounds of
the slowest rank's time, one JSON line per (dimension, size). Used to compare family programs
(issue 33) with groups' own programs in an A B B A run of two trees::

    PYTHONPATH=<tree> python -m tpu_dist.launch --nproc-per-node 4 benchmarks/family_ab.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import tpu_dist  # noqa: F401  (registers "tpu")
from tpu_dist.mesh import init_device_mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="65536,4194304", help="bytes per rank, comma-separated")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("tpu")
    mesh = init_device_mesh((2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        n = dist.get_world_size(group)
        for size in (int(s) for s in args.sizes.split(",")):
            shard = torch.ones(size // 4)
            full = torch.empty(n * shard.numel())
            times = []
            for i in range(args.warmup + args.iters):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                dist.all_gather_into_tensor(full, shard, group=group)
                dist.reduce_scatter_tensor(shard, full, group=group)
                elapsed = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                if i >= args.warmup:
                    times.append(elapsed.item())
                shard.fill_(1.0)
            if dist.get_rank() == 0:
                print(json.dumps({
                    "dim": dim, "group": n, "bytes_per_rank": size,
                    "median_ms": round(1e3 * statistics.median(times), 3),
                    "p10_ms": round(1e3 * sorted(times)[len(times) // 10], 3),
                }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
