"""Compile-only runs at pod scale: TorchTitan's configs unchanged, the example's presets (issue 50).

Each case is one ``tpu-launch --emulate TOPOLOGY --compile-only`` run in a child process under
``prlimit --as`` (8 GiB by default: the machine is shared), timed with ``/usr/bin/time``
(wall, CPU seconds, peak RSS), its report read back: programs compiled and failed (each named
with the script line that issued it), the step's estimate (FLOPs, bound, MFU bound, tokens/s,
HBM per device), and when the script stopped with an error, its last line.

Cases (``run NAME ...``; ``list`` prints them):

* ``titan-<config>@<topology>``: ``python -m torchtitan.train --module M --config C`` of
  TorchTitan 0.3.0, unchanged, on the emulated TorchTPU device, with a local tokenizer and
  dataset (``benchmarks/torchtitan_assets.py``), one step, and the flags TorchTitan 0.3.0 needs
  on torch 2.13 on any backend (``--parallelism.spmd-backend partial_dtensor``; with expert
  parallelism ``--training.disable-cuda-graphs``); tensor parallelism 8 for the Llama configs
  (TorchTitan's 70B and 405B configs set it; its 8B one does not: 8 here, the issue's layout),
  expert parallelism 8 for Qwen3-30B-A3B. Needs TorchTitan (``--python`` of a venv that has it).
* ``example-<preset>@<topology>``: ``examples/train_fsdp_tp.py --model PRESET --tp 8
  --seq-len 8192 --seqs-per-dp-rank 1 --mixed-precision bf16 --activation-checkpointing
  --steps 2`` (the README's command; ``--tp 4`` for Qwen3-30B-A3B, whose 4 key/value heads
  do not split over 8).

``sweep`` runs one layout at 256, 512, 1,024, 2,048, 4,096 and 8,192 TPU7x chips with the same
work per chip (weak scaling: TorchTitan's Llama 3 8B layout, FSDP x TP 8, one 8,192-token
sequence per data-parallel rank), ``table FILE`` prints a JSON-lines file as a Markdown table,
``plot FILE PNG`` draws a sweep's estimated tokens/s per chip against chips (matplotlib).

    python benchmarks/torchtitan_scale.py run titan-llama3_8b@tpu7x:8x16x16 --out runs.jsonl \\
        --python /work/venvs/titan/bin/python
    python benchmarks/torchtitan_scale.py sweep example-llama3-8b --out sweep.jsonl
    python benchmarks/torchtitan_scale.py plot sweep.jsonl benchmarks/weak_scaling.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

TITAN = {
    # config -> (module, flags beyond the common ones)
    "llama3_8b": ("llama3", ["--parallelism.tensor-parallel-degree", "8"]),
    "llama3_70b": ("llama3", []),
    "llama3_405b": ("llama3", []),
    "qwen3_32b": ("qwen3", []),
    "qwen3_30b_a3b": ("qwen3", ["--parallelism.expert-parallel-degree", "8",
                                "--training.disable-cuda-graphs"]),
}
EXAMPLE_ARGS = ["--seq-len", "8192", "--seqs-per-dp-rank", "1", "--mixed-precision", "bf16",
                "--activation-checkpointing", "--steps", "2"]
EXAMPLE_TP = {"qwen3-30b-a3b": 4}
"""--tp of a preset (default 8): Qwen3-30B-A3B has 4 key/value heads (and its 128 experts go
32 to each of the 4 tp ranks)."""
SWEEP = ["tpu7x:4x8x8", "tpu7x:8x8x8", "tpu7x:8x8x16", "tpu7x:8x16x16", "tpu7x:16x16x16",
         "tpu7x:16x16x32"]
"""256 to 8,192 TPU7x chips (512 to 16,384 devices)."""


def _command(case: str, python: str, assets: str, report: str) -> list[str]:
    kind, _, rest = case.partition("-")
    target, _, topology = rest.partition("@")
    launch = [python, "-m", "_tpu_dist_launch", "--emulate", topology, "--compile-only",
              "--compile-report", report]
    if kind == "titan":
        module, extra = TITAN[target]
        from torchtitan_assets import write_assets

        tokenizer, data = write_assets(assets)
        return [*launch, "-m", "torchtitan.train", "--module", module, "--config", target,
                "--hf-assets-path", tokenizer, "--dataloader.dataset", "c4_test",
                "--dataloader.dataset-path", data, "--training.steps", "1",
                "--parallelism.spmd-backend", "partial_dtensor",
                "--metrics.no-enable-tensorboard", "--profiler.no-enable-profiling", *extra]
    if kind == "example":
        return [*launch, os.path.join(ROOT, "examples", "train_fsdp_tp.py"), "--model", target,
                "--tp", str(EXAMPLE_TP.get(target, 8)), *EXAMPLE_ARGS]
    raise SystemExit(f"unknown case {case!r}: titan-<config>@<topology> or "
                     "example-<preset>@<topology>")


def run_case(case: str, python: str, memory_gib: float, timeout: float) -> dict:
    """One case in a child under prlimit, timed; its report summarised."""
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        report, times = os.path.join(tmp, "report.json"), os.path.join(tmp, "time.txt")
        cmd = _command(case, python, os.path.join(tmp, "assets"), report)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        wrapped = ["/usr/bin/time", "-o", times, "-f", "%e %U %S %M",
                   "prlimit", f"--as={int(memory_gib * 2**30)}", *cmd]
        started = time.time()
        try:
            proc = subprocess.run(wrapped, cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            code, out = None, f"timed out after {timeout:g} s\n{err.stdout or ''}{err.stderr or ''}"
        wall, user, system, rss = (open(times).read().split()[-4:] if os.path.exists(times)
                                   else (time.time() - started, 0, 0, 0))
        row = {"case": case, "exit": code, "wall_s": float(wall),
               "cpu_s": round(float(user) + float(system), 1),
               "peak_rss_gib": round(int(rss) / 2**20, 2), "error": _last_error(out)}
        if os.path.exists(report):
            row |= _summary(json.load(open(report)))
        return row


def _last_error(out: str) -> str | None:
    """The script's exception (the last ``SomethingError: ...`` line), if it stopped."""
    lines = [line for line in out.splitlines()
             if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line)]
    if not lines:  # a SystemExit's message: the line before the run's summary
        before = out.split("tpu-launch --compile-only: ran with")[0].strip().splitlines()
        lines = [line for line in before[-1:] if "tpu-launch" not in line]
    return lines[-1][:300] if lines else None


