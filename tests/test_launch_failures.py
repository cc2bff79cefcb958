"""tpu-launch when things go wrong on one host: a failing worker, SIGTERM, a killed launcher.

Workers here never import torch (``tests/launch_worker.py`` modes ``fail`` and ``sleep``), so the
launcher's own startup dominates each test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from tests.launch_worker import WORKER, finish, pid_alive, run_launcher, start_launcher


def _pids(pid_dir: str) -> dict[int, int]:
    return {
        int(name.split(".")[0]): int(open(os.path.join(pid_dir, name)).read())
        for name in os.listdir(pid_dir)
        if name.endswith(".pid")
    }


def _wait_for_pids(
    pid_dir: str, count: int, proc: subprocess.Popen, timeout: float = 60.0
) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _pids(pid_dir)
        if len(pids) == count:
            return pids
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"launcher exited early ({proc.returncode}):\n{out}\n{err}")
        time.sleep(0.2)
    raise AssertionError(f"workers did not start within {timeout}s")


def _wait_dead(pids: Iterable[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def test_failing_worker_stops_the_group_and_reports_rank_code_traceback(tmp_path: Path) -> None:
    code, out, err = run_launcher(
        [
            "--nproc-per-node",
            "2",
            WORKER,
            "fail",
            "--raise",
            "--delay",
            "0.5",
            "--pid-dir",
            str(tmp_path),
        ]
    )
    assert code == 1, err
    assert "tpu-launch: worker failed: node 0: rank 1 (local rank 1, pid" in err
    assert "exited with code 1" in err
    # Short, root cause first: the script and rank, then the end of its traceback, which comes
    # from the error file tpu-launch's worker entry wrote (no @record needed).
    report = err[err.index("tpu-launch: worker failed"):].splitlines()
    assert report[1].startswith(f"Root Cause (first observed failure): {WORKER} on rank 1 (host ")
    assert report[-3] == "  RuntimeError: deliberate failure on rank 1", report
    assert report[-2] == "Other ranks: rank 0: killed by SIGTERM (stopped by the launcher)", report
    assert "rank 1's error file: " in report[-1] and len(report) <= 11, report
    assert "Failures:" not in err and "Sending process" not in err  # torchrun's table: --verbose
    assert "[rank1]:RuntimeError: deliberate failure on rank 1" in err  # the worker's own stderr
    assert "for the workers" not in err  # the variables set for the workers: --verbose
    pids = _pids(str(tmp_path))
    assert sorted(pids) == [0, 1]
    assert _wait_dead(pids.values(), timeout=5) == []  # rank 0 (sleeping 120 s) was stopped


def test_verbose_adds_torchruns_table_and_the_variables_set(tmp_path: Path) -> None:
    code, _, err = run_launcher(
        ["--verbose", "--nproc-per-node", "2", WORKER, "fail", "--exit-code", "3", "--pid-dir", str(tmp_path)]
    )
    assert code == 1
    assert "tpu-launch: setting OMP_NUM_THREADS=1 for the workers" in err
    assert "launch_worker.py FAILED" in err, err  # torchrun's table names the user's script
    assert "Root Cause (first observed failure):\n[0]:" in err, err
    assert f"Root Cause (first observed failure): {WORKER} on rank 1" in err  # then tpu-launch's
    # No traceback to show: the worker called sys.exit(3).
    assert "(no Python traceback: it exited without an uncaught Python exception" in err
    assert "exited with code 3" in err


def test_exit_code_is_reported(tmp_path: Path) -> None:
    code, _, err = run_launcher(
        ["--nproc-per-node", "2", WORKER, "fail", "--exit-code", "7", "--pid-dir", str(tmp_path)]
    )
    assert code == 1
    assert "rank 1 (local rank 1" in err and "exited with code 7" in err
    assert _wait_dead(_pids(str(tmp_path)).values(), timeout=5) == []


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path: Path) -> None:
    proc = start_launcher(["--nproc-per-node", "2", WORKER, "sleep", "--pid-dir", str(tmp_path)])
    try:
        pids = _wait_for_pids(str(tmp_path), 2, proc)
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM, err
    assert "tpu-launch: got SIGTERM; stopped node 0's workers" in err
    assert _wait_dead(pids.values()) == []


def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    proc = start_launcher(["--nproc-per-node", "2", WORKER, "sleep", "--pid-dir", str(tmp_path)])
    try:
        pids = _wait_for_pids(str(tmp_path), 2, proc)
        proc.kill()  # SIGKILL: elastic gets no chance to clean up
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _wait_dead(pids.values(), timeout=10) == []  # PR_SET_PDEATHSIG did it


def test_failure_report_is_short_for_many_ranks(tmp_path: Path) -> None:
    """16 ranks, one aborted (no traceback), 15 stopped: the report stays a few lines."""
    import signal as sig

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from tpu_dist.launch import parse_args, resolve
    from tpu_dist.launch._discovery import Discovery
    from tpu_dist.launch._run import format_failure

    spec = resolve(parse_args(["--nproc-per-node", "16", "train.py"], {}), Discovery(on_tpu=False), {})
    missing = str(tmp_path / "none.json")
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=-sig.SIGTERM, error_file=missing)
                for r in range(16) if r != 10}
    failures[10] = ProcessFailure(local_rank=10, pid=110, exitcode=-sig.SIGABRT, error_file=missing)
    failures[10].timestamp = 0  # the first observed failure
    report = format_failure(spec, ChildFailedError("train.py", failures)).splitlines()
    assert report[0] == "tpu-launch: worker failed: node 0: rank 10 (local rank 10, pid 110) was killed by SIGABRT"
    assert report[2] == "  (no Python traceback: it was killed by a signal; its last [rank10]: lines above say more)"
    assert report[3] == "Other ranks: ranks 0-9, 11-15: killed by SIGTERM (stopped by the launcher)"
    assert len(report) == 5, report
