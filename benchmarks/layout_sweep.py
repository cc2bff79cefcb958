"""The best layout of a model on a topology, from compile-only runs (issue 53, item 3).

For one preset of ``examples/train_fsdp_tp.py`` and one topology, tries every layout of the
grid: tensor-parallel degree (``--tp``, FSDP over the rest), sequences per data-parallel rank
and activation checkpointing on or off. Each layout is one ``tpu-launch --compile-only`` run
(fake tensors, nothing allocated at real size; 2 steps, the report describes the second),
behind ``prlimit --as`` (a runaway cannot take the shared machine's memory), one after the
other. From each report's ``"step"`` object it keeps whether the step fits HBM
(``hbm_fits``: MemTracker's peak tensor bytes plus the largest program scratch against the
generation's HBM) and the predicted step (decision 0034); it drops the layouts that do not fit
or do not run (a ``--tp`` that does not divide the heads, a script error) and ranks the rest by
``predicted_tokens_per_second_per_device``.

Two things keep it to minutes. The runs of each tp go in a chain, ``--jobs`` chains at once
(default 2: one a core). And a layout that needs more memory than one that does not fit is not
run (``--no-prune`` runs it): within one tp, more sequences per dp rank hold more activations,
and checkpointing off holds more than on, so each chain runs fewest sequences first,
checkpointing on before off, and skips what such a miss rules out. On the guide's 16-layout
example that skips 5 runs: 11 runs, 7 minutes on the 2-core machine shared with other jobs.

The prediction is a model (``docs/guides/compile-only.md``, "The step"): within about 20 % of
published MaxText steps, and its memory term counts what this PyTorch script moves, fused by a
stated rule. Rank layouts with it; do not quote its tokens/s as a measurement.

    python benchmarks/layout_sweep.py --preset llama3-8b --topology v6e:2x4
    python benchmarks/layout_sweep.py --preset llama3-70b --topology v6e:8x8 --tp 4 8 --seqs 1 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp_tp.py")


def run_layout(preset: str, topology: str, slices: int, seq_len: int, tp: int, seqs: int,
               checkpointing: bool, limit_gib: float, timeout: float) -> dict:
    """One compile-only run of the example in this layout; its report's step, or why not."""
    row = {"tp": tp, "seqs_per_dp_rank": seqs, "checkpointing": checkpointing}
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        cmd = ["prlimit", f"--as={int(limit_gib * 2**30)}", sys.executable, "-m",
               "tpu_dist.launch", "--emulate", topology, "--num-slices", str(slices),
               "--compile-only", "--compile-report", report_path, EXAMPLE,
               "--model", preset, "--tp", str(tp), "--seq-len", str(seq_len),
               "--seqs-per-dp-rank", str(seqs), "--mixed-precision", "bf16", "--steps", "2"]
        if checkpointing:
            cmd.append("--activation-checkpointing")
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout,
                                  env=dict(os.environ, PYTHONPATH=ROOT))
        except subprocess.TimeoutExpired:
            return row | {"error": f"no report after {timeout:.0f} s"}
        row["wall_seconds"] = round(time.monotonic() - started, 1)
        step = None
        if os.path.exists(report_path):
            with open(report_path) as f:
                step = json.load(f).get("step")
    if step is None or step.get("predicted_seconds") is None:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return row | {"error": f"exit {proc.returncode}: " + (lines[-1] if lines else "no step")}
    return row | {key: step[key] for key in (
        "hbm_fits", "hbm_verdict", "predicted_tokens_per_second_per_device", "predicted_seconds",
        "predicted_mfu", "step_seconds", "predicted_memory_seconds",
        "predicted_exposed_comm_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b",
                        help="the example's --model (default llama3-8b)")
    parser.add_argument("--topology", default="v6e:2x4", help="what --emulate takes")
    parser.add_argument("--num-slices", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 4],
                        help="sequences per data-parallel rank to try (default 1 2 4)")
    parser.add_argument("--checkpointing", choices=("both", "on", "off"), default="both",
                        help="activation checkpointing: try both (default), or only on/off")
    parser.add_argument("--limit-gib", type=float, default=8.0,
                        help="address-space limit of each run (prlimit --as), GiB (default 8)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one run may take (default 900)")
    parser.add_argument("--out", default=None, help="append one JSON line per layout here")
    parser.add_argument("--jobs", type=int, default=2,
                        help="tp chains run at once (default 2, one a core)")
    parser.add_argument("--no-prune", action="store_true",
                        help="run every layout, also those a smaller layout's miss rules out")
    args = parser.parse_args()
    checkpointing = {"both": (True, False), "on": (True,), "off": (False,)}[args.checkpointing]
    started = time.monotonic()

    def chain(tp: int) -> list[dict]:
        """The layouts of one tp, fewest sequences first and checkpointing on before off,
        skipping those that need more memory than a layout that did not fit."""
        rows, missed = [], []  # missed: (seqs, checkpointing) that ran and did not fit
        for seqs in sorted(args.seqs):
            for ckpt in checkpointing:
                # A miss at (s, c) rules out every (s' >= s, c') with c' holding at least as
                # much: checkpointing off holds more than on.
                smaller = next(((s, c) for s, c in missed if s <= seqs and (c or not ckpt)), None)
                if smaller and not args.no_prune:
                    row = {"tp": tp, "seqs_per_dp_rank": seqs, "checkpointing": ckpt,
                           "skipped": f"not run: tp {tp}, {smaller[0]} seq(s)/dp rank, "
                                      f"checkpointing {'on' if smaller[1] else 'off'} needs "
                                      "less and does not fit"}
                else:
                    row = run_layout(args.preset, args.topology, args.num_slices, args.seq_len,
                                     tp, seqs, ckpt, args.limit_gib, args.timeout)
                    if row.get("hbm_fits") is False:
                        missed.append((seqs, ckpt))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({"preset": args.preset, "topology": args.topology,
                                            "slices": args.num_slices,
                                            "seq_len": args.seq_len} | row) + "\n")
        return rows

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = [row for rows in pool.map(chain, args.tp) for row in rows]
    ran = sum("skipped" not in r for r in rows)
    fits = sorted((r for r in rows if r.get("hbm_fits")),
                  key=lambda r: -r["predicted_tokens_per_second_per_device"])
    print(f"{args.preset} on {args.topology}" + (f" x {args.num_slices}" if args.num_slices > 1
                                                 else "") + f", sequence {args.seq_len}: "
          f"{len(fits)} of {len(rows)} layouts fit HBM, best first (predicted, a model); "
          f"{ran} run, {args.jobs} at a time, in {time.monotonic() - started:.0f} s")
    print("| rank | tp | seqs/dp rank | checkpointing | tokens/s/device | step s | MFU | "
          "memory-bound s | exposed comm s | HBM |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(fits, 1):
        print(f"| {i} | {r['tp']} | {r['seqs_per_dp_rank']} | "
              f"{'on' if r['checkpointing'] else 'off'} | "
              f"{r['predicted_tokens_per_second_per_device']:,.0f} | "
              f"{r['predicted_seconds']:.2f} | {100 * r['predicted_mfu']:.1f}% | "
              f"{r['predicted_memory_seconds']:.2f} | "
              f"{r['predicted_exposed_comm_seconds']:.3f} | {r['hbm_verdict']} |")
    for r in rows:
        if not r.get("hbm_fits"):
            why = r.get("error") or r.get("skipped") or r.get("hbm_verdict")
            print(f"dropped: tp {r['tp']}, {r['seqs_per_dp_rank']} seq(s)/dp rank, "
                  f"checkpointing {'on' if r['checkpointing'] else 'off'}: {why}")


if __name__ == "__main__":
    main()
