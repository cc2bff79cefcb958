"""XLA:CPU compile options for small collective programs: compile and run, each way (decision 0007).

One process with ``--devices`` CPU devices (``--xla_force_host_platform_device_count``; XLA's
in-process collectives, no gloo). For each program kind the backend builds on CPU, the same
lowered program is compiled with XLA's defaults and with
``tpu_dist.collectives._lowering.CPU_FAST_COMPILE_OPTIONS``, alternating, ``--compiles`` times
each on a fresh block length each time (so no cache serves it): the CPU time of
``lowered.compile()``. Then, for each block size of ``--sizes`` (bytes a rank), both compiled
programs run the same input, alternating rounds of ``--calls`` calls: the median time of a call
(``block_until_ready``), the lowest of the rounds' medians. The outputs of both are compared
bit for bit. Run::

    python benchmarks/compile_options.py [--devices 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--compiles", type=int, default=6)
    parser.add_argument("--sizes", default="4K,16K,64K,256K",
                        help="block bytes a rank for the run times (K = 1024)")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    from tpu_dist.collectives import _lowering
    from tpu_dist.collectives._types import ProgramKey

    jax.config.update("jax_enable_compilation_cache", False)
    devices = jax.devices("cpu")
    size = len(devices)
    ids = tuple(d.id for d in devices)
    _, sharding = _lowering.mesh_of(devices, 1)
    fast = dict(_lowering.CPU_FAST_COMPILE_OPTIONS)
    kinds = [
        ("allreduce", "exchange", ("SUM", None)),
        ("allreduce", "xla", ("SUM", None)),
        ("allreduce", "gather_reduce", ("PRODUCT", None)),
        ("reduce_scatter", "exchange", ("SUM", None)),
        ("allgather", "exchange", ()),
        ("alltoall", "xla", ()),
        ("broadcast", "xla", (0,)),
    ]

    def lowered(kind: str, algorithm: str, params: tuple, n: int):
        return _lowering.lower(ProgramKey(kind, ids, ((n, "float32"),), params, algorithm), devices)

    def compile_s(low, options: dict) -> tuple[float, object]:
        start = time.process_time()
        compiled = low.compile(compiler_options=options) if options else low.compile()
        return time.process_time() - start, compiled

    lowered("allreduce", "xla", ("SUM", None), 8).compile()  # JAX's own first-use costs
    rows = []
    print(f"{size} CPU devices; compile CPU ms (median of {args.compiles}), default -> fast")
    for kind, algorithm, params in kinds:
        times: dict[str, list[float]] = {"default": [], "fast": []}
        for i in range(args.compiles):
            for name, options in (("default", {}), ("fast", fast)):
                n = size * (1000 + 2 * i + (name == "fast"))
                times[name].append(compile_s(lowered(kind, algorithm, params, n), options)[0])
        d, f = (statistics.median(times[k]) * 1e3 for k in ("default", "fast"))
        print(f"  {kind:15s} {algorithm:13s} {d:7.1f} -> {f:6.1f} ms ({d / f:.1f}x)")
        rows.append({"kind": kind, "algorithm": algorithm, "compile_ms_default": d,
                     "compile_ms_fast": f})

    print(f"run us a call (lowest of {args.rounds} rounds' medians), default -> fast")
    runs = []
    for kind, algorithm, params in kinds:
        for text in args.sizes.split(","):
            nbytes = int(text.rstrip("K")) * (1024 if text.endswith("K") else 1)
            n = max(size, nbytes // 4 // size * size)
            low = lowered(kind, algorithm, params, n)
            programs = {"default": low.compile(), "fast": low.compile(compiler_options=fast)}
            x = jax.device_put(np.random.default_rng(0).standard_normal(size * n)
                               .astype(np.float32), sharding)
            outs = {k: np.asarray(p(x)[0]) for k, p in programs.items()}
            same = outs["default"].tobytes() == outs["fast"].tobytes()
            best = {"default": float("inf"), "fast": float("inf")}
            for _ in range(args.rounds):
                for name, program in programs.items():
                    ts = []
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        jax.block_until_ready(program(x))
                        ts.append(time.perf_counter() - start)
                    best[name] = min(best[name], statistics.median(ts) * 1e6)
            print(f"  {kind:15s} {algorithm:13s} {text:>5s}/rank {best['default']:8.1f} -> "
                  f"{best['fast']:8.1f} us{'' if same else '  OUTPUTS DIFFER'}")
            runs.append({"kind": kind, "algorithm": algorithm, "bytes_per_rank": n * 4,
                         "run_us_default": best["default"], "run_us_fast": best["fast"],
                         "same_bits": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": size, "compile": rows, "run": runs}, f, indent=1)
    if not all(r["same_bits"] for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
