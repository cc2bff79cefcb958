"""tpu-launch for TorchTPU workers (``--runtime``), and the JSON plan (``--plan-json``).

Tier (a): pure resolve/env logic on described hosts (no TPU, no processes), checked against
values recorded from TorchTPU 0.2.0's sources (``torch_tpu/_internal/distributed/distributed.py``
and ``torch_tpu/_internal/utils/hardware.py``: base port 8070, one address per device and host in
``TPU_WORKER_HOSTNAMES`` order, single-host topology table) and against TorchTPU's own rule for
a worker's address: task id = ``RANK % len(TORCH_TPU_SLICEBUILDER_ADDRESSES)``.

Optional: where ``torch_tpu`` is installed, TorchTPU's own ``set_tpu_launch_env`` is run as the
oracle (its pure-Python module, loaded without TorchTPU's native start-up; see
:func:`_torchtpu_launch_env`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tpu_dist.launch import Discovery, compute_worker_env, main, parse_args, resolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("PET_", "TPU_", "MEGASCALE_", "TORCH_TPU_")) or var in (
            "RANK", "OMP_NUM_THREADS", "JOB_COMPLETION_INDEX"
        ):
            monkeypatch.delenv(var)


def _host(accelerator: str, hosts: tuple[str, ...], worker_id: int, *, torch_tpu: bool = True,
          num_slices: int | None = None, slice_id: int | None = None) -> Discovery:
    """A TPU VM host as GKE / Cloud TPU describe it (TPU_ACCELERATOR_TYPE, TPU_WORKER_*)."""
    return Discovery(
        on_tpu=True,
        accelerator_type=accelerator,
        worker_id=worker_id,
        worker_hostnames=hosts,
        num_slices=num_slices,
        slice_id=slice_id,
        torch_tpu=torch_tpu,
        provenance={"accelerator_type": "TPU_ACCELERATOR_TYPE", "worker_id": "TPU_WORKER_ID",
                    "worker_hostnames": "TPU_WORKER_HOSTNAMES", "num_slices": "MEGASCALE_NUM_SLICES"},
    )


def _spec(argv: list[str], discovery: Discovery, environ: dict[str, str] | None = None):
    env = dict(environ or {})
    return resolve(parse_args([*argv, "train.py"], env), discovery, env)


_TPU_DIST_ONLY = {"TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES",
                  "TPU_PROCESS_PORT", "TPU_CHIPS_PER_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID"}


def _check_each_rank_on_its_own_host(spec, environ: dict[str, str]) -> None:
    """TorchTPU's rule: rank r uses address r % len(addresses), which must be on r's host."""
    for node in range(spec.max_nodes):
        env = compute_worker_env(spec, environ, node_rank=node)
        addresses = env.shared["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        host = spec.worker_hostnames[node % spec.hosts_per_slice]
        for local_rank in range(spec.nproc_per_node):
            rank = node * spec.nproc_per_node + local_rank
            assert addresses[rank % len(addresses)].split(":")[0] == host, (node, local_rank)
            assert not _TPU_DIST_ONLY & set(env.for_local_rank(local_rank))


def test_torchtpu_v4_16_host_env() -> None:
    spec = _spec(["--runtime", "torchtpu"], _host("v4-16", ("h0", "h1"), 1, torch_tpu=False))
    assert (spec.runtime, spec.nproc_per_node, spec.node_rank, spec.world_size) == (
        "torchtpu", 4, 1, 8)
    env = compute_worker_env(spec, {})
    assert env.shared["TORCH_TPU_TOPOLOGY"] == "2,2,2"
    assert env.shared["TORCH_TPU_DEVICES_PER_HOST"] == "4"
    assert env.shared["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == (
        "h0:8070,h0:8071,h0:8072,h0:8073,h1:8070,h1:8071,h1:8072,h1:8073")
    assert all(not r for r in env.per_rank)  # TorchTPU sets TPU_VISIBLE_CHIPS etc. itself
    _check_each_rank_on_its_own_host(spec, {})
    # TORCH_TPU_BASE_PORT moves the ports, as in TorchTPU.
    moved = compute_worker_env(spec, {"TORCH_TPU_BASE_PORT": "9000"})
    assert moved.shared["TORCH_TPU_SLICEBUILDER_ADDRESSES"].startswith("h0:9000,h0:9001,")


def test_torchtpu_tpu7x_one_worker_per_tensorcore() -> None:
    hosts = tuple(f"w{i}" for i in range(32))  # 4x4x8 chips, 4 chips (8 TensorCores) per host
    spec = _spec(["--runtime", "torchtpu"], _host("tpu7x:4x4x8", hosts, 5))
    assert (spec.nproc_per_node, spec.world_size, spec.node_rank) == (8, 256, 5)
    env = compute_worker_env(spec, {})
    assert env.shared["TORCH_TPU_TOPOLOGY"] == "4,4,8,2"  # the cores dimension of TPU7x
    assert env.shared["TORCH_TPU_DEVICES_PER_HOST"] == "8"
    assert len(env.shared["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 256
    _check_each_rank_on_its_own_host(spec, {})
    # One TPU7x host: TorchTPU's own table says "2,2,1,2" for its 8 devices.
    one = _spec(["--runtime", "torchtpu"], _host("tpu7x:2x2x1", ("localhost",), 0))
    env = compute_worker_env(one, {})
    assert (one.nproc_per_node, env.shared["TORCH_TPU_TOPOLOGY"]) == (8, "2,2,1,2")
    with pytest.raises(ValueError, match="one worker per TPU device.*must be 8"):
        _spec(["--runtime", "torchtpu", "--nproc-per-node", "4"], _host("tpu7x:2x2x1", (), 0))


def test_torchtpu_single_host_tables() -> None:
    # TorchTPU's single-host topologies (hardware.py): v5e/v6e 8 chips "2,4,1", v4 4 chips "2,2,1".
    for accelerator, topology, devices in (("v5litepod-8", "2,4,1", 8), ("v6e-8", "2,4,1", 8),
                                           ("v4-8", "2,2,1", 4)):
        spec = _spec(["--runtime", "torchtpu"], _host(accelerator, (), 0))
        env = compute_worker_env(spec, {})
        assert env.shared["TORCH_TPU_TOPOLOGY"] == topology, accelerator
        assert env.shared["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == ",".join(
            f"localhost:{8070 + i}" for i in range(devices))


def test_torchtpu_multislice() -> None:
    # Slice 1 of 2, v5p 2x2x2 slices (2 hosts each): nodes 2 and 3 of 4.
    discovery = _host("v5p:2x2x2", ("s1h0", "s1h1"), 1, num_slices=2, slice_id=1)
    spec = _spec(["--runtime", "torchtpu", "--master-addr", "s0h0"], discovery)
    assert (spec.node_rank, spec.world_size) == (3, 16)
    env = compute_worker_env(spec, {})
    # The platform set none of MEGASCALE_*: tpu-launch fills them in, with a coordinator port.
    assert env.shared["MEGASCALE_NUM_SLICES"] == "2"
    assert env.shared["MEGASCALE_SLICE_ID"] == "1"
    assert env.shared["MEGASCALE_COORDINATOR_ADDRESS"] == "s0h0:8080"
    assert compute_worker_env(spec, {}, node_rank=0).shared["MEGASCALE_SLICE_ID"] == "0"
    # The addresses list this slice's hosts only; each rank's address is on its own host.
    assert env.shared["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[0] == "s1h0:8070"
    for local_rank in range(4):
        rank = 3 * 4 + local_rank
        addresses = env.shared["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        assert addresses[rank % len(addresses)] == f"s1h1:{8070 + local_rank}"
    # Platform values pass through untouched; a coordinator without a port is reported.
    platform = {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
                "MEGASCALE_COORDINATOR_ADDRESS": "s0h0"}
    env = compute_worker_env(spec, platform)
    assert not {"MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID",
                "MEGASCALE_COORDINATOR_ADDRESS"} & set(env.shared)
    assert any("has no port" in n for n in env.notes)


def test_runtime_choice() -> None:
    assert _spec([], _host("v4-16", ("h0", "h1"), 0, torch_tpu=True)).runtime == "torchtpu"
    assert _spec([], _host("v4-16", ("h0", "h1"), 0, torch_tpu=False)).runtime == "tpu_dist"
    forced = _spec(["--runtime", "tpu_dist"], _host("v4-16", ("h0", "h1"), 0, torch_tpu=True))
    assert forced.runtime == "tpu_dist"
    assert "TPU_VISIBLE_CHIPS" in compute_worker_env(forced, {}).per_rank[0]
    emulated = _spec(["--emulate", "v5p:2x2x2"], Discovery(on_tpu=False, torch_tpu=True))
    assert emulated.runtime == "tpu_dist"
    with pytest.raises(ValueError, match="TorchTPU has no CPU emulation"):
        _spec(["--runtime", "torchtpu", "--emulate", "v5p:2x2x2"], Discovery(on_tpu=False))
    with pytest.raises(ValueError, match="must be auto, tpu_dist or torchtpu"):
        _spec([], Discovery(on_tpu=False), {"TPU_DIST_LAUNCH_RUNTIME": "xla"})


# -- --plan-json -------------------------------------------------------------------------------


def _plan(tmp_path, monkeypatch, argv: list[str], environ: dict[str, str]) -> dict:
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--dry-run", "--skip-preflight", "--plan-json", str(path), *argv, "train.py"])
    assert exit_info.value.code == 0
    return json.loads(path.read_text())


# A v4-16 TPU VM host as the platform describes it; TPU_DIST_PLATFORM=tpu plans it on any machine.
V4_16_VM = {"TPU_DIST_PLATFORM": "tpu", "TPU_ACCELERATOR_TYPE": "v4-16",
            "TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "1", "TPU_SKIP_MDS_QUERY": "1"}


def test_plan_json_of_a_tpu_host_without_a_tpu(tmp_path, monkeypatch) -> None:
    plan = _plan(tmp_path, monkeypatch, ["--runtime", "tpu_dist"], V4_16_VM)
    assert set(plan) == {"world_size", "runtime", "nodes", "shared_env"}
    assert (plan["world_size"], plan["runtime"]) == (8, "tpu_dist")
    assert [(n["node_rank"], n["host"]) for n in plan["nodes"]] == [(0, "h0"), (1, "h1")]
    for node in plan["nodes"]:
        assert [w["local_rank"] for w in node["workers"]] == [0, 1, 2, 3]
        for worker in node["workers"]:
            rank, local, env = worker["rank"], worker["local_rank"], worker["env"]
            assert rank == node["node_rank"] * 4 + local
            assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(local)
            assert env["WORLD_SIZE"] == "8" and env["GROUP_RANK"] == str(node["node_rank"])
            assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("h0", "29500")
            # libtpu's one-chip-per-process variables (as in the manual's v4-16 example)
            assert env["TPU_VISIBLE_CHIPS"] == str(local)
            assert env["TPU_PROCESS_PORT"] == str(8476 + local)
            assert env["CLOUD_TPU_TASK_ID"] == str(rank)
            assert env["TPU_PROCESS_BOUNDS"] == "2,2,2"
            assert {k: env[k] for k in plan["shared_env"]} == plan["shared_env"]
    assert plan["shared_env"]["TPU_PROCESS_ADDRESSES"] == ",".join(
        f"{h}:{p}" for h in ("h0", "h1") for p in range(8476, 8480))
    assert "RANK" not in plan["shared_env"] and "TPU_VISIBLE_CHIPS" not in plan["shared_env"]


def test_plan_json_torchtpu(tmp_path, monkeypatch) -> None:
    plan = _plan(tmp_path, monkeypatch, ["--runtime", "torchtpu"], V4_16_VM)
    assert plan["runtime"] == "torchtpu"
    assert plan["shared_env"]["TORCH_TPU_TOPOLOGY"] == "2,2,2"
    assert plan["shared_env"]["TORCH_TPU_SLICEBUILDER_ADDRESSES"].count(",") == 7
    worker = plan["nodes"][1]["workers"][2]
    assert worker["rank"] == 6 and not _TPU_DIST_ONLY & set(worker["env"])


# -- TorchTPU's own set_tpu_launch_env as the oracle (optional) -------------------------------

_ORACLE = r'''
import importlib, json, os, sys, types

spec = importlib.util.find_spec("torch_tpu")
root = os.path.dirname(spec.origin)

def package(name, path):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
    return module

# Stand-ins for the packages' __init__ (which load TorchTPU's native runtime) and for the two
# modules that are native or import native code: env (memoised env readers) and annotations.
package("torch_tpu", root)
package("torch_tpu._internal", os.path.join(root, "_internal"))
package("torch_tpu._internal.utils", os.path.join(root, "_internal", "utils"))
package("torch_tpu._internal.distributed", os.path.join(root, "_internal", "distributed"))
env = types.ModuleType("torch_tpu._internal.env")
env.get_str_env_once = lambda name, default_value=None: os.environ.get(name, default_value)
env.get_int_env_once = lambda name, default_value=None: int(os.environ.get(name, default_value))
sys.modules[env.__name__] = env
annotations = types.ModuleType("torch_tpu._internal.utils.annotations")
annotations.experimental = lambda message: (lambda fn: fn)
sys.modules[annotations.__name__] = annotations

from torch_tpu._internal.distributed import distributed
distributed.set_tpu_launch_env(nnodes=int(sys.argv[1]))
print(json.dumps({k: v for k, v in os.environ.items()
                  if k.startswith("TORCH_TPU_") or k in ("NNODES", "NODE_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}))
'''


def _torchtpu_launch_env(environ: dict[str, str], nnodes: int) -> dict[str, str]:
    """TorchTPU's ``set_tpu_launch_env`` run in a subprocess with ``environ``.

    Its module is loaded from the installed package with its own code, except the package
    ``__init__`` files and ``torch_tpu._internal.env`` / ``.utils.annotations`` (native, or
    importing native code), replaced by plain stand-ins.
    """
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("TPU_", "TORCH_TPU_", "MEGASCALE_"))}
    proc = subprocess.run(
        [sys.executable, "-c", _ORACLE, str(nnodes)], capture_output=True, text=True, timeout=120,
        env={**keep, **environ},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None,
                    reason="torch-tpu is not installed (optional oracle)")
@pytest.mark.parametrize(("accelerator", "hosts", "worker_id"), [
    ("v4-16", ("h0", "h1"), 1),
    ("v5p:2x2x4", ("a", "b", "c", "d"), 2),
    ("tpu7x:4x4x4", tuple(f"w{i}" for i in range(16)), 9),
])
def test_env_matches_torchtpus_set_tpu_launch_env(accelerator, hosts, worker_id) -> None:
    spec = _spec(["--runtime", "torchtpu"], _host(accelerator, hosts, worker_id))
    ours = compute_worker_env(spec, {}).shared
    theirs = _torchtpu_launch_env({
        "TPU_WORKER_HOSTNAMES": ",".join(hosts),
        "TORCH_TPU_TOPOLOGY": ours["TORCH_TPU_TOPOLOGY"],
        "TORCH_TPU_DEVICES_PER_HOST": ours["TORCH_TPU_DEVICES_PER_HOST"],
        "JOB_COMPLETION_INDEX": str(worker_id),
    }, nnodes=spec.max_nodes)
    assert theirs["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == ours["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
    assert theirs["TORCH_TPU_TOPOLOGY"] == ours["TORCH_TPU_TOPOLOGY"]
    assert (int(theirs["NNODES"]), int(theirs["NODE_RANK"])) == (spec.max_nodes, spec.node_rank)
    assert (theirs["MASTER_ADDR"], int(theirs["MASTER_PORT"])) == (spec.master_addr,
                                                                   spec.master_port)
