"""How fast and how truthfully a job ends under tpu-launch when a worker fails: "tpu" beside gloo.

Runs ``tests/launch_worker.py`` fault modes with two workers, each on gloo then "tpu", and
prints per run the seconds from the last ``READY`` line (the group works) to the launcher's exit,
the launcher's exit code and the worker it names as the root cause::

    python benchmarks/faults.py exit-early timeout-exit late-finish

``exit-early``: rank 1 exits 7 after init while rank 0 waits in a barrier. ``timeout-exit``:
group timeout 3 s, rank 1 stays away, rank 0 catches the error and exits 3 (TPU_DIST_TIMEOUT_POLICY
=raise). ``late-finish``: rank 1 works ``LATE`` (default 65) seconds after
``destroy_process_group()``; the job must exit 0. ``restart``: ``--max-restarts 1``, rank 1 of
attempt 0 exits 1 (on "tpu" after the group worked, so attempt 0's store keys exist; gloo cannot
restart from there, see tests/test_launch_restart.py, so it fails before init); printed: the
seconds from that failure to the last rank's all_reduce in attempt 1.
"""

from __future__ import annotations

import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch_worker import WORKER, finish, start_launcher  # noqa: E402


def one(backend: str, mode: str, extra: list[str], env: dict[str, str] | None = None) -> str:
    proc = start_launcher(["--nproc-per-node", "2", WORKER, mode, "--backend", backend, *extra],
                          env=env)
    code, out, err = finish(proc, timeout=400)
    end = time.time()
    ready = [float(t) for t in re.findall(r"READY rank=\d+ t=([\d.]+)", out + err)]
    since = f"{end - max(ready):6.1f}s" if ready else "   n/a"
    cause = re.search(r"tpu-launch: worker failed: (.*)", err)
    return f"{backend:5s} {mode:13s} ready->exit {since} launcher={code} {cause.group(1) if cause else ''}"


def restart(backend: str) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        after_init = ["--after-init"] if backend == "tpu" else []
        proc = start_launcher(["--nproc-per-node", "2", "--max-restarts", "1", WORKER,
                               "fail-once", "--marker", os.path.join(tmp, "marker"),
                               *after_init, "--backend", backend])
        code, out, err = finish(proc, timeout=400)
    failed = re.findall(r"failing on purpose \(attempt 0\) t=([\d.]+)", out)
    resumed = [float(t) for t in re.findall(r"RESUMED rank=\d+ restart=1 t=([\d.]+)", out)]
    took = f"{max(resumed) - float(failed[0]):6.1f}s" if failed and len(resumed) == 2 else "   n/a"
    return f"{backend:5s} restart       fault->resumed {took} launcher={code}"


def main() -> None:
    for mode in sys.argv[1:] or ["exit-early", "timeout-exit"]:
        for backend in ("gloo", "tpu"):
            if mode == "exit-early":
                print(one(backend, mode, ["--exit-code", "7"]), flush=True)
            elif mode == "timeout-exit":
                print(one(backend, mode, ["--timeout", "3", "--sleep", "20", "--exit-code", "3"],
                          {"TPU_DIST_TIMEOUT_POLICY": "raise"}), flush=True)
            elif mode == "restart":
                print(restart(backend), flush=True)
            elif mode == "late-finish":
                print(one(backend, mode, ["--sleep", os.environ.get("LATE", "65")]), flush=True)


if __name__ == "__main__":
    main()
