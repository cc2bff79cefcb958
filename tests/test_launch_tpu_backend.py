"""tpu-launch with tpu_dist's own c10d backend "tpu": two emulated hosts, one 4-rank world.

The same check as ``test_launch_e2e.test_two_launchers_form_a_four_rank_world`` (which runs
gloo), over ``dist.init_process_group("tpu")``: the workers' all-reduce runs as an XLA program
through JAX on the emulated v5p:2x2x1 slice that tpu-launch describes in TPU_DIST_TOPOLOGY.
"""

from __future__ import annotations

from tests.launch_worker import WORKER, finish, free_port, start_launcher


def test_two_launchers_all_reduce_over_the_tpu_backend() -> None:
    common = ["--emulate", "v5p:2x2x1", "--nnodes", "2", "--master-port", str(free_port())]
    worker = [WORKER, "allreduce", "--backend", "tpu"]
    nodes = [start_launcher([*common, "--node-rank", str(n), *worker]) for n in (0, 1)]
    results = [finish(proc, timeout=150) for proc in nodes]
    for node, (code, _, err) in enumerate(results):
        assert code == 0, f"node {node}:\n{err}"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        for rank in ranks:
            assert f"[rank{rank}]:ALLREDUCE rank={rank} world=4 sum=10" in results[node][1]
        # jaxlib's gloo prints "[Gloo] Rank N is connected to 3 peer ranks..." to stdout for
        # every communicator; tpu-launch leaves that healthy line out (kept with --verbose).
        assert "[Gloo]" not in results[node][1], results[node][1]
