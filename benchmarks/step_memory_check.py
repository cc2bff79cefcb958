"""The compile-only memory estimate against a real run (issue 31's target: within 10 %).

Runs the FSDP2 x TP example with the same arguments twice:

* for real, on 4 CPU ranks (``tpu-launch --nproc-per-node 4``, the "tpu" backend, real tensors),
  each rank's run wrapped in :class:`tpu_dist.compile_job.StepMeter` (torch's MemTracker, the
  FLOP counter): rank 0 writes its last step's peak tensor bytes, FLOPs and tokens;
* under ``tpu-launch --emulate v5p:2x2x1 --compile-only`` (4 devices, fake tensors): rank 0's
  ``"step"`` object (``tensor_peak_bytes``: MemTracker's peak over fake tensors).

and prints both and their ratio, per kind of memory. Reported, not asserted (tests/
test_step_report.py asserts the 10 % on a smaller shape).

    python benchmarks/step_memory_check.py                       # the debug preset, sequence 512
    python benchmarks/step_memory_check.py -- --model debug --seq-len 1024 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp_tp.py")
DEFAULT_ARGS = ["--model", "debug", "--seq-len", "512", "--tp", "2", "--mixed-precision", "bf16",
                "--activation-checkpointing", "--steps", "2"]


def worker(out: str, example_args: list[str]) -> None:
    """One real rank: the example under a StepMeter; rank 0 writes its last step to ``out``."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_fsdp_tp

    from tpu_dist.compile_job import StepMeter

    rank = int(os.environ.get("RANK", "0"))
    with StepMeter() as meter:
        train_fsdp_tp.main(example_args)
    step = meter.chosen()
    if rank == 0 and step is not None:
        with open(out, "w") as f:
            json.dump({"peak_bytes": step.peak_bytes, "memory_bytes": step.peak_breakdown,
                       "flops": step.flops, "tokens": step.tokens, "index": step.index}, f)


def compare(example_args: list[str], timeout: float = 900, real_backend: str = "tpu") -> dict:
    """Run both (at once) and return ``{"real": ..., "fake": ..., "ratio": fake / real}``."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        real_out, report = os.path.join(tmp, "real.json"), os.path.join(tmp, "fake.json")
        real = subprocess.Popen(
            [sys.executable, "-m", "_tpu_dist_launch", "--nproc-per-node", "4",  # tpu-launch
             os.path.abspath(__file__), "--worker", real_out, "--", *example_args,
             "--backend", real_backend],
            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        fake = subprocess.Popen(
            [sys.executable, "-m", "tpu_dist.launch", "--emulate", "v5p:2x2x1", "--compile-only",
             "--compile-report", report, EXAMPLE, *example_args],
            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        real_log, _ = real.communicate(timeout=timeout)
        fake_log, _ = fake.communicate(timeout=timeout)
        if real.returncode or not os.path.exists(real_out):
            raise RuntimeError(f"the real run failed (exit {real.returncode}):\n{real_log[-3000:]}")
        if fake.returncode or not os.path.exists(report):
            raise RuntimeError(f"the compile-only run failed (exit {fake.returncode}):\n"
                               f"{fake_log[-3000:]}")
        real_step = json.load(open(real_out))
        step = json.load(open(report))["step"]
    fake_step = {"peak_bytes": step["tensor_peak_bytes"], "memory_bytes": step["memory_bytes"],
                 "flops": step["flops_per_device"], "tokens": step["tokens_per_device"],
                 "index": step["step_index"]}
    return {"args": example_args, "real": real_step, "fake": fake_step,
            "ratio": fake_step["peak_bytes"] / real_step["peak_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--real-backend", default="tpu",
                        help="the real run's c10d backend (default: tpu; gloo works too)")
    parser.add_argument("example_args", nargs="*", help="the example's arguments (after --)")
    args = parser.parse_args()
    example_args = args.example_args or DEFAULT_ARGS
    if args.worker:
        worker(args.worker, example_args)
        return
    print(json.dumps(compare(example_args, real_backend=args.real_backend), indent=1))


if __name__ == "__main__":
    main()