def _summary(report: dict) -> dict:
    rows = report["collectives"]
    failed = [f"{r['op']} over {r['group_size']}: {(r['error'] or '')[:120]}" for r in rows
              if not r["compiled"]]
    out = {"devices": report["num_devices"], "programs": len({
        (r["program"], r["group_size"], r["bytes_per_rank"], r["dtype"]) for r in rows}),
        "collectives": len(rows), "failed": failed, "script_s": report["script_seconds"],
        "compile_s": report["compile_seconds"], "step_error": report.get("step_error"),
        "assumptions": report.get("assumptions", [])}
    step = report.get("step")
    if step:
        out |= {k: step[k] for k in (
            "flops_per_device", "model_flops_per_device", "compute_seconds",
            "exposed_comm_seconds", "step_seconds", "mfu_bound", "tokens_per_device",
            "tokens_per_second_per_device", "hbm_peak_bytes", "hbm_capacity_bytes",
            "steps_run")}
        out["hbm_verdict"] = step["hbm_verdict"]
    return out


def _table(rows: list[dict]) -> str:
    head = ("case", "exit", "wall s", "CPU s", "RSS GiB", "programs (failed)", "step >=",
            "MFU <=", "tokens/s/device", "HBM/device", "stopped at")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        step = r.get("step_seconds")
        lines.append("| " + " | ".join(str(v) for v in (
            r["case"], r["exit"], round(r["wall_s"]), r["cpu_s"], r["peak_rss_gib"],
            f"{r.get('programs', '-')} ({len(r.get('failed', []))})",
            f"{step * 1e3:.0f} ms" if step else "-",
            f"{100 * r['mfu_bound']:.1f} %" if step else "-",
            f"{r['tokens_per_second_per_device']:,.0f}" if step else "-",
            f"{r['hbm_peak_bytes'] / 2**30:.1f} GiB" if r.get("hbm_peak_bytes") else "-",
            (r["error"] or "")[:90].replace("|", "/"))) + " |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("tokens_per_second_per_device")]
    chips = [r["devices"] // 2 for r in done]  # TPU7x: two devices a chip
    per_chip = [2 * r["tokens_per_second_per_device"] for r in done]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(chips, per_chip, "o-", label="estimated (step lower bound)")
    if per_chip:
        ax.axhline(per_chip[0], color="grey", linestyle=":", label=f"linear from {chips[0]} chips")
    ax.set_xscale("log", base=2)
    ax.set_xticks(chips, [f"{c:,}" for c in chips])
    ax.set_ylim(0, max(per_chip) * 1.15 if per_chip else 1)
    ax.set_xlabel("TPU7x chips")
    ax.set_ylabel("tokens/s per chip (upper bound)")
    ax.set_title(title or f"Weak scaling, {done[0]['case'].split('@')[0] if done else ''}: "
                 "tpu-launch --compile-only estimates", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run")
    run.add_argument("cases", nargs="+")
    sweep = sub.add_parser("sweep")
    sweep.add_argument("layout", help="titan-<config> or example-<preset>")
    for p in (run, sweep):
        p.add_argument("--out", required=True, help="JSON lines, appended")
        p.add_argument("--python", default=sys.executable)
        p.add_argument("--memory-gib", type=float, default=8.0)
        p.add_argument("--timeout", type=float, default=1800.0)
    sub.add_parser("list")
    table = sub.add_parser("table")
    table.add_argument("file")
    plot = sub.add_parser("plot")
    plot.add_argument("file")
    plot.add_argument("png")
    plot.add_argument("--title", default=None)
    args = parser.parse_args()
    if args.what == "list":
        print("\n".join([*(f"titan-{c}@TOPOLOGY" for c in TITAN),
                         "example-<preset>@TOPOLOGY (examples/train_fsdp_tp.py --model)"]))
        return
    if args.what in ("table", "plot"):
        rows = [json.loads(line) for line in open(args.file) if line.strip()]
        if args.what == "table":
            print(_table(rows))
        else:
            _plot(rows, args.png, args.title)
        return
    cases = args.cases if args.what == "run" else [f"{args.layout}@{t}" for t in SWEEP]
    for case in cases:
        row = run_case(case, args.python, args.memory_gib, args.timeout)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(_table([row]).splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
