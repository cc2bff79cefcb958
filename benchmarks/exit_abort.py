"""How often a finished 2-rank gloo run of examples/train_fsdp.py aborts at exit, under load.

The abort (issue 16 item 9): ``terminate called without an active exception``, SIGABRT, after
``destroy_process_group()`` returned and the last line was printed. Backtrace of the aborting
thread (cores of torch 2.13.0+cpu, Python 3.11.7): ``ProcessGroupGloo::runLoop`` destroys the
Work of the last collective it ran (``AsyncBroadcastWork`` of DCP's ``broadcast_object`` when the
run saves, ``AsyncAllreduceWork`` of the loss's ``all_reduce`` when it does not) -> the input
tensors' ``TensorImpl::decref_pyobject`` -> ``PyInterpreter decref`` -> ``gil_scoped_acquire``
-> ``take_gil`` -> ``PyThread_exit_thread`` (the main thread is in ``Py_FinalizeEx``) ->
``pthread_exit``'s forced unwind through the ``noexcept`` destructor -> ``std::terminate``.

Each launch is ``torchrun --standalone --nproc-per-node 2 EXAMPLE --backend gloo --steps 2``
plus the variant's flags; ``--load K`` starts K busy loops for the duration (they are stopped at
the end). With ``--compare OTHER_EXAMPLE`` the launches alternate between the two files (A/B in
the same conditions). Usage::

    python benchmarks/exit_abort.py --runs 30 --load 2 --variant resume \\
        --compare /path/to/main/examples/train_fsdp.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(example: str, variant: str, work: Path, seed_ckpt: Path) -> tuple[bool, int]:
    """One launch; (aborted at exit, return code)."""
    args = []
    if variant == "resume":  # as the 4th launch of test_train_fsdp_checkpoint_and_resume
        shutil.copytree(seed_ckpt, work / "ck")
        args = ["--checkpoint-dir", str(work / "ck")]
    elif variant == "save":
        args = ["--checkpoint-dir", str(work / "ck"), "--save-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", example,
         "--backend", "gloo", "--steps", "2", *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=work,
    )
    aborted = "terminate called without an active exception" in proc.stderr
    if proc.returncode != 0 and not aborted:
        print(proc.stderr[-3000:], file=sys.stderr)
    return aborted, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="launches per example")
    parser.add_argument("--load", type=int, default=2, help="busy loops to run meanwhile (at most 3)")
    parser.add_argument("--variant", choices=("resume", "save", "none"), default="resume")
    parser.add_argument("--example", default=str(ROOT / "examples" / "train_fsdp.py"))
    parser.add_argument("--compare", default=None, help="another train_fsdp.py, launched alternately")
    args = parser.parse_args()
    examples = [args.example] + ([args.compare] if args.compare else [])
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(min(args.load, 3))]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            seed = Path(tmp) / "seed"
            if args.variant == "resume":  # a directory holding step-2 and step-4
                subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     args.example, "--backend", "gloo", "--steps", "4", "--save-every", "2",
                     "--checkpoint-dir", str(seed)],
                    check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            counts = {ex: [0, 0] for ex in examples}  # aborted, other failures
            for i in range(args.runs):
                for ex in examples:
                    work = Path(tmp) / f"run{i}-{examples.index(ex)}"
                    work.mkdir()
                    aborted, code = launch(ex, args.variant, work, seed)
                    counts[ex][0] += aborted
                    counts[ex][1] += code != 0 and not aborted
                    shutil.rmtree(work)
            for ex, (aborted, other) in counts.items():
                print(f"{ex}: aborted at exit {aborted}/{args.runs}, other failures {other} "
                      f"(variant {args.variant}, {len(busy)} busy loops)", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
