"""How ``tpu-launch --compile-only`` grows with the topology: time split and peak memory.

Runs ``examples/train_fsdp_tp.py`` (FSDP2 x TP on a (dp, tp) mesh, 2 steps, one sequence per dp
rank) under ``tpu-launch --compile-only`` for each topology given, and prints one row per run:
devices, wall time, the script's time, the compile time (both from the JSON report), distinct
programs, and the peak resident memory of the launcher and its process. Reported, not asserted.

    python benchmarks/compile_only_scale.py                       # tpu7x: 512, 2048, 8192 devices
    python benchmarks/compile_only_scale.py --topologies v5p:4x4x4 --num-slices 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp_tp.py")


def run(topology: str, num_slices: int, steps: int) -> dict:
    from tpu_dist.mesh import Topology

    devices = Topology.parse(topology, num_slices).num_devices
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "tpu_dist.launch", "--emulate", topology, "--num-slices",
               str(num_slices), "--compile-only", "--compile-report", report_path, EXAMPLE,
               "--steps", str(steps), "--batch-size", str(devices // 2)]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, cwd=tmp)
        _, status, usage = os.wait4(proc.pid, 0)  # rusage of the launcher and its children
        wall = time.monotonic() - started
        stderr = proc.stderr.read()
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise SystemExit(f"{topology}: exit {code}\n{stderr[-3000:]}")
        with open(report_path) as f:
            report = json.load(f)
    return {
        "topology": topology,
        "num_slices": num_slices,
        "devices": devices,
        "wall_seconds": round(wall, 1),
        "script_seconds": report["script_seconds"],
        "compile_seconds": report["compile_seconds"],
        "programs": len({(c["program"], c["bytes_per_rank"], c["group_size"], c["dtype"])
                         for c in report["collectives"]}),
        "peak_rss_mib": usage.ru_maxrss // 1024,
        "load_average_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topologies", nargs="+",
                        default=["tpu7x:4x8x8", "tpu7x:8x8x16", "tpu7x:16x16x16"])
    parser.add_argument("--num-slices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    print(f"{'topology':<18}{'devices':>8}{'wall s':>9}{'script s':>10}{'compile s':>11}"
          f"{'programs':>10}{'peak MiB':>10}{'load':>6}")
    for topology in args.topologies:
        row = run(topology, args.num_slices, args.steps)
        rows.append(row)
        print(f"{topology + ' x' + str(args.num_slices):<18}{row['devices']:>8}"
              f"{row['wall_seconds']:>9}{row['script_seconds']:>10}{row['compile_seconds']:>11}"
              f"{row['programs']:>10}{row['peak_rss_mib']:>10}{row['load_average_1m']:>6}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
