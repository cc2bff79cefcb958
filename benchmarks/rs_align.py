"""Does padding a TPU reduce-scatter's parts to 128 elements buy anything? (issue 31 follow-up)

The "tpu" plan pads each rank's part of a TPU reduce-scatter to a multiple of
``_plan_algorithms.TPU_BLOCK_ALIGN`` (128) elements, as it pads all-gather blocks (to 1,024), where unaligned
blocks made libtpu's compiler take seconds to minutes and gigabytes
(docs/decisions/0022-tpu-block-alignment.md). For reduce-scatters no gain was measured. This
compiles the backend's own reduce-scatter plan for parts of ``n`` elements, unaligned (the padding
switched off), padded to 128 (the plan as it is) and padded to 1,024, over groups where FSDP
reduce-scatters run: part of a slice (a group's own program on v4, v5p and TPU7x, the family's on
v5e and v6e), a whole slice, and across two slices. Each compile runs in a child limited to
``--limit-gib`` of address space and ``--timeout`` seconds; a row gives the compile's seconds, the
child's peak RSS and the HLO collectives, or how the child died.

    python benchmarks/rs_align.py                 # every case, f32 and bf16
    python benchmarks/rs_align.py --cases v5e-family --dtypes float32

Reported, not asserted (docs/decisions/0022-tpu-block-alignment.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (topology, slices, mesh shape for plan_mesh, axis whose groups reduce-scatter)
CASES = {
    "v4-every8": ("v4:4x4x4", 1, (8, 8), 0),  # 8 groups of 8 strided over 64 chips
    "v5e-family": ("v5e:16x16", 1, (32, 8), 0),  # dp of a tp-8 mesh: 8 groups of 32
    "v5e-slice": ("v5e:4x4", 1, (16,), 0),
    "v6e-family": ("v6e:16x16", 1, (32, 8), 0),
    "v6e-slice": ("v6e:4x4", 1, (16,), 0),
    "v5p-every8": ("v5p:4x4x4", 1, (8, 8), 0),
    "v5p-2slices": ("v5p:4x4x4", 2, (16, 8), 0),  # dp over both slices: 8 groups of 16
    "tpu7x-every8": ("tpu7x:4x4x4", 1, (16, 8), 0),  # 128 devices: 8 groups of 16
    "tpu7x-slice": ("tpu7x:4x4x4", 1, (128,), 0),
}

_CHILD = """
import json, resource, sys, time
limit = int(sys.argv[1]) << 30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import numpy as np
import torch
import torch.distributed as dist
from tpu_dist.collectives import _plan, _plan_algorithms, _plan_collectives
from tpu_dist.collectives.compile_only import compile_collective, topology_devices
from tpu_dist.mesh import Topology, plan_mesh

spec, slices, mesh, axis, n, align, dtype = json.loads(sys.argv[2])
_plan_algorithms.TPU_BLOCK_ALIGN = align  # read when the plan is made
topo = Topology.parse(spec, slices)
devices = topology_devices(topo)
ranks = plan_mesh(topo, tuple(mesh), None)
family = np.moveaxis(ranks, axis, -1).reshape(-1, ranks.shape[axis]).tolist()
mine = family[0]
group = _plan.GroupView(
    0, len(mine), tuple(devices[r].id for r in mine), "tpu", tuple(mine),
    family=tuple(tuple(devices[r].id for r in g) for g in family) if len(family) > 1 else (),
    device_kind=devices[0].device_kind,
)
size = len(mine)
plan = _plan_collectives.reduce_scatter_tensor(
    group, torch.empty(n, dtype=getattr(torch, dtype)),
    torch.empty(n * size, dtype=getattr(torch, dtype)), dist.ReduceOp.SUM,
)
key = plan.key
program = [devices[r] for r in (sum(family, []) if key.groups > 1 else mine)]
start = time.monotonic()
result = compile_collective(key, program)
print(json.dumps({
    "seconds": round(time.monotonic() - start, 2),
    "part": key.blocks[0][0] // size,
    "groups": key.groups, "size": size,
    "hlo": sorted({c.op for c in result.collectives}),
    "temp_mib": round(result.temp_bytes / 2**20, 1) if result.temp_bytes is not None else None,
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
}))
"""


def run(case: str, n: int, align: int, dtype: str, limit_gib: int, timeout: float) -> dict:
    spec, slices, mesh, axis = CASES[case]
    args = json.dumps([spec, slices, list(mesh), axis, n, align, dtype])
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(limit_gib), args], capture_output=True,
            text=True, timeout=timeout, env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"not done in {timeout:.0f} s"}
    row: dict = {"wall": round(time.monotonic() - start, 1)}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:160]
        row["error"] = f"exit {proc.returncode}: {tail}"
        return row
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--part", type=int, default=1_000_000,
                        help="elements of each rank's part, unaligned (default 1,000,000)")
    parser.add_argument("--limit-gib", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    n = args.part
    variants = [("none", n, 1), ("128", n, 128), ("1024", n, 1024)]
    print("case            dtype     padding  part       groups x size  compile s  HLO"
          "                      temp MiB  peak RSS MiB")
    for case in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            for label, part, align in variants:
                row = run(case, part, align, dtype, args.limit_gib, args.timeout)
                if "error" in row:
                    print(f"{case:15s} {dtype:9s} {label:8s} {'':10s} {'':14s} "
                          f"{row['error']}", flush=True)
                    continue
                print(f"{case:15s} {dtype:9s} {label:8s} {row['part']:<10,d} "
                      f"{row['groups']:>3d} x {row['size']:<7d} {row['seconds']:9.2f}  "
                      f"{','.join(row['hlo']):24s} {row['temp_mib']!s:>8s}  "
                      f"{row['peak_rss_mib']:>12,d}", flush=True)


if __name__ == "__main__":
    main()
