"""tpu-launch, pure logic: slice names, flags, resolution, per-worker env, dry run, pre-flight.

No workers are started here; discovery is replaced by hand-made :class:`Discovery` values.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch_worker import free_port
from tpu_dist.mesh import Topology
from tpu_dist.launch import (
    Discovery,
    LaunchSpec,
    compute_worker_env,
    format_dry_run,
    main,
    parse_args,
    parse_slice,
    preflight,
    resolve,
)

NO_TPU = Discovery(on_tpu=False)
# Host 1 of a v4-16 (2 hosts of 4 chips), as GKE's webhook describes it.
V4_16_HOST1 = Discovery(
    on_tpu=True,
    local_chips=4,
    accelerator_type="v4-16",
    worker_id=1,
    worker_hostnames=("h0", "h1"),
    provenance={
        "accelerator_type": "TPU_ACCELERATOR_TYPE",
        "worker_id": "TPU_WORKER_ID",
        "worker_hostnames": "TPU_WORKER_HOSTNAMES",
    },
)


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's parser reads PET_* from os.environ: start every test from a clean slate."""
    import os

    for var in list(os.environ):
        if var.startswith(("PET_", "TPU_", "MEGASCALE_")) or var in ("RANK", "OMP_NUM_THREADS"):
            monkeypatch.delenv(var)


def spec_for(
    argv: list[str], discovery: Discovery = NO_TPU, environ: dict[str, str] | None = None
) -> LaunchSpec:
    env = dict(environ or {})
    return resolve(parse_args([*argv, "train.py", "--lr", "1"], env), discovery, env)


# -- slice names -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "chips", "hosts", "bounds"),
    [
        ("v4-16", 8, 2, (2, 2, 2)),
        ("v4-8", 4, 1, (2, 2, 1)),
        ("v5p:2x2x2", 8, 2, (2, 2, 2)),
        ("v5litepod-8", 8, 1, (2, 4, 1)),
        ("v5e:2x4", 8, 1, (2, 4, 1)),
    ],
)
def test_parse_slice(name: str, chips: int, hosts: int, bounds: tuple[int, int, int]) -> None:
    shape = parse_slice(name)
    assert (shape.num_chips, shape.num_hosts, shape.bounds) == (chips, hosts, bounds)
    assert shape.bounds_str == ",".join(map(str, bounds))


def test_parse_slice_agrees_with_the_mesh_on_hosts() -> None:
    # One record of hardware facts: multi-host v5e/v6e slices are hosts of 4 chips (2x2), as
    # libtpu lays them out; v7x chips are two devices each. (Before issue 12 the launcher's own
    # table and the mesh disagreed: v5litepod-16 was 4 hosts here and 2 there.)
    for name in ("v5litepod-16", "v6e-256", "v5p-128", "tpu7x-16", "v4-8"):
        shape, topo = parse_slice(name), Topology.parse(name)
        assert shape.num_hosts == topo.num_hosts, name
        assert shape.num_devices == topo.num_devices, name
    assert parse_slice("v5litepod-16").chips_per_host == 4
    assert parse_slice("tpu7x-16").devices_per_chip == 2


@pytest.mark.parametrize("name", ["v9-8", "v4-7", "banana", "v5p:2xx2", "v3-32"])
def test_parse_slice_rejects(name: str) -> None:
    with pytest.raises(
        ValueError, match=r"v5p|v4|generation|expected|topology|multiple|TensorCores"
    ):
        parse_slice(name)


# -- flags -------------------------------------------------------------------------------------


def test_torchrun_flags_and_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args(["--nproc-per-host", "3", "--max-restarts", "2", "-m", "pkg.train", "x"], {})
    assert (args.nproc_per_node, args.max_restarts, args.module) == ("3", 2, True)
    assert (args.training_script, args.training_script_args) == ("pkg.train", ["x"])
    # Discoverable values stay "not given" so resolve can tell a default from a choice...
    assert args.node_rank is None and args.nnodes is None and args.master_addr is None
    # ...unless torchrun's PET_* variable gives them.
    monkeypatch.setenv("PET_NODE_RANK", "1")
    assert parse_args(["s.py"], {"PET_NODE_RANK": "1"}).node_rank == 1


