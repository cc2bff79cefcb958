"""Command line -> :class:`BenchConfig` -> ranks (spawned, or the ones torchrun started) -> report."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from tpu_dist.bench._config import (
    DTYPES,
    OPS,
    BenchConfig,
    canonical_ops,
    parse_bytes,
    size_sweep,
)

__all__ = ["build_parser", "config_from_args", "launch", "main"]

_EPILOG = """\
examples:
  tpu-dist-bench                                    # every op, 1K..64M, tpu vs gloo, 2 ranks
  tpu-dist-bench -n 4 --ops all_reduce -b 4K -e 64M --json ar4.json --plot ar4.png
  tpu-dist-bench --sizes 4K,16M --ops ag,rs --iters 50
  torchrun --nproc-per-node 8 -m tpu_dist.bench --backends tpu   # ranks from torchrun/tpu-launch

--plot needs matplotlib, an optional extra that tpu_dist does not install
(pip install matplotlib). Sizes take binary units (4K = 4096 bytes). See
`python -c "import tpu_dist.bench; help(tpu_dist.bench)"` for the columns and formulas.
"""


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The ``tpu-dist-bench`` argument parser."""
    p = argparse.ArgumentParser(
        prog="tpu-dist-bench",
        description="Collective benchmark for torch.distributed backends, after nccl-tests: "
        "time, algbw and busbw per op and size, several backends alternating in one run, the "
        "ratio to a reference backend, and for the tpu backend the first-call (compile) cost, "
        "the number of compiled programs and the host overhead per call.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-o", "--ops", type=_csv, default=list(OPS), metavar="OP,...",
                   help=f"ops to measure (default: all): {', '.join(OPS)}; short names "
                   "allreduce/ar, allgather/ag, reduce_scatter/rs, alltoall/a2a, bcast, p2p")
    p.add_argument("--backends", type=_csv, default=["tpu", "gloo"], metavar="B,...",
                   help="c10d backends to compare, alternating in one run (default: tpu,gloo)")
    p.add_argument("--baseline", default=None, metavar="B",
                   help="backend the ratios are taken against (default: gloo if measured, "
                   "else the last backend)")
    p.add_argument("-b", "--min-bytes", type=parse_bytes, default=1 << 10, metavar="SIZE",
                   help="smallest message (default: 1K)")
    p.add_argument("-e", "--max-bytes", type=parse_bytes, default=64 << 20, metavar="SIZE",
                   help="largest message (default: 64M)")
    p.add_argument("-f", "--step-factor", type=int, default=4, metavar="F",
                   help="multiply the size by F between steps (default: 4)")
    p.add_argument("--sizes", type=_csv, default=None, metavar="SIZE,...",
                   help="explicit message sizes instead of the -b/-e/-f sweep")
    p.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float32",
                   help="element type (default: float32); reductions are sums")
    p.add_argument("-n", "--nproc", type=int, default=2,
                   help="ranks to start on this machine (default: 2); ignored when RANK and "
                   "WORLD_SIZE are set (torchrun, tpu-launch)")
    p.add_argument("-w", "--warmup", type=int, default=3,
                   help="untimed calls per backend and size after the first call (default: 3)")
    p.add_argument("-i", "--iters", type=int, default=20,
                   help="timed calls per backend and size (default: 20)")
    p.add_argument("-r", "--rounds", type=int, default=5,
                   help="blocks the timed calls are split into, backends alternating block by "
                   "block (default: 5)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the one-call result check per backend and size")
    p.add_argument("--no-xla", dest="xla_baseline", action="store_false",
                   help="do not time the bare XLA program next to the tpu backend (no xla/host "
                   "columns)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the JSON report here")
    p.add_argument("--plot", dest="plot_path", metavar="PATH",
                   help="write a PNG of time and busbw against size (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="process-group timeout in seconds (default: 600)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The typed config for parsed arguments (validated by :class:`BenchConfig`)."""
    if args.sizes:
        sizes = tuple(parse_bytes(s) for s in args.sizes)
    else:
        sizes = size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
    return BenchConfig(
        ops=canonical_ops(args.ops),
        backends=tuple(b.lower() for b in args.backends),
        baseline=args.baseline,
        sizes=sizes,
        dtype=args.dtype,
        nproc=args.nproc,
        warmup=args.warmup,
        iters=args.iters,
        rounds=args.rounds,
        check=args.check,
        xla_baseline=args.xla_baseline,
        json_path=args.json_path,
        plot_path=args.plot_path,
        timeout_s=args.timeout,
        progress=not args.quiet,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned(index: int, config: BenchConfig, nproc: int, port: int, out: str) -> None:
    from tpu_dist.bench._measure import run_rank
    from tpu_dist.launch import quiet_gloo_lines

    quiet_gloo_lines()  # jaxlib's gloo prints a line per communicator; tpu-launch drops them too

    report = run_rank(config, index, nproc, f"tcp://127.0.0.1:{port}")
    if report is not None:
        with open(out, "w") as f:
            json.dump(report, f)


def launch(config: BenchConfig) -> dict[str, Any] | None:
    """Run the benchmark on every rank; the report on the process that has it, else None.

    Under torchrun / tpu-launch (``RANK`` and ``WORLD_SIZE`` set) this process is one rank
    (``env://`` rendezvous) and only rank 0 gets the report. Otherwise ``config.nproc`` ranks
    are spawned on this machine (``torch.multiprocessing``, spawn method) and this process
    collects rank 0's report. Spawned ranks get what ``tpu-launch`` gives CPU workers, unless
    set: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` and, with several ranks, ``OMP_NUM_THREADS=1``
    (as torchrun; torch's intra-op threads spinning beside XLA's made the tpu backend's
    0.25-4 MiB all_reduce ~3x slower, docs/decisions/0001-benchmark-method.md). Both backends
    see them.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from tpu_dist.bench._measure import run_rank

        return run_rank(config, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    import torch.multiprocessing as mp

    from tpu_dist.launch import HUGE_PAGES_TUNABLE

    # Read by each new process at start; removed again afterwards.
    ours = {"GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}
    if config.nproc > 1:
        ours["OMP_NUM_THREADS"] = "1"
    ours = {var: value for var, value in ours.items() if var not in os.environ}
    os.environ.update(ours)
    try:
        with tempfile.TemporaryDirectory(prefix="tpu_dist_bench_") as tmp:
            out = os.path.join(tmp, "report.json")
            mp.start_processes(
                _spawned,
                args=(config, config.nproc, _free_port(), out),
                nprocs=config.nproc,
                start_method="spawn",
            )
            with open(out) as f:
                return json.load(f)
    finally:
        for var in ours:
            del os.environ[var]


def main(argv: Sequence[str] | None = None) -> int:
    """``tpu-dist-bench``: parse flags, run, print the table, write JSON/PNG. Returns 0 if all
    results were right, 1 if some op returned wrong values, 2 on bad flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    if config.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                "--plot needs matplotlib, which tpu_dist does not install: pip install matplotlib"
            )
    report = launch(config)
    if report is None:
        return 0
    if config.json_path:
        with open(config.json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"# wrote {config.json_path}")
    if config.plot_path:
        from tpu_dist.bench._plot import write_plot

        write_plot(report, config.plot_path)
        print(f"# wrote {config.plot_path}")
    wrong = [r for r in report["rows"] if r["check"] not in ("ok", "skipped")]
    if wrong:
        for r in wrong:
            print(
                f"tpu-dist-bench: {r['backend']} {r['op']} of {r['bytes']} bytes returned wrong "
                f"values: {r['check']}",
                file=sys.stderr,
            )
        return 1
    return 0
