"""tpu-launch end to end: real launchers and workers on loopback.

Each test runs ``python -m tpu_dist.launch`` as a subprocess with a timeout (see
``tests/launch_worker.py``). The collective tests take the c10d backend as a parameter
(``BACKENDS``); ``test_launch_tpu_backend.py`` runs the two-host world over tpu_dist's "tpu".
"""

from __future__ import annotations

import json
import re

import pytest

from tests.launch_worker import WORKER, finish, free_port, run_launcher, start_launcher

BACKENDS = ["gloo"]


def _env_lines(out: str) -> dict[int, dict[str, str]]:
    """RANK -> the ``ENV {json}`` line that rank printed (prefix ``[rankN]:`` included)."""
    found = {}
    for match in re.finditer(r"^\[rank(\d+)\]:ENV (\{.*\})$", out, flags=re.M):
        found[int(match[1])] = json.loads(match[2])
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_launcher_two_workers_all_reduce(backend: str) -> None:
    code, out, err = run_launcher(
        ["--nproc-per-node", "2", WORKER, "allreduce", "--backend", backend]
    )
    assert code == 0, err
    # Every line carries its rank: torchrun's prefix convention, with the global rank.
    for rank in (0, 1):
        assert f"[rank{rank}]:ALLREDUCE rank={rank} world=2 sum=3" in out
    envs = _env_lines(out)
    assert sorted(envs) == [0, 1]
    assert all(e["TPU_DIST_PLATFORM"] == "cpu" for e in envs.values())
    assert all("TPU_DIST_LAUNCH_WORKER_ENV" not in e for e in envs.values())  # consumed
    # Quiet by default (--dry-run and --verbose show what was set): no variable lines, and no
    # "[Gloo] Rank N is connected to ..." lines from jaxlib's gloo (the "tpu" backend on CPU).
    assert "for the workers" not in err
    assert "[Gloo]" not in out and "[Gloo]" not in err


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_launchers_form_a_four_rank_world(backend: str) -> None:
    port = free_port()
    common = ["--emulate", "v5p:2x2x1", "--nnodes", "2", "--master-port", str(port)]
    worker = [WORKER, "allreduce", "--backend", backend]
    nodes = [start_launcher([*common, "--node-rank", str(n), *worker]) for n in (0, 1)]
    results = [finish(proc, timeout=150) for proc in nodes]
    for node, (code, _, err) in enumerate(results):
        assert code == 0, f"node {node}:\n{err}"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        out = results[node][1]
        for rank in ranks:
            assert f"[rank{rank}]:ALLREDUCE rank={rank} world=4 sum=10" in out
        envs = _env_lines(out)
        assert sorted(envs) == list(ranks)
        for rank, env in envs.items():
            assert (env["GROUP_RANK"], env["LOCAL_RANK"]) == (str(node), str(rank % 2))
            assert env["TPU_DIST_TOPOLOGY"] == "v5p:2x2x1" and env["TPU_DIST_NUM_SLICES"] == "1"


def test_tpu_host_workers_get_their_own_chip() -> None:
    """A faked single-host v4-8 TPU (4 chips): each worker gets its chip, port and task id.

    The user's own TPU_PROCESS_BOUNDS wins over the computed 2,2,1, and the launcher says so.
    """
    env = {
        "TPU_DIST_PLATFORM": "tpu",
        "TPU_ACCELERATOR_TYPE": "v4-8",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_PROCESS_BOUNDS": "4,1,1",
    }
    base = free_port()
    code, out, err = run_launcher(["--tpu-base-port", str(base), WORKER, "env"], env=env)
    assert code == 0, err
    envs = _env_lines(out)
    assert sorted(envs) == [0, 1, 2, 3]
    addresses = ",".join(f"localhost:{base + i}" for i in range(4))
    for rank, worker_env in envs.items():
        assert worker_env["TPU_VISIBLE_CHIPS"] == worker_env["LOCAL_RANK"] == str(rank)
        assert worker_env["TPU_PROCESS_PORT"] == str(base + rank)
        assert worker_env["CLOUD_TPU_TASK_ID"] == str(rank)
        assert worker_env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert worker_env["TPU_PROCESS_ADDRESSES"] == addresses
        assert worker_env["TPU_DIST_PLATFORM"] == "tpu"  # the user's, passed through
        assert worker_env["TPU_PROCESS_BOUNDS"] == "4,1,1"  # the user's, explained:
    assert "TPU_PROCESS_BOUNDS='4,1,1' from your environment wins over '2,2,1'" in err


def test_cli_dry_run() -> None:
    code, out, err = run_launcher(
        ["--dry-run", "--emulate", "v5p:2x2x2", "--nnodes", "2", WORKER, "env"]
    )
    assert code == 0, err
    assert "nothing was started" in out and "node 1\n" in out
    assert "rank 7 [slice 0 host 1 chip 3 at (1,1,1)]: RANK=7 LOCAL_RANK=3 WORLD_SIZE=8" in out