def test_tpu_knobs_take_env_defaults_strictly() -> None:
    args = parse_args(["s.py"], {"TPU_DIST_TOPOLOGY": "v5p:2x2x2", "TPU_DIST_NUM_SLICES": "2"})
    assert (args.emulate, args.emulate_source, args.num_slices) == (
        "v5p:2x2x2",
        "TPU_DIST_TOPOLOGY",
        2,
    )
    flagged = parse_args(["--emulate", "v4-8", "s.py"], {"TPU_DIST_TOPOLOGY": "v5p:2x2x2"})
    assert (flagged.emulate, flagged.emulate_source) == ("v4-8", "--emulate")
    with pytest.raises(ValueError, match="TPU_DIST_NUM_SLICES='two'"):
        parse_args(["s.py"], {"TPU_DIST_NUM_SLICES": "two"})


# -- resolution --------------------------------------------------------------------------------


def test_emulation_on_one_launcher_runs_every_chip() -> None:
    spec = spec_for(["--emulate", "v5p:2x2x2"])
    assert (spec.mode, spec.max_nodes, spec.nproc_per_node, spec.world_size) == ("emulate", 1, 8, 8)
    assert spec.platform == "cpu"
    assert spec.rdzv_backend == "c10d" and spec.rdzv_endpoint == "localhost:0"  # as torchrun
    assert spec.entry.command()[-3:] == ("train.py", "--lr", "1")


def test_emulation_split_over_two_launchers() -> None:
    spec = spec_for(["--emulate", "v5p:2x2x2", "--nnodes", "2", "--node-rank", "1"])
    assert (spec.nproc_per_node, spec.node_rank, spec.rdzv_backend) == (4, 1, "static")
    assert (spec.master_addr, spec.master_port) == ("127.0.0.1", 29500)
    with pytest.raises(ValueError, match="one worker per device"):
        spec_for(["--emulate", "v5p:2x2x2", "--nproc-per-node", "2"])
    with pytest.raises(ValueError, match="do not split evenly"):
        spec_for(["--emulate", "v5p:2x2x2", "--nnodes", "3"])


def test_plain_cpu_defaults_to_one_worker() -> None:
    spec = spec_for([])
    assert (spec.mode, spec.nproc_per_node, spec.max_nodes, spec.platform) == ("cpu", 1, 1, "cpu")


def test_tpu_host_from_discovery() -> None:
    spec = spec_for([], V4_16_HOST1)
    assert spec.mode == "tpu" and spec.slice is not None and spec.slice.name == "v4-16"
    assert (spec.max_nodes, spec.node_rank, spec.nproc_per_node) == (2, 1, 4)
    assert (spec.master_addr, spec.master_port, spec.rdzv_backend) == ("h0", 29500, "static")
    assert spec.platform is None  # a real TPU: the runtime picks the platform
    assert spec.provenance["node_rank"] == "TPU_WORKER_ID"
    assert spec.provenance["master_addr"].startswith("worker 0 of TPU_WORKER_HOSTNAMES")


def test_multislice_node_rank_and_master() -> None:
    discovery = Discovery(
        on_tpu=True,
        local_chips=4,
        accelerator_type="v4-16",
        worker_id=1,
        worker_hostnames=("s1h0", "s1h1"),
        num_slices=2,
        slice_id=1,
        coordinator_address="s0h0:8080",
        provenance={
            "num_slices": "MEGASCALE_NUM_SLICES",
            "coordinator_address": "MEGASCALE_COORDINATOR_ADDRESS",
            "worker_id": "TPU_WORKER_ID",
            "worker_hostnames": "TPU_WORKER_HOSTNAMES",
        },
    )
    spec = spec_for([], discovery)
    # 2 slices x 2 hosts; this is host 1 of slice 1 -> node 3 of 4; rank 0 lives on slice 0.
    assert (spec.max_nodes, spec.node_rank, spec.master_addr, spec.num_slices) == (4, 3, "s0h0", 2)


def test_flags_beat_discovery_and_say_so() -> None:
    spec = spec_for(["--node-rank", "0", "--master-addr", "10.0.0.9"], V4_16_HOST1)
    assert (spec.node_rank, spec.master_addr) == (0, "10.0.0.9")
    assert any("differs from the discovered host index 1" in n for n in spec.notes)


def test_tpu_rejects_partial_chip_split() -> None:
    with pytest.raises(ValueError, match="must be 4 .* or 1"):
        spec_for(["--nproc-per-node", "2"], V4_16_HOST1)


def test_multi_node_restarts_use_c10d() -> None:
    spec = spec_for(["--nnodes", "2", "--max-restarts", "1", "--master-port", "1234"])
    assert (spec.rdzv_backend, spec.rdzv_endpoint) == ("c10d", "127.0.0.1:1234")
    assert any("every node restarts together" in n for n in spec.notes)
    explicit = spec_for(["--nnodes", "2", "--max-restarts", "1", "--rdzv-backend", "static"])
    assert explicit.rdzv_backend == "static"
    # Kept, and said what it means (measured: a healthy node outside any collective does not
    # restart, and the failed node's attempt 1 waits for it).
    assert any("a node restarts only when its own workers fail" in n for n in explicit.notes)


