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

import pytest

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
            "--wait-pids",  # rank 1 fails once rank 0 runs too (workers start one by one)
            "2",
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
        ["--verbose", "--nproc-per-node", "2", WORKER, "fail", "--exit-code", "3", "--pid-dir", str(tmp_path),
         "--wait-pids", "2"]
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
        ["--nproc-per-node", "2", WORKER, "fail", "--exit-code", "7", "--pid-dir", str(tmp_path),
         "--wait-pids", "2"]
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


def test_failure_report_is_short_for_many_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 ranks, one aborted (no traceback), 15 stopped: the report stays a few lines."""
    import signal as sig

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from tpu_dist.launch import _run, parse_args, resolve
    from tpu_dist.launch._discovery import Discovery
    from tpu_dist.launch._run import format_failure

    # The 15 were signalled by the launcher's agent (it notes that from elastic's log records).
    monkeypatch.setattr(_run, "_stopped_pids", {100 + r for r in range(16) if r != 10})

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


_FAILING_SCRIPT = """
import atexit, sys, threading, time
out = open(sys.argv[1], "w")          # never closed: the worker entry must flush it
out.write("written before the failure\\n")
atexit.register(lambda: open(sys.argv[2], "w").write("atexit ran\\n"))
def late():
    time.sleep(1.0)
    open(sys.argv[3], "w").write("thread finished\\n")
threading.Thread(target=late).start()  # not a daemon: Python waits for it at exit
{how}
"""


def test_a_failing_worker_leaves_fast_but_keeps_what_exit_does(tmp_path: Path) -> None:
    """A failing worker skips the interpreter's teardown (tpu-launch's worker entry), yet its
    exit code, sys.exit's message, atexit handlers, non-daemon threads, the flush of an
    unclosed file and the root cause the launcher names stay what a plain exit gives."""
    for how, code, message in (
        ("sys.exit(5)", 5, None),
        ("sys.exit('bad input: 42')", 1, "bad input: 42"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
    ):
        script = tmp_path / "failing.py"
        script.write_text(_FAILING_SCRIPT.format(how=how))
        files = [tmp_path / n for n in ("data.txt", "atexit.txt", "thread.txt")]
        for f in files:
            f.unlink(missing_ok=True)
        rc, _, err = run_launcher(["--nproc-per-node", "1", str(script), *map(str, files)])
        assert rc == 1, err
        assert "rank 0 (local rank 0" in err and f"exited with code {code}" in err, err
        if message:
            assert message in err, err
        assert files[0].read_text() == "written before the failure\n"
        assert files[1].read_text() == "atexit ran\n"
        assert files[2].read_text() == "thread finished\n"


def test_a_failing_worker_that_imported_torch_prints_only_its_own_error(tmp_path: Path) -> None:
    """The fast exit's flush looks at every object of the process; objects that warn when
    looked at (torch.distributed's deprecated ``reduce_op``) must not add lines to stderr."""
    script = tmp_path / "failing.py"
    script.write_text("import torch.distributed\nraise SystemExit(3)\n")
    rc, _, err = run_launcher(["--nproc-per-node", "1", str(script)])
    assert rc == 1 and "exited with code 3" in err, err
    assert "Warning" not in err, err


def test_the_worker_entry_imports_nothing_outside_the_standard_library(tmp_path: Path) -> None:
    """The user's program starts with only what its own imports bring in: no torch, no JAX,
    no tpu_dist (whose import would also register the backend before the program runs)."""
    script = tmp_path / "modules.py"
    script.write_text(
        "import sys\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'jax', 'tpu_dist'})\n"
        "print('imported before the program:', heavy)\n"
    )
    rc, out, err = run_launcher(["--nproc-per-node", "1", str(script)])
    assert rc == 0, err
    assert "imported before the program: []" in out, out + err
    from tpu_dist import _settings
    from tpu_dist.launch import _worker

    assert _worker.EXIT_CODE_VAR == _settings.EXIT_CODE.env


def test_root_cause_orders_failures_of_the_same_second_by_exit_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 exits 7; rank 0's collective fails 20 ms later because of it. elastic gives
    both the same whole-second timestamp; the worker entry's exit times decide."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from tpu_dist.launch import parse_args, resolve
    from tpu_dist.launch._discovery import Discovery
    from tpu_dist.launch._run import format_failure
    from tpu_dist.launch._worker import EXIT_TIME_DIR_VAR

    spec = resolve(parse_args(["--nproc-per-node", "2", "train.py"], {}), Discovery(on_tpu=False), {})
    monkeypatch.setenv(EXIT_TIME_DIR_VAR, str(tmp_path))  # as the launcher sets it
    failures = {}
    for rank, code, ended in ((0, 1, 1000.52), (1, 7, 1000.50)):
        (tmp_path / str(100 + rank)).write_text(f"{ended:.6f}\n")  # written by pid 100 + rank
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                        error_file=str(tmp_path / "none.json"))
        failures[rank].timestamp = 1000
    report = format_failure(spec, ChildFailedError("train.py", failures)).splitlines()
    assert report[0] == "tpu-launch: worker failed: node 0: rank 1 (local rank 1, pid 101) exited with code 7"
    # Rank 2, aborted the same second (no exit time: killed by a signal, as JAX ends the
    # others when rank 0's coordinator goes), comes after them; a second earlier it is first.
    import signal as sig

    failures[2] = ProcessFailure(local_rank=2, pid=102, exitcode=-sig.SIGABRT,
                                 error_file=str(tmp_path / "none.json"))
    failures[2].timestamp = 1000
    report = format_failure(spec, ChildFailedError("train.py", failures)).splitlines()
    assert "rank 1 (local rank 1, pid 101) exited with code 7" in report[0]
    failures[2].timestamp = 999
    report = format_failure(spec, ChildFailedError("train.py", failures)).splitlines()
    assert "rank 2 (local rank 2, pid 102) was killed by SIGABRT" in report[0]


def test_a_rank_killed_from_outside_comes_before_the_exits_elastic_noticed_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 is SIGKILLed from outside (its pid is not among those the launcher signalled);
    rank 1's collective fails and it exits 4 at 1000.98; elastic notices both at 1001.02, so
    the killed rank's only time is second 1001. It died before that look, and rank 1 exited
    because of it: rank 0 is named, also across the turn of the second. An exit noted two
    seconds before the look is no consequence of it, and comes first."""
    import signal as sig

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from tpu_dist.launch import _run, parse_args, resolve
    from tpu_dist.launch._discovery import Discovery
    from tpu_dist.launch._run import format_failure
    from tpu_dist.launch._worker import EXIT_TIME_DIR_VAR

    spec = resolve(parse_args(["--nproc-per-node", "2", "train.py"], {}), Discovery(on_tpu=False), {})
    monkeypatch.setenv(EXIT_TIME_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(_run, "_stopped_pids", set())
    missing = str(tmp_path / "none.json")
    killed = ProcessFailure(local_rank=0, pid=100, exitcode=-sig.SIGKILL, error_file=missing)
    killed.timestamp = 1001
    exited = ProcessFailure(local_rank=1, pid=101, exitcode=4, error_file=missing)
    exited.timestamp = 1001
    for ended, named in ((1000.98, "rank 0 (local rank 0, pid 100) was killed by SIGKILL, not sent"),
                         (998.5, "rank 1 (local rank 1, pid 101) exited with code 4")):
        (tmp_path / "101").write_text(f"{ended:.6f}\n")
        report = format_failure(spec, ChildFailedError("train.py", {0: killed, 1: exited}))
        assert report.splitlines()[0].startswith(f"tpu-launch: worker failed: node 0: {named}"), report
