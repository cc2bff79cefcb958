"""An isolated mid-size all_reduce: where a "tpu" call's time goes, beside gloo (decision 0005).

2 ranks spawned here with the environment ``tpu-dist-bench`` gives its ranks
(``OMP_NUM_THREADS=1``, ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``), float32 sum. For each size,
every round runs each variant once, in an order rotated every round; each call is preceded by
refilling its input (untimed) and a barrier on a separate gloo group, and is timed alone::

    gloo     dist.all_reduce on a gloo group
    tpu      dist.all_reduce on the "tpu" (default) group: the whole c10d path
    xla      the bare program as tpu-dist-bench's ``xla`` column runs it: the public call on a
             prebuilt global array (``tpu_dist.bench._xla.make_xla_case``)
    exec     the backend's own program started as the backend starts it (the loaded
             executable's ``execute`` on a prebuilt local block), then ``block_until_ready``
    hand     the backend's steps by hand, each timed: DLPack import of the tensor, ``execute``
             (returns once dispatched), wait until ready, DLPack export, ``copy_`` into the
             tensor, release of the result block
    chunked  the hand path in 4 pieces, one program each, all started at once; piece k is
             copied out while XLA reduces piece k + 1 (the finish copy overlapped; not kept)

Per call it also counts minor page faults and the CPU seconds of the whole process (all
threads), which this 2-core machine's load disturbs less than wall time. With ``--c10d-stages``
the "tpu" call's own steps are timed too, by wrapping the backend's internal functions in the
rank processes (``to_jax``, ``_watchdog.track``, ``Dispatcher.run_in_order``, the wait, the
DLPack export, the finish ``write``, the release; "other" is the rest: checks, plan, Work,
torch's c10d layer). Rank 0 prints, per size and variant, the median and p10-p90 of the per-call
mean over the two ranks, and the ratio of the medians to gloo's::

    PYTHONPATH=$PWD python benchmarks/isolated_allreduce.py --sizes 1M,4M,16M --rounds 40
    PYTHONPATH=$PWD python benchmarks/isolated_allreduce.py --sizes 16M --variants tpu \\
        --rounds 200 --perf-pause 6     # the ranks print their pids and wait: attach perf
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("gloo", "tpu", "xla", "exec", "hand", "chunked")
CHUNKS = 4
_HAND_STAGES = ("import", "dispatch", "wait", "export", "copy", "release")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time_c10d_stages() -> dict[str, float]:
    """Wrap the backend's internal steps with timers; returns the dict they add seconds to."""
    from tpu_dist.collectives import _dispatch, _jaxlib, _plan_finish, _runtime, _watchdog, _work

    spent: dict[str, float] = {}

    def wrap(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    wrap(_runtime.Runtime, "to_jax", "import")
    wrap(_watchdog, "track", "track")
    wrap(_dispatch.Dispatcher, "run_in_order", "dispatch")
    wrap(_work.TPUWork, "_await_arrays", "wait")
    wrap(_runtime.Runtime, "to_torch", "export")
    wrap(_plan_finish, "write", "copy")
    wrap(_jaxlib, "collect_garbage", "release")
    return spent


def _worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import tpu_dist
    from tpu_dist.bench._xla import make_xla_case
    from tpu_dist.collectives import _plan_algorithms, _runtime

    spent = _time_c10d_stages() if args.c10d_stages else None
    dist.init_process_group("tpu", rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")
    control = dist.new_group(backend="gloo")
    rt = _runtime.get()
    devices = rt.global_devices()
    device_ids = tuple(d.id for d in devices)
    if rank == 0:
        print(f"tpu_dist from {os.path.dirname(tpu_dist.__file__)}; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    report: dict = {"rank": rank, "sizes": {}}
    for size in args.sizes:
        count = size // 4
        tensor = torch.empty(count)
        gloo_tensor = torch.empty(count)
        expected = torch.full((count,), 3.0)  # the ranks contribute 1 and 2

        def program(n: int) -> Callable[[list], list]:
            key = _plan_algorithms.program_key("allreduce", device_ids, ((n, "float32"),), ("SUM",), "cpu")
            execute = rt.programs.program(key, devices).execute
            if execute is None:
                raise RuntimeError("the loaded executable's execute is not usable here")
            return execute

        execute, piece_execute = program(count), program(count // CHUNKS)
        tensor.fill_(rank + 1.0)
        block = rt.to_jax(tensor)
        zero_copy = block.unsafe_buffer_pointer() == tensor.data_ptr()
        xla = make_xla_case("all_reduce", devices, rank, count, torch.float32)
        stages: dict[str, list[float]] = {}

        def run_gloo() -> None:
            dist.all_reduce(gloo_tensor, group=gloo)

        def run_tpu() -> None:
            if spent is None:
                dist.all_reduce(tensor)
                return
            spent.clear()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            total = time.perf_counter() - start
            for stage, seconds in spent.items():
                stages.setdefault(f"c10d {stage}", []).append(seconds)
            stages.setdefault("c10d other", []).append(total - sum(spent.values()))

        def run_exec() -> None:
            (out,) = execute([block])
            out.block_until_ready()
            del out
            _runtime.release_results()

        def run_hand() -> None:
            t0 = time.perf_counter()
            imported = rt.to_jax(tensor)
            t1 = time.perf_counter()
            (out,) = execute([imported])
            t2 = time.perf_counter()
            out.block_until_ready()
            t3 = time.perf_counter()
            result = rt.to_torch(out)
            t4 = time.perf_counter()
            tensor.copy_(result)
            t5 = time.perf_counter()
            del out, result, imported
            _runtime.release_results()
            t6 = time.perf_counter()
            marks = (t0, t1, t2, t3, t4, t5, t6)
            for stage, a, b in zip(_HAND_STAGES, marks, marks[1:]):
                stages.setdefault(f"hand {stage}", []).append(b - a)

        def run_chunked() -> None:
            piece = count // CHUNKS
            views = [tensor[k * piece:(k + 1) * piece] for k in range(CHUNKS)]
            outs = [piece_execute([rt.to_jax(v)])[0] for v in views]
            for view, out in zip(views, outs):
                out.block_until_ready()
                view.copy_(rt.to_torch(out))
            del outs
            _runtime.release_results()

        calls = {"gloo": run_gloo, "tpu": run_tpu, "xla": xla.call, "exec": run_exec,
                 "hand": run_hand, "chunked": run_chunked}
        chosen = [v for v in VARIANTS if v in args.variants]
        writes = {"gloo": gloo_tensor, "tpu": tensor, "hand": tensor, "chunked": tensor}
        for variant in chosen:  # warm up; check every variant that writes a result
            for _ in range(3):
                (gloo_tensor if variant == "gloo" else tensor).fill_(rank + 1.0)
                calls[variant]()
            if variant in writes and not torch.equal(writes[variant], expected):
                raise RuntimeError(f"rank {rank}: {variant}: wrong all_reduce at {size} bytes")
        stages.clear()
        if args.perf_pause:
            print(f"rank {rank} pid {os.getpid()}: measuring {size} bytes in "
                  f"{args.perf_pause} s", flush=True)
            time.sleep(args.perf_pause)
        dist.barrier(group=control)
        times: dict[str, list[float]] = {v: [] for v in chosen}
        faults: dict[str, list[int]] = {v: [] for v in chosen}
        cpu: dict[str, list[float]] = {v: [] for v in chosen}
        for r in range(args.rounds):
            for variant in chosen[r % len(chosen):] + chosen[: r % len(chosen)]:
                (gloo_tensor if variant == "gloo" else tensor).fill_(rank + 1.0)
                dist.barrier(group=control)
                f0, c0, t0 = _minflt(), time.process_time(), time.perf_counter()
                calls[variant]()
                t1 = time.perf_counter()
                times[variant].append(t1 - t0)
                cpu[variant].append(time.process_time() - c0)
                faults[variant].append(_minflt() - f0)
        for variant, out in writes.items():  # and once more after the timed calls
            if variant in chosen:
                (gloo_tensor if variant == "gloo" else tensor).fill_(rank + 1.0)
                calls[variant]()
                if not torch.equal(out, expected):
                    raise RuntimeError(f"rank {rank}: {variant}: wrong all_reduce at {size}")
        report["sizes"][size] = {"times": times, "faults": faults, "cpu": cpu,
                                 "stages": stages, "zero_copy": zero_copy}
        block = xla = None  # this size's buffers go before the next size's
        _runtime.release_results()
    with open(f"{out_path}.{rank}", "w") as out:
        json.dump(report, out)
    dist.barrier(group=control)
    dist.destroy_process_group()


def _print(reports: list[dict], args: argparse.Namespace) -> None:
    print(f"2 ranks, float32 sum, {args.rounds} rounds (one call of each variant per round, "
          "order rotated); ms per call: median and p10-p90 of the mean over the ranks; CPU ms "
          "(whole process) and minor faults per call: median and mean of the mean over the "
          "ranks")
    for size in args.sizes:
        per_rank = [r["sizes"][str(size)] for r in reports]

        def mean(field: str, name: str) -> list[float]:
            series = [p[field][name] for p in per_rank]
            return [sum(values) / len(values) for values in zip(*series)]

        print(f"\n{size >> 10} KiB (input imported zero-copy: "
              f"{all(p['zero_copy'] for p in per_rank)})")
        print(f"  {'variant':8s} {'ms':>7s} {'p10-p90':>13s} {'/gloo':>6s} {'cpu ms':>7s} "
              f"{'faults med/mean':>16s}")
        times = per_rank[0]["times"]
        gloo = _pct(mean("times", "gloo"), 0.5) if "gloo" in times else None
        for variant in times:
            wall = mean("times", variant)
            med = _pct(wall, 0.5)
            ratio = f"{med / gloo:6.2f}" if gloo else "     -"
            flt = mean("faults", variant)
            print(f"  {variant:8s} {med * 1e3:7.2f} {_pct(wall, 0.1) * 1e3:6.2f}-"
                  f"{_pct(wall, 0.9) * 1e3:<6.2f} {ratio} "
                  f"{_pct(mean('cpu', variant), 0.5) * 1e3:7.2f} "
                  f"{_pct(flt, 0.5):7.0f}/{sum(flt) / len(flt):<7.1f}")
        for prefix in ("hand", "c10d"):
            names = [s for s in per_rank[0]["stages"] if s.startswith(prefix + " ")]
            if names:
                cells = [f"{s.split(' ', 1)[1]} {_pct(mean('stages', s), 0.5) * 1e3:.3f}"
                         for s in names]
                print(f"  {prefix} stages, median ms: " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M", help="bytes per rank (default 1M,4M,16M)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds (default 30)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"a subset of {','.join(VARIANTS)} (default all)")
    parser.add_argument("--c10d-stages", action="store_true",
                        help="also time the steps inside the tpu call (wraps backend internals)")
    parser.add_argument("--perf-pause", type=float, default=0.0,
                        help="seconds the ranks wait, printing their pids, before each size")
    args = parser.parse_args()
    args.sizes = [_size(s) for s in args.sizes.split(",")]
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    bad = [s for s in args.sizes if s % (4 * CHUNKS * 16)]
    if bad:
        parser.error(f"sizes {bad} are not multiples of {4 * CHUNKS * 16} bytes (the chunked "
                     "variant's pieces must stay 64-byte aligned)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        mp.start_processes(_worker, args=(args, port, out), nprocs=2, start_method="spawn")
        reports = []
        for rank in range(2):
            with open(f"{out}.{rank}") as f:
                reports.append(json.load(f))
    _print(reports, args)


if __name__ == "__main__":
    main()
