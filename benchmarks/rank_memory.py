"""Peak memory of each rank of a training example, "tpu" beside gloo, step by step (issue 51).

Runs an example script (default ``examples/train_fsdp.py``) on ``--nproc`` CPU ranks once per
backend (``--backends tpu gloo``, ``--repeat`` times, alternating: A B A B), each rank wrapped so
that after every optimizer step it notes its resident memory (``VmRSS``) and its peak so far
(``VmHWM``, what the kernel counts as the process's high-water mark), and prints per backend:

* the peak RSS of the largest rank (the figure that decides whether a job fits), and the ratio
  of each backend's to the last one's (tpu / gloo);
* RSS after the first step, the middle step and the last step of the largest rank: flat, or
  growing (a cache, a leak);
* with ``--tensors``: the peak tensor bytes of rank 0's second step as torch's MemTracker sees
  them (``tpu_dist.compile_job.StepMeter``; only tensors torch owns, not XLA's own buffers);
* the "tpu" backend's programs built (``compile_count()``) and what its caches hold, per
  rank.

A watchdog guards the machine (``benchmarks/memory_guard.py``): the script sums the RSS of
every process the launcher started and kills them all (SIGKILL) when the sum passes
``--limit-gib`` (default 10), and says so.

    python benchmarks/rank_memory.py --nproc 2                           # train_fsdp.py, 10 steps
    python benchmarks/rank_memory.py --nproc 4 --tensors -- --steps 10 --dim 256 --layers 4
    python benchmarks/rank_memory.py --nproc 4 --example examples/train_moe.py -- --steps 30

Example flags go after ``--`` (``--backend`` is set by the script). The launcher is torchrun
(``--launcher tpu-launch`` for tpu_dist's; tpu-launch gives CPU workers
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, which rounds large allocations to huge pages, for
both backends alike). ``--json FILE`` writes every rank's record.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_guard  # noqa: E402  (benchmarks/memory_guard.py)


# -- inside each rank ----------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _Mallinfo2(__import__("ctypes").Structure):
    _fields_ = [(name, __import__("ctypes").c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _census() -> dict:
    """MiB of: storages of live torch tensors (unique, from the garbage collector's view),
    glibc's bytes in use in its arenas, in mmapped chunks, and free in its arenas."""
    import ctypes
    import gc

    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except Exception:  # noqa: BLE001 (no storage: DTensor's wrapper, a freed one)
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    mib = 2**20
    return {"tensors": round(total / mib, 1), "in_use": round(info.uordblks / mib, 1),
            "mmapped": round(info.hblkhd / mib, 1), "free": round(info.fordblks / mib, 1)}


def worker(out_dir: str, example: str, example_args: list[str], tensors: bool) -> None:
    """One rank: the example's ``main`` with an optimizer hook noting RSS after each step."""
    import importlib.util

    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    sys.path.insert(0, os.path.dirname(os.path.abspath(example)))
    name = os.path.splitext(os.path.basename(example))[0]
    spec = importlib.util.spec_from_file_location(name, example)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)

    census = bool(os.environ.get("RANK_MEMORY_CENSUS"))
    steps: list[dict] = []
    began = time.perf_counter()

    def noted(optimizer, args, kwargs) -> None:
        steps.append({"rss_kib": _status_kib("VmRSS"), "hwm_kib": _status_kib("VmHWM"),
                      "t": time.perf_counter() - began})
        if census:
            steps[-1]["census"] = _census()
        if "jax" in sys.modules and dist.is_initialized() and dist.get_backend() == "tpu":
            live = sys.modules["jax"].live_arrays()
            steps[-1]["jax_live"] = [len(live), sum(a.nbytes for a in live)]

    first: dict = {}

    def forward(module, inputs) -> None:
        if not first:  # the first forward: JAX (on "tpu") and the model are set up
            first.update(rss_kib=_status_kib("VmRSS"), hwm_kib=_status_kib("VmHWM"))

    from torch.nn.modules.module import register_module_forward_pre_hook

    hook = register_optimizer_step_post_hook(noted)
    forward_hook = register_module_forward_pre_hook(forward)
    meter = None
    if tensors:
        from tpu_dist.compile_job import StepMeter

        meter = StepMeter()
        meter.__enter__()
    try:
        backend = module.main(example_args)
    finally:
        hook.remove()
        forward_hook.remove()
        if meter is not None:
            meter.__exit__(None, None, None)
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("RANK_MEMORY_MALLOC_STATS"):  # glibc's per-arena figures, on stderr
        import ctypes

        sys.stderr.flush()
        print(f"malloc_stats of rank {rank}:", file=sys.stderr, flush=True)
        ctypes.CDLL("libc.so.6").malloc_stats()
    import tpu_dist

    record = {"rank": rank, "backend": backend, "steps": steps, "package": tpu_dist.__file__,
              "peak_kib": _status_kib("VmHWM"),
              "before_kib": first.get("rss_kib", 0), "wall_s": time.perf_counter() - began}
    if meter is not None and meter.chosen() is not None:
        step = meter.chosen()
        record["tensor_peak_bytes"] = step.peak_bytes
        record["tensor_peak_kinds"] = step.peak_breakdown
    if backend == "tpu":
        from tpu_dist.collectives import _runtime

        runtime = _runtime.get()
        record["programs"] = runtime.programs.compilations
        info = getattr(runtime.programs, "info", None)  # what the program cache holds
        if callable(info):
            held = info()
            record["held"] = f"{held.programs} programs, {held.bytes / 2**20:.1f} MiB"
    with open(os.path.join(out_dir, f"{backend}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if hasattr(module, "leave"):
        module.leave(backend)


# -- the parent: launch, guard, report ---------------------------------------------------------


def run_once(backend: str, nproc: int, example: str, example_args: list[str], out_dir: str,
             launcher: str, limit_kib: int, tensors: bool, timeout: float,
             extra_env: dict[str, str] | None = None) -> dict:
    """Launch one run; returns ``{"exit": code, "killed": bool, "max_sum_kib": ..., "log": ...}``."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra_env or {})
    if launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    else:
        head = [sys.executable, "-m", "tpu_dist.launch", "--nproc-per-node", str(nproc)]
    cmd = [*head, os.path.abspath(__file__), "--worker", out_dir, "--example", example]
    if tensors:
        cmd.append("--tensors")
    cmd += ["--", *example_args, "--backend", backend]
    log_path = os.path.join(out_dir, f"{backend}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        guarded = memory_guard.run_guarded(proc, limit_kib, timeout)
    with open(log_path) as f:
        text = f.read()
    return {"exit": proc.returncode, "killed": guarded["killed"],
            "max_sum_kib": guarded["max_sum_kib"], "log": text}


def _gib(kib: float) -> str:
    return f"{kib / 2**20:.2f}"


def summary(records: list[dict]) -> dict:
    """The figures of one run (every rank's record of one backend)."""
    top = max(records, key=lambda r: r["peak_kib"])
    steps = top["steps"]
    pick = {"first": steps[0], "middle": steps[len(steps) // 2], "last": steps[-1]} if steps else {}
    out = {
        "peak_kib": top["peak_kib"],
        "peak_rank": top["rank"],
        "rss_after_step_kib": {k: v["rss_kib"] for k, v in pick.items()},
        "hwm_after_step_kib": {k: v["hwm_kib"] for k, v in pick.items()},
        "steps": len(steps),
        "before_kib": top.get("before_kib", 0),
        "step_s": (steps[-1]["t"] - steps[0]["t"]) / (len(steps) - 1) if len(steps) > 1 else None,
    }
    r0 = next((r for r in records if r["rank"] == 0), None)
    if r0 is not None and "tensor_peak_bytes" in r0:
        out["tensor_peak_bytes"] = r0["tensor_peak_bytes"]
        out["tensor_peak_kinds"] = r0["tensor_peak_kinds"]
    if any("programs" in r for r in records):
        out["programs"] = {r["rank"]: r.get("programs") for r in records}
        out["held"] = {r["rank"]: r.get("held") for r in records if "held" in r}
    return out


def main() -> None:
    argv = sys.argv[1:]
    if "--worker" in argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker")
        p.add_argument("--example")
        p.add_argument("--tensors", action="store_true")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        a = p.parse_args(argv)
        rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
        worker(a.worker, a.example, rest, a.tensors)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backends", nargs="+", default=["tpu", "gloo"])
    p.add_argument("--repeat", type=int, default=1, help="runs per backend, alternating")
    p.add_argument("--example", default=os.path.join(ROOT, "examples", "train_fsdp.py"))
    p.add_argument("--launcher", choices=("torchrun", "tpu-launch"), default="torchrun")
    p.add_argument("--limit-gib", type=float, default=10.0,
                   help="kill a run whose processes hold more than this in sum (default 10)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--tensors", action="store_true", help="also rank 0's peak tensor bytes")
    p.add_argument("--json", default=None)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every rank's environment (repeatable)")
    p.add_argument("--log-dir", default=None, help="keep each run's output there")
    p.add_argument("--per-step", action="store_true", help="print RSS after every step")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    example_args = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    if not any(x.startswith("--steps") for x in example_args):
        example_args = [*example_args, "--steps", "10"]
    results: dict[str, list[dict]] = {b: [] for b in a.backends}
    print(f"{os.path.basename(a.example)} {' '.join(example_args)}: {a.nproc} ranks, "
          f"{a.launcher}, limit {a.limit_gib:g} GiB", flush=True)
    for rep in range(a.repeat):
        for backend in a.backends:
            with tempfile.TemporaryDirectory() as out_dir:
                run = run_once(backend, a.nproc, os.path.abspath(a.example), example_args,
                               out_dir, a.launcher, int(a.limit_gib * 2**20), a.tensors,
                               a.timeout, dict(e.split("=", 1) for e in a.env))
                records = []
                for name in sorted(os.listdir(out_dir)):
                    if name.endswith(".json"):
                        with open(os.path.join(out_dir, name)) as f:
                            records.append(json.load(f))
            if a.log_dir:
                os.makedirs(a.log_dir, exist_ok=True)
                with open(os.path.join(a.log_dir, f"{backend}-{rep + 1}.log"), "w") as f:
                    f.write(run["log"])
            if run["exit"] != 0 or len(records) != a.nproc:
                why = (f"killed by the watchdog: {run['killed']}" if run["killed"]
                       else f"exit {run['exit']}")
                print(f"  {backend} run {rep + 1}: FAILED ({why}; largest sum of RSS "
                      f"{_gib(run['max_sum_kib'])} GiB, {len(records)} rank records)\n"
                      + run["log"][-2500:], flush=True)
                results[backend].append({"failed": why, "max_sum_kib": run["max_sum_kib"]})
                continue
            s = summary(records)
            s["max_sum_kib"] = run["max_sum_kib"]
            s["ranks"] = records
            results[backend].append(s)
            after = s["rss_after_step_kib"]
            line = (f"  {backend:5s} run {rep + 1}: peak RSS {_gib(s['peak_kib'])} GiB (rank "
                    f"{s['peak_rank']}); RSS at the first forward {_gib(s['before_kib'])}, after step 1 / mid / last {_gib(after['first'])} / "
                    f"{_gib(after['middle'])} / {_gib(after['last'])} GiB; sum of ranks at most "
                    f"{_gib(run['max_sum_kib'])} GiB; {s['step_s'] or 0:.2f} s/step")
            if "tensor_peak_bytes" in s:
                line += f"; rank 0 tensors at peak {s['tensor_peak_bytes'] / 2**20:.1f} MiB"
            if "programs" in s:
                line += f"; programs {s['programs']}"
            if s.get("held"):
                line += f"; held {s['held']}"
            print(line, flush=True)
            if a.per_step:
                top = next(r for r in records if r["rank"] == s["peak_rank"])
                print("    RSS after each step (GiB): "
                      + " ".join(_gib(x["rss_kib"]) for x in top["steps"]), flush=True)
                if "jax_live" in top["steps"][0]:
                    print("    JAX arrays alive after each step (count/MiB): " + " ".join(
                        f"{n}/{b / 2**20:.1f}" for n, b in (x["jax_live"] for x in top["steps"])),
                        flush=True)
                if "census" in top["steps"][0]:
                    print("    MiB after each step: tensors/malloc in use/mmapped/free: " + " ".join(
                        "{tensors}/{in_use}/{mmapped}/{free}".format(**x["census"])
                        for x in top["steps"]), flush=True)
                if "tensor_peak_kinds" in s:
                    print(f"    rank 0 tensors at peak by kind: {s['tensor_peak_kinds']}",
                          flush=True)
    base = a.backends[-1]
    for backend in a.backends[:-1]:
        pairs = [(x, y) for x, y in zip(results[backend], results[base])
                 if "failed" not in x and "failed" not in y]
        if not pairs:
            continue
        peaks = [x["peak_kib"] / y["peak_kib"] for x, y in pairs]
        text = ", ".join(f"{r:.3f}" for r in peaks)
        print(f"peak RSS {backend}/{base}: {text}", flush=True)
        # What the steps add, without what the process held before its first forward (on
        # "tpu" JAX's runtime, about 0.12 GiB more than gloo's process).
        grown = [(x["peak_kib"] - x["before_kib"]) / (y["peak_kib"] - y["before_kib"])
                 for x, y in pairs]
        print(f"peak RSS above the first forward {backend}/{base}: "
              + ", ".join(f"{r:.3f}" for r in grown), flush=True)
        tens = [x["tensor_peak_bytes"] / y["tensor_peak_bytes"] for x, y in pairs
                if "tensor_peak_bytes" in x and "tensor_peak_bytes" in y]
        if tens:
            print(f"peak tensor bytes {backend}/{base}: "
                  + ", ".join(f"{r:.3f}" for r in tens), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": example_args, "nproc": a.nproc, "results": results}, f)


if __name__ == "__main__":
    main()