# -- per-worker environment --------------------------------------------------------------------


def test_tpu_worker_env_one_chip_per_process() -> None:
    spec = spec_for([], V4_16_HOST1)
    env = compute_worker_env(spec, {})
    assert env.shared["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    assert env.shared["TPU_PROCESS_BOUNDS"] == "2,2,2"
    assert env.shared["TPU_PROCESS_ADDRESSES"] == ",".join(
        f"{h}:{p}" for h in ("h0", "h1") for p in range(8476, 8480)
    )
    assert [dict(r) for r in env.per_rank] == [
        {
            "TPU_VISIBLE_CHIPS": str(i),
            "TPU_PROCESS_PORT": str(8476 + i),
            "CLOUD_TPU_TASK_ID": str(4 + i),
        }
        for i in range(4)
    ]
    other = compute_worker_env(spec, {}, node_rank=0)
    assert [r["CLOUD_TPU_TASK_ID"] for r in other.per_rank] == ["0", "1", "2", "3"]
    assert "TPU_DIST_PLATFORM" not in env.shared and not env.notes


def test_single_process_tpu_host_gets_no_chip_vars() -> None:
    spec = spec_for(["--nproc-per-node", "1"], V4_16_HOST1)
    env = compute_worker_env(spec, {})
    assert not any(k.startswith("TPU_") for k in env.shared) and env.per_rank == ({},)


def test_emulation_env_and_user_overrides() -> None:
    environ = {"TPU_DIST_TOPOLOGY": "v4-8", "TPU_DIST_PLATFORM": "gpu", "RANK": "5"}
    spec = spec_for(["--emulate", "v5p:2x2x1"], environ=environ)
    env = compute_worker_env(spec, environ)
    # The explicit flag beats the env var backing it, and says so.
    assert env.shared["TPU_DIST_TOPOLOGY"] == "v5p:2x2x1"
    assert any("--emulate v5p:2x2x1 overrides TPU_DIST_TOPOLOGY='v4-8'" in n for n in env.notes)
    # The user's own platform is left alone; elastic's RANK cannot be, and that is said too.
    assert "TPU_DIST_PLATFORM" not in env.shared
    assert any(n.startswith("RANK='5'") for n in env.notes)
    assert env.shared["TPU_DIST_NUM_SLICES"] == "1" and env.shared["OMP_NUM_THREADS"] == "1"


def test_a_coordination_service_of_the_users_own_is_replaced_and_that_is_said() -> None:
    # tpu-launch starts the service for each attempt and sets these in every worker; a value in
    # the launcher's environment would otherwise vanish without a word (issue 16).
    environ = {"TPU_DIST_COORDINATION_SERVICE": "10.0.0.9:8470", "TPU_DIST_LAUNCH_ATTEMPT": "4"}
    env = compute_worker_env(spec_for(["--emulate", "v5p:2x2x1"], environ=environ), environ)
    said = [n for n in env.notes if "is replaced for every attempt" in n]
    assert [n.split("=")[0] for n in said] == ["TPU_DIST_COORDINATION_SERVICE", "TPU_DIST_LAUNCH_ATTEMPT"]
    assert "'10.0.0.9:8470'" in said[0]
    assert not [n for n in compute_worker_env(spec_for(["--emulate", "v5p:2x2x1"]), {}).notes
                if "is replaced" in n]


def test_cpu_workers_get_huge_pages_unless_glibc_tunables_is_set() -> None:
    emulated = compute_worker_env(spec_for(["--emulate", "v5p:2x2x1"]), {})
    assert emulated.shared["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    # The user's own tunables are theirs: nothing is added or merged.
    environ = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    own = compute_worker_env(spec_for(["--emulate", "v5p:2x2x1"], environ=environ), environ)
    assert "GLIBC_TUNABLES" not in own.shared
    # TPU workers keep glibc's defaults (their collective buffers live on the chips).
    assert "GLIBC_TUNABLES" not in compute_worker_env(spec_for([], V4_16_HOST1), {}).shared


def test_user_set_chip_var_wins_with_a_note() -> None:
    environ = {"TPU_VISIBLE_CHIPS": "0"}
    env = compute_worker_env(spec_for([], V4_16_HOST1, environ), environ)
    assert all("TPU_VISIBLE_CHIPS" not in r for r in env.per_rank)
    assert any("TPU_VISIBLE_CHIPS='0' from your environment wins" in n for n in env.notes)


# -- dry run -----------------------------------------------------------------------------------


def test_dry_run_report_lists_every_host_and_rank() -> None:
    spec = spec_for([], V4_16_HOST1)
    text = format_dry_run(spec, {}, [])
    assert "nothing was started" in text
    assert "node 0\n" in text and "node 1 (this host)" in text
    assert "rank 6 [slice 0 host 1 chip 2]: RANK=6 LOCAL_RANK=2" in text
    assert "TPU_VISIBLE_CHIPS=2 TPU_PROCESS_PORT=8478 CLOUD_TPU_TASK_ID=6" in text
    assert "TPU_PROCESS_BOUNDS=2,2,2" in text


def test_main_dry_run_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--dry-run", "--emulate", "v5litepod-8", "--nnodes", "2", "train.py"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "workers/node  4" in out and "TPU_DIST_TOPOLOGY=v5litepod-8" in out
    with pytest.raises(SystemExit) as bad:
        main(["--emulate", "v9-8", "train.py"])
    assert bad.value.code == 2
    assert "unknown TPU generation" in capsys.readouterr().err


# -- pre-flight --------------------------------------------------------------------------------


def _holder(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_preflight_names_the_process_holding_the_master_port() -> None:
    port = free_port()
    proc = _holder(
        f"import socket,time; s=socket.socket(); s.bind(('', {port})); s.listen(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    try:
        spec = spec_for(["--nnodes", "2", "--master-port", str(port)])
        errors = [p for p in preflight(spec, compute_worker_env(spec, {})) if p.severity == "error"]
        assert len(errors) == 1, errors
        assert f"master port {port} is in use" in errors[0].message
        assert f"pid {proc.pid}" in errors[0].message
        # Node 1 does not host the store: no check there.
        spec1 = spec_for(["--nnodes", "2", "--node-rank", "1", "--master-port", str(port)])
        assert not [
            p for p in preflight(spec1, compute_worker_env(spec1, {})) if p.severity == "error"
        ]
    finally:
        proc.kill()
        proc.wait()


def test_preflight_tpu_devices_lockfile_and_host_count(tmp_path: Path) -> None:
    lockfile, device = tmp_path / "libtpu_lockfile", tmp_path / "accel0"
    lockfile.write_text("")
    device.write_text("")
    spec = spec_for(["--nnodes", "3", "--tpu-base-port", str(free_port())], V4_16_HOST1)
    env = compute_worker_env(spec, {})

    stale = preflight(
        spec, env, lockfile=str(lockfile), dev_root=str(tmp_path), port_free=lambda p: True
    )
    messages = [(p.severity, p.message) for p in stale]
    assert any(s == "error" and "has 2 hosts, but --nnodes is 3" in m for s, m in messages)
    assert any(s == "warning" and "no live process holds it" in m for s, m in messages)

    proc = _holder(
        f"import time; f=open({str(device)!r}); g=open({str(lockfile)!r}); "
        "print('ready', flush=True); time.sleep(60)"
    )
    try:
        held = preflight(
            spec, env, lockfile=str(lockfile), dev_root=str(tmp_path), port_free=lambda p: True
        )
        errors = [p.message for p in held if p.severity == "error"]
        assert any(m.startswith(f"{device} is held by pid {proc.pid}") for m in errors), errors
        assert any(m.startswith(f"{lockfile} is held by pid {proc.pid}") for m in errors), errors
        assert not any("no live process" in p.message for p in held)
    finally:
        proc.kill()
        proc.wait()
    taken = spec.tpu_base_port + 1
    busy = preflight(
        spec, env, lockfile=str(lockfile), dev_root=str(tmp_path / "none"), port_free=lambda p: p != taken
    )
    assert any(f"TPU_PROCESS_PORT {taken} (local rank 1) is in use" in p.message for p in busy)
    started = time.monotonic()
    preflight(spec, env)  # the real /proc scan stays cheap
    assert time.monotonic() - started < 10


def test_the_scripts_own_flags_are_never_taken_for_abbreviations_of_the_launchers() -> None:
    # --tp prefixes --tpu-base-port: before, argparse stopped with "ambiguous option" before
    # the script ran; --nnodes after the script is the script's, not the launcher's.
    args = parse_args(["--nproc-per-node", "2", "train.py", "--tp", "8", "--nnodes", "3"], {})
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--tp", "8", "--nnodes", "3"]
