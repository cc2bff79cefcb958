"""Calls that torch rejects on one rank only, before the backend is called (issue 48, item 1).

``tests/test_rejected_calls.py`` covers the checks tpu_dist makes: every rank fails the call
together and stays in step. Some checks are torch's own, in ``torch.distributed`` before it
calls any backend (``gather`` without a ``gather_list`` on its ``dst``; an object that cannot be
pickled on the source of ``broadcast_object_list``): the rejecting rank never reaches tpu_dist,
its peers enter the call, and the rejecting rank's next call meets theirs. No backend can join
a call it never sees; what must hold is gloo's floor: no rank returns wrong numbers, and every
rank ends in an error (here within the group's 5 s timeout and a bounded time) rather than
hanging. On "tpu" it ends sooner than gloo's timeout.

Each case runs ``tests/rejected_by_torch_job.py`` on 2 ranks under torchrun, on "tpu" and on
gloo: the bad call, then an all_reduce of ``rank + 1``. Measured on torch 2.13: on gloo every
call after the bad one times out on both ranks (5 s each). On "tpu" the rejecting rank's
all_reduce meets its peer's call: the messages differ in size, one process ends in XLA's gloo
size check (SIGABRT, the troubleshooting guide's "ranks call different collectives"), and the
other's call fails at once with a ``DistBackendError`` that names the rank and says it is gone
or called another collective (unless torchrun, which stops every worker once one has failed,
stops it first); or, by timing, the two calls never meet and each rank's watchdog ends it at
the group's timeout (5 s), naming the collective it waited in.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "rejected_by_torch_job.py"
TIMEOUT_S = 5  # the job's group timeout (rejected_by_torch_job.TIMEOUT_S)
CASES = ["gather_list_missing_on_dst", "unpicklable_object_on_src"]


def _run(backend: str, case: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(JOB), backend, case]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # The group's timeout is 5 s; the rest is start-up on a loaded machine. A hang fails here.
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    lines = []
    for text in proc.stdout.splitlines():
        start = text.find("{")  # torchrun may prefix a rank's lines
        if start >= 0:
            try:
                lines.append(json.loads(text[start:]))
            except json.JSONDecodeError:
                pass
    return proc, lines


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], tuple[subprocess.CompletedProcess, list[dict]]]:
    jobs = [(backend, case) for case in CASES for backend in ("tpu", "gloo")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {job: pool.submit(_run, *job) for job in jobs}
        return {job: future.result() for job, future in futures.items()}


def _check_no_wrong_numbers(proc: subprocess.CompletedProcess, lines: list[dict]) -> None:
    """Rank 0 got torch's own error; no rank's all_reduce returned (its peer was in the other
    call), so none returned wrong numbers."""
    output = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    bad = {line["rank"]: line for line in lines if line["call"] == "bad"}
    assert bad[0]["outcome"] in ("ValueError", "PicklingError", "AttributeError"), (bad, output)
    returned = [line for line in lines if line["call"] == "all_reduce" and line["outcome"] == "returned"]
    assert not returned, (returned, output)


@pytest.mark.parametrize("case", CASES)
def test_tpu_never_returns_wrong_numbers_and_every_rank_fails(runs, case: str) -> None:
    proc, lines = runs[("tpu", case)]
    _check_no_wrong_numbers(proc, lines)
    # Every rank fails, and the job exits non-zero, in one of three ways, by timing: the two
    # calls meet and one process ends in XLA's size check (SIGABRT: torchrun reports exit code
    # -6), the other's call failing with tpu_dist's error that names the rank that met another
    # call (unless torchrun stopped it first: it stops every worker once one has failed); or
    # they do not meet, and each rank's watchdog ends it at the group's timeout, naming the
    # collective it waited in.
    assert proc.returncode != 0, proc.stdout[-3000:]
    text = proc.stdout + proc.stderr
    named = "did not report the failure: they are gone, or called another collective" in text
    aborted = re.search(r"exitcode\s*:?\s*-6", text) is not None
    timed_out = text.count(f"timed out after {TIMEOUT_S} s (the group's timeout)") >= 2
    assert named or aborted or timed_out, text[-4000:]


@pytest.mark.parametrize("case", CASES)
def test_gloo_beside_it_fails_every_rank_too(runs, case: str) -> None:
    proc, lines = runs[("gloo", case)]
    _check_no_wrong_numbers(proc, lines)
