"""tpu-launch across restarts and hosts: --max-restarts resumes a job; one host's failure stops all.

The restart test's worker fails once (a marker file records the first attempt, as a checkpoint
would) after attempt 0 initialised its group and all-reduced, then all-reduces over the c10d
backend given. Rank 0 of the restarted attempt starts 2 s late, so its peers look for its store
keys first: they must not read the failed attempt's (elastic keeps one store across restarts, and
torch's own keys are not per attempt: on gloo attempt 1 connected to attempt 0's dead peer
addresses, ``connectFullMesh ... Connection refused``; on "tpu" it read the dead JAX
coordinator's address). The 2 s make that order certain, so one run per backend shows it. The
two-host case (one worker per host) also needs both hosts to agree on the attempt: the healthy
host restarts for the failed one without counting a restart. The launches start together (the
``restarts`` fixture): most of each is waiting.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.launch_worker import WORKER, finish, free_port, pid_alive, start_launcher

_RESTART_CASES = [("gloo", 0), ("tpu", 0)]


@pytest.fixture(scope="module")
def restarts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The launches of the tests below, started at once (most of each is waiting: a rank's
    delay, elastic's restart, a launcher stopping its workers): name -> (exit code, stdout,
    stderr, marker path)."""
    tmp = tmp_path_factory.mktemp("restarts")
    launches = {}
    for backend, run in _RESTART_CASES:
        marker = tmp / f"checkpoint-{backend}-{run}"
        launches[f"fail-once-{backend}-{run}"] = (marker, [
            "--nproc-per-node", "2", "--max-restarts", "1",
            WORKER, "fail-once", "--marker", str(marker),
            # Attempt 0 initialises the group and all-reduces before rank 1 fails, and rank 0
            # of attempt 1 starts 2 s late: its peers look for its store keys first.
            "--after-init", "--delay", "2",
            "--backend", backend,
        ])
    marker = tmp / "checkpoint-two-hosts"
    port = free_port()
    for node in (0, 1):
        launches[f"two-hosts-{node}"] = (marker, [
            "--nnodes", "2", "--node-rank", str(node), "--master-port", str(port),
            "--nproc-per-node", "1", "--max-restarts", "1",
            WORKER, "fail-once", "--marker", str(marker), "--after-init", "--delay", "2",
            "--backend", "tpu",
        ])
    port = free_port()
    for node in (0, 1):
        launches[f"rank0-dies-{node}"] = (None, [
            "--nnodes", "2", "--node-rank", str(node), "--master-port", str(port),
            "--nproc-per-node", "1",
            WORKER, "rank0-dies", "--delay", "1", "--exit-code", "9", "--sleep", "10",
            "--backend", "tpu",
        ])
    ckpt = tmp / "ckpt.pt"
    launches["steps"] = (ckpt, [
        "--nproc-per-node", "2", "--max-restarts", "1", WORKER, "steps", "--steps", "6",
        "--fail-step", "3", "--marker", str(ckpt), "--backend", "tpu",
    ])
    procs = {name: (marker, start_launcher(args)) for name, (marker, args) in launches.items()}
    return {name: (*finish(proc, timeout=240), marker) for name, (marker, proc) in procs.items()}


@pytest.mark.parametrize(("backend", "run"), _RESTART_CASES)
def test_max_restarts_resumes_a_job_that_failed_once(restarts: dict, backend: str, run: int) -> None:
    code, out, err, marker = restarts[f"fail-once-{backend}-{run}"]
    assert code == 0, err
    assert marker.exists()
    assert "[rank1]:rank 1: failing on purpose (attempt 0)" in out
    for rank in (0, 1):
        assert f"[rank{rank}]:RESUMED rank={rank} restart=1 attempt=1 " in out


def test_two_hosts_restart_together_and_resume(restarts: dict) -> None:
    """Rank 1 (node 1) fails once after the group worked; both hosts start attempt 1, agree on
    its store and its number (TORCHELASTIC_RESTART_COUNT stays 0 on node 0: its workers were
    healthy), and resume."""
    (code0, out0, err0, marker), (code1, out1, err1, _) = (
        restarts["two-hosts-0"], restarts["two-hosts-1"]
    )
    assert code0 == 0, err0
    assert code1 == 0, err1
    assert marker.exists()
    assert "[rank1]:rank 1: failing on purpose (attempt 0)" in out1
    assert re.search(r"^\[rank0\]:RESUMED rank=0 restart=[01] attempt=1 ", out0, re.M), out0
    assert "[rank1]:RESUMED rank=1 restart=1 attempt=1 " in out1


