"""A dry run writes nothing the user owns and always ends honestly (issue 48, items 4, 5, 8).

Two ``tpu-launch --compile-only`` launches, at once:

* ``saves``: the script all-reduces, then tries ``torch.save`` onto an existing checkpoint and
  ``torch.distributed.checkpoint.save``, then ends the process with ``os._exit(0)``. Before: the
  checkpoint was truncated to a corrupt file, DCP left a partial ``.distcp`` file, and the run
  exited 0 with nothing compiled or reported. Now both saves raise ``SaveRefused`` having
  touched nothing, the all-reduce is compiled and reported, and libtpu's logs went to a folder
  of the run's own, removed after it (not the shared ``/tmp/tpu_logs``).
* ``killed``: the script kills itself with SIGKILL after an all-reduce. Before: the launcher
  (which ran the job itself) died with it, 137 and no word, and the forked libtpu compiler
  lived on. Now the launcher says what happened and exits 137, and the compiler is gone.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("libtpu", reason="compile-only mode compiles with libtpu (pip install libtpu)")

from tests.launch_worker import REPO, clean_env, pid_alive  # noqa: E402

_SCRIPT = '''
import json, os, signal, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tpu_dist.compile_job import SaveRefused
dist.init_process_group("tpu")
dist.all_reduce(torch.ones(1024))
where = sys.argv[2]
if sys.argv[1] == "saves":
    refused = []
    for save in (lambda: torch.save({"w": torch.ones(4)}, os.path.join(where, "ckpt.pt")),
                 lambda: dcp.save({"w": torch.ones(4)}, checkpoint_id=os.path.join(where, "dcp"))):
        try:
            save()
        except SaveRefused as err:
            refused.append(str(err))
    print("SAVES " + json.dumps({"refused": refused, "logs": os.environ.get("TPU_LOG_DIR")}),
          flush=True)
    os._exit(0)
compiler = [int(c) for t in os.listdir("/proc/self/task")
            for c in open(f"/proc/self/task/{t}/children").read().split()]
with open(os.path.join(where, "children.json"), "w") as f:
    json.dump(compiler, f)
os.kill(os.getpid(), signal.SIGKILL)
'''


def _launch(tmp: Path, case: str) -> tuple[int, str, dict | None]:
    """``tpu-launch --compile-only`` of the script in ``case`` mode, its folder ``tmp / case``:
    (exit code, output, JSON report or None)."""
    where = tmp / case
    report = where / "report.json"
    cmd = [sys.executable, "-m", "_tpu_dist_launch", "--emulate", "v5e:2x2", "--compile-only",
           "--compile-report", str(report), str(tmp / "job.py"), case, str(where)]
    env = clean_env()
    env.pop("TPU_LOG_DIR", None)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    data = json.loads(report.read_text()) if report.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, data


CHECKPOINT = b"the user's checkpoint" * 1000


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("compile_only_faults")
    (tmp / "job.py").write_text(_SCRIPT)
    for case in ("saves", "killed"):
        (tmp / case).mkdir()
    (tmp / "saves" / "ckpt.pt").write_bytes(CHECKPOINT)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(_launch, tmp, case) for case in ("saves", "killed")}
        return tmp, {case: f.result() for case, f in futures.items()}


def test_a_dry_run_refuses_checkpoint_saves_and_reports_after_os_exit(runs) -> None:
    tmp, results = runs
    code, out, report = results["saves"]
    assert code == 0, out  # the script's own code: it asked for 0, and the run finished
    line = next(line for line in out.splitlines() if line.startswith("SAVES "))
    saves = json.loads(line.removeprefix("SAVES "))
    assert len(saves["refused"]) == 2, saves
    assert "torch.save to" in saves["refused"][0] and "nothing was written" in saves["refused"][0]
    assert "torch.distributed.checkpoint.save" in saves["refused"][1], saves
    assert (tmp / "saves" / "ckpt.pt").read_bytes() == CHECKPOINT  # untouched
    assert not (tmp / "saves" / "dcp").exists()
    assert "refused 2 checkpoint save(s)" in out and "called os._exit(0)" in out, out
    # What it recorded before os._exit is compiled and reported.
    assert report is not None, out
    assert [(c["op"], c["compiled"]) for c in report["collectives"]] == [("all_reduce", True)]
    # libtpu's logs: a folder of the run's own, gone after a run that succeeded.
    logs = saves["logs"]
    assert logs and not logs.startswith("/tmp/tpu_logs") and not os.path.exists(logs), logs


def test_a_dry_run_killed_mid_way_says_so_and_leaves_no_compiler(runs) -> None:
    tmp, results = runs
    code, out, report = results["killed"]
    assert code == 128 + 9, out
    assert "the job was killed by SIGKILL before it finished" in out, out
    assert report is None
    children = json.loads((tmp / "killed" / "children.json").read_text())
    assert children, "the job had no compiler process to check"
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if pid_alive(pid)], children
