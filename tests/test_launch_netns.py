"""Two tpu-launch "hosts" with distinct addresses: each launcher in its own network namespace.

Namespaces ``A`` (10.213.0.1) and ``B`` (10.213.0.2) are joined by a veth pair; node 0 runs in A,
node 1 in B, so every connection (rendezvous store, gloo) crosses a real link between two
addresses instead of loopback. Needs root and ``ip netns``; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.launch_worker import REPO, WORKER, clean_env, finish

BACKENDS = ["gloo"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Two connected network namespaces; yields their names."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    tag = f"{os.getpid() % 100000}"
    a, b = f"tpla{tag}", f"tplb{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
    except (subprocess.CalledProcessError, OSError) as err:
        subprocess.run(["ip", "netns", "del", a], capture_output=True, timeout=10)
        pytest.skip(f"cannot create network namespaces here: {err}")
    try:
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, addr in ((a, f"va{tag}", "10.213.0.1/24"), (b, f"vb{tag}", "10.213.0.2/24")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_hosts_in_separate_namespaces_all_reduce(
    two_hosts: tuple[str, str], backend: str
) -> None:
    a, b = two_hosts
    tag = a[len("tpla") :]
    procs = []
    for node, (ns, dev) in enumerate(((a, f"va{tag}"), (b, f"vb{tag}"))):
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "_tpu_dist_launch",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "10.213.0.1",
            "--master-port",
            "29400",
            "--local-addr",
            f"10.213.0.{node + 1}",
            WORKER,
            "allreduce",
            "--backend",
            backend,
        ]
        env = clean_env({"GLOO_SOCKET_IFNAME": dev})
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    results = [finish(p, timeout=150) for p in procs]
    for node, (code, _, err) in enumerate(results):
        assert code == 0, f"node {node}:\n{err}"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        for rank in ranks:
            assert f"[rank{rank}]:ALLREDUCE rank={rank} world=4 sum=10" in results[node][1]