def test_rank_0s_death_on_node_0_stops_node_1_like_gloo(restarts: dict) -> None:
    """Rank 0 (node 0, whose launcher hosts the JAX coordination service) exits 9 while rank 1
    (node 1) waits in an all_reduce. As on gloo (measured by hand: same outcome and messages),
    rank 1 catches the error, then its launcher stops it (SIGTERM) for node 0's failure and
    names that failure. Node 0's launcher keeps the service up until node 1's worker is gone:
    it used to stop it at once, and JAX's client then ended rank 1 with SIGABRT ("Terminating
    process because the JAX distributed service detected fatal errors") before its launcher
    could, so node 1 reported its own rank's SIGABRT."""
    (code0, _out0, err0, _), (code1, out1, err1, _) = (
        restarts["rank0-dies-0"], restarts["rank0-dies-1"]
    )
    assert code0 == 1, err0
    assert "tpu-launch: worker failed: node 0: rank 0 (local rank 0, " in err0
    assert "exited with code 9" in err0
    assert "[rank1]:CAUGHT rank=1 DistBackendError" in out1, out1 + err1
    assert code1 == 1, err1
    assert (
        "tpu-launch: stopped node 1's workers because another host failed: node 0: rank 0 "
        in err1
    ), err1
    assert "SIGABRT" not in err1 and "Terminating process" not in out1 + err1, out1 + err1


def test_restarted_job_resumes_from_its_checkpoint_with_the_right_result(restarts: dict) -> None:
    """Rank 1 fails after step 3 of 6 (the group working, rank 0 in the next all_reduce); the
    restarted job loads rank 0's checkpoint and finishes. Its state must equal an uninterrupted
    run's, computed here with numpy (float32, the same operations)."""
    import numpy as np

    code, out, err, _ = restarts["steps"]
    assert code == 0, err
    assert "[rank1]:rank 1: failing on purpose after step 3" in out
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    for step in range(6):
        x = sum(x * np.float32(r + 1) + np.float32(step) for r in range(2)) / np.float32(2)
    for rank in (0, 1):
        line = next(l for l in out.splitlines() if l.startswith(f"[rank{rank}]:STEPS"))
        attempt = int(line.split("attempt=")[1].split()[0])
        start = int(line.split("from=")[1].split()[0])
        got = np.array(json.loads(line.split("x=")[1]), dtype=np.float32)
        assert attempt == 1 and 1 <= start <= 3, line  # it resumed, not started over
        np.testing.assert_allclose(got, x, rtol=1e-6)


def test_one_hosts_failure_stops_the_other_host(tmp_path: Path) -> None:
    """Node 1's rank 3 exits 7 while node 0's workers sleep outside any collective (it waits
    until every rank has started: each host's workers start when its own zygote has imported
    torch and JAX, seconds apart on a loaded machine)."""
    port = free_port()
    worker = [
        WORKER,
        "fail",
        "--fail-rank",
        "3",
        "--exit-code",
        "7",
        "--wait-pids",
        "4",
        "--delay",
        "1",
        "--pid-dir",
        str(tmp_path),
    ]
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", str(port)]
    nodes = [start_launcher([*common, "--node-rank", str(n), *worker]) for n in (0, 1)]
    (code0, _, err0), (code1, _, err1) = [finish(p, timeout=150) for p in nodes]
    assert code1 == 1, err1
    assert "tpu-launch: worker failed: node 1: rank 3 (local rank 1" in err1
    assert "exited with code 7" in err1
    assert code0 == 1, err0
    assert "stopped node 0's workers because another host failed: node 1: rank 3" in err0
    pids = [int(open(os.path.join(tmp_path, f)).read()) for f in os.listdir(tmp_path)]
    assert len(pids) == 4 and not [p for p in pids if pid_alive(p)]
