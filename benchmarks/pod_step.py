"""Real model shapes at pod scale from this machine: ``--compile-only`` of the example's presets.

Each case runs ``examples/train_fsdp_tp.py --model PRESET`` (2 steps, sequence 8192, bf16
mixed precision, activation checkpointing, fake tensors) under ``tpu-launch --compile-only``
behind ``prlimit --as`` (a runaway cannot take the shared machine's memory), and prints, per
case: wall time, CPU time, peak RSS (the launcher's children: the compile-only process and its
compiler), whether every program compiled, and the report's ``"step"`` object next to

* the analytic FLOP count (:func:`tpu_dist.compile_job.flops_per_token`, TorchTitan's ``6N +
  12 L H d_h s``) of the same tokens: counted / analytic, and
* for the MaxText shapes (AI-Hypercomputer/tpu-recipes, training/ironwood: pure FSDP, sequences per
  device, measured step and MFU; docs/decisions/0025-step-time-model.md), the bound over the
  measured step and the model-FLOP MFU the bound allows.

Reported, not asserted. One JSON line per case goes to ``--out`` as well, and ``--keep DIR`` keeps
each run's report, picture and output. Measured:
docs/decisions/0027-lazy-fsdp2-chunks-in-compile-only.md.

    python benchmarks/pod_step.py --cases 8b-pod 70b-pod
    python benchmarks/pod_step.py --cases 70b-maxtext --keep runs/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp_tp.py")

from tpu_dist.compile_job import flops_per_token  # noqa: E402
from tpu_dist.compile_job._estimate import (  # noqa: E402
    LLAMA3_1_70B,
    LLAMA3_1_405B,
    LLAMA3_8B,
    QWEN3_32B,
)
from tpu_dist.mesh import Topology  # noqa: E402

SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_1_70B, "llama3-405b": LLAMA3_1_405B,
          "qwen3-32b": QWEN3_32B}

# name -> (preset, topology, tp, sequences per dp rank, MaxText's (s/step, MFU) or None)
CASES = {
    "8b-pod": ("llama3-8b", "tpu7x:16x16x32", 8, 1, None),
    "70b-pod": ("llama3-70b", "tpu7x:16x16x32", 8, 1, None),
    "405b-pod": ("llama3-405b", "tpu7x:16x16x32", 8, 1, None),
    "405b-pod-tp2": ("llama3-405b", "tpu7x:16x16x32", 2, 1, None),
    # MaxText's recipes: pure FSDP (tp 1), sequences per device.
    "70b-maxtext": ("llama3-70b", "tpu7x:4x8x8", 1, 2, (12.27, 0.520)),
    "405b-maxtext": ("llama3-405b", "tpu7x:4x8x8", 1, 3, (98.34, 0.547)),
    # How the run grows with the world: the 8B layout at 512 and 4,096 devices (and 8b-pod).
    "8b-512": ("llama3-8b", "tpu7x:4x8x8", 8, 1, None),
    "8b-4096": ("llama3-8b", "tpu7x:8x16x16", 8, 1, None),
    # Small, for a quick look at the pipeline.
    "8b-small": ("llama3-8b", "tpu7x:2x2x1", 2, 1, None),
    "qwen3-32b-small": ("qwen3-32b", "tpu7x:2x2x1", 2, 1, None),
    # Two v5p slices of 512 chips (1,024 devices): tp 8 inside a slice, dp 128 across both
    # (its groups cross the DCN).
    "70b-v5p-2slices": ("llama3-70b", "v5p:8x8x8", 8, 1, None),
    # Issue 22's generations, whose collectives run as family programs over the whole slice:
    # a full v5e / v6e pod (256 chips), tp 8 x dp 32.
    "8b-v5e": ("llama3-8b", "v5e:16x16", 8, 1, None),
    "8b-v6e": ("llama3-8b", "v6e:16x16", 8, 1, None),
}
SLICES = {"70b-v5p-2slices": 2}
"""Cases on more than one slice: name -> slices (``--num-slices``)."""
SEQ = 8192


def run(name: str, limit_gib: float, steps: int = 2, keep: str | None = None) -> dict:
    preset, topology, tp, seqs, published = CASES[name]
    slices = SLICES.get(name, 1)
    devices = Topology.parse(topology).num_devices * slices
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        cmd = ["prlimit", f"--as={int(limit_gib * 2**30)}", sys.executable, "-m",
               "tpu_dist.launch", "--emulate", topology, "--num-slices", str(slices),
               "--compile-only", "--compile-report",
               report_path, EXAMPLE, "--model", preset, "--tp", str(tp), "--seq-len", str(SEQ),
               "--seqs-per-dp-rank", str(seqs), "--mixed-precision", "bf16",
               "--activation-checkpointing", "--steps", str(steps)]
        started = time.monotonic()
        with open(os.path.join(tmp, "out"), "w") as fo, open(os.path.join(tmp, "err"), "w") as fe:
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, cwd=tmp,
                                    env=dict(os.environ, PYTHONPATH=ROOT))
            _, status, usage = os.wait4(proc.pid, 0)  # this run's rusage (its children too)
        wall = time.monotonic() - started
        out, err = open(os.path.join(tmp, "out")).read(), open(os.path.join(tmp, "err")).read()
        code = os.waitstatus_to_exitcode(status)
        report = json.load(open(report_path)) if os.path.exists(report_path) else None
        svg = os.path.join(tmp, "report.step.svg")
        picture = open(svg).read() if os.path.exists(svg) else None
        if keep:  # the run's files, before the directory goes
            os.makedirs(keep, exist_ok=True)
            for kept in ("report.json", "report.step.svg", "out", "err"):
                if os.path.exists(os.path.join(tmp, kept)):
                    shutil.copy(os.path.join(tmp, kept), os.path.join(keep, f"{name}.{kept}"))
    row: dict = {
        "case": name, "preset": preset, "topology": topology, "slices": slices,
        "devices": devices, "tp": tp,
        "seqs_per_dp_rank": seqs, "steps": steps, "exit": code, "wall_seconds": round(wall, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mib": usage.ru_maxrss // 1024,
        "load_average_1m": round(os.getloadavg()[0], 1),
    }
    if report is None:
        row["error"] = (err or out)[-3000:]
        return row
    describe(row, report, out)
    row["svg_bytes"] = len(picture) if picture else 0
    return row


def describe(row: dict, report: dict, out: str) -> None:
    """Add to ``row`` (a case's name, preset, topology, devices, tp, sequences) what the
    report and the script's output say (docstring)."""
    name, preset, devices, tp = row["case"], row["preset"], row["devices"], row["tp"]
    seqs, published = row["seqs_per_dp_rank"], CASES[name][4]
    rows = report["collectives"]
    row.update(
        script_seconds=report["script_seconds"], compile_seconds=report["compile_seconds"],
        programs=len(rows), failed=[(c["op"], c["group_size"], c["error"][:120])
                                    for c in rows if not c["compiled"]],
        table_tail=out.strip().splitlines()[-16:],
        script_lines=[line for line in out.splitlines()
                      if line.startswith(("FSDP2 x TP", "step ", "final loss"))
                      and not line.startswith("step (")][:8],
    )
    # The script's time split: each step's wall time (the example prints tokens/s of the global
    # batch), the rest of the script (start, model, tensor parallelism, fully_shard) before.
    step_seconds = []
    for line in row["script_lines"]:
        parts = line.split("|")
        if len(parts) == 3 and parts[0].split()[1:2] and parts[0].split()[1].isdigit():
            rate = float(parts[2].split()[0])
            step_seconds.append(round(devices // tp * seqs * SEQ / rate, 1) if rate else None)
    row["script_step_seconds"] = step_seconds
    step = report.get("step")
    row["step"] = {k: v for k, v in (step or {}).items() if k != "rules"}
    if step and preset in SHAPES:
        dp = devices // tp
        tokens_per_device = seqs * SEQ / tp  # one dp rank's tokens over its tp ranks
        analytic = flops_per_token(SHAPES[preset], SEQ) * tokens_per_device
        maxtext = flops_per_token(SHAPES[preset], SEQ, "maxtext") * tokens_per_device
        # The count includes the recomputation of activation checkpointing: each block's
        # forward runs again in the backward, up to the last op whose saved output the backward
        # needs (torch's non-reentrant checkpoint stops early: the MLP's down projection w2,
        # whose output nothing saves, is not recomputed); the output projection is outside the
        # blocks. And torch's attention backward recomputes the scores: forward 2, recompute 2,
        # backward 5 matmuls of s x s, 9 where TorchTitan's 12 L H d_h s counts 6.
        shape = SHAPES[preset]
        attention = 12 * shape.n_layers * shape.n_heads * shape.head_dim * SEQ
        recomputed = shape.n_layers * (shape.layer_params - shape.dim * shape.ffn_dim)
        with_remat = (6 * shape.non_embedding_params + 2 * recomputed
                      + attention * 18 / 12) * tokens_per_device
        row["flops"] = {
            "counted": step["flops_per_device"], "analytic_6N": analytic,
            "counted_over_analytic": step["flops_per_device"] / analytic,
            "analytic_with_remat": with_remat,
            "counted_over_analytic_with_remat": step["flops_per_device"] / with_remat,
            "dp": dp,
        }
        if published is not None:
            measured, mfu = published
            peak = step["peak_flops_per_s"]
            row["maxtext"] = {
                "measured_step_seconds": measured, "measured_mfu": mfu,
                "bound_over_measured": step["step_seconds"] / measured,
                "model_flop_mfu_bound": analytic / (step["step_seconds"] * peak),
                "model_flop_mfu_at_measured": analytic / (measured * peak),
                # MaxText's own count (causal attention halved), the one its MFU is of.
                "maxtext_flop_mfu_bound": maxtext / (step["step_seconds"] * peak),
                "maxtext_flop_mfu_at_measured": maxtext / (measured * peak),
                "maxtext_mfu_bound_over_measured_mfu":
                    maxtext / (step["step_seconds"] * peak) / mfu,
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["8b-pod", "70b-pod"], choices=sorted(CASES))
    parser.add_argument("--limit-gib", type=float, default=8.0,
                        help="address-space limit of the run (prlimit --as), GiB (default 8)")
    parser.add_argument("--steps", type=int, default=2,
                        help="steps the script runs (the report describes the last; default 2: "
                             "a steady state. 1 halves the time; its step creates the optimizer "
                             "state)")
    parser.add_argument("--out", default=None, help="append one JSON line per case here")
    parser.add_argument("--keep", default=None,
                        help="copy each run's report, picture and output into this directory")
    args = parser.parse_args()
    for name in args.cases:
        row = run(name, args.limit_gib, args.steps, args.keep)
        print(json.dumps(row, indent=1), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
