"""``tpu-launch --compile-only``: recording, TPU compilation, report and exit codes.

The job (``tests/compile_only_job.py``: FSDP2 x TP, DDP, object collectives, p2p, all-to-all)
runs once on 4 real gloo ranks whose every process-group call is counted, and under
``--compile-only`` as ranks 0 and 3 of the same 4-device topology: the recording must see
exactly the calls, groups and bytes gloo saw. A job written for TorchTPU
(``tests/compile_only_tpu_job.py``: tensors on "tpu") runs on the emulated device and on CPU
tensors: the same report. A 2-slice run checks the DCN column, a run
with a reduce-scatter larger than a v5e's HBM checks that a program the TPU compiler rejects is
reported with the script line that issued it, and TorchTitan's mesh (flattened dimensions,
``tests/compile_only_flat_job.py``) must compile on v5e. The runs (each one process, or four for gloo)
go as many at once as the machine has cores; libtpu's compile-only devices stand in for the TPU.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="compile-only mode compiles with libtpu (pip install libtpu)")

from tpu_dist.compile_job import estimate_seconds  # noqa: E402
from tpu_dist.mesh import Topology  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "compile_only_job.py")
CRASH_JOB = os.path.join(ROOT, "tests", "compile_only_crash_job.py")
TPU_JOB = os.path.join(ROOT, "tests", "compile_only_tpu_job.py")
FLAT_JOB = os.path.join(ROOT, "tests", "compile_only_flat_job.py")
EXAMPLES = [os.path.join(ROOT, "examples", name) for name in ("train_fsdp.py", "train_fsdp_tp.py")]
PIPELINE = os.path.join(ROOT, "examples", "train_pp.py")
LAUNCH = [sys.executable, "-m", "_tpu_dist_launch"]  # what tpu-launch runs

# The gloo process-group method -> the name the recording uses (torch's API name).
_TORCH_NAME = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all",
}
# Ops whose per-rank input bytes are the same on both sides (data-movement programs pad or send
# a full block from every rank: scatter sends zeros from non-roots, barrier a token).
_SAME_BYTES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "broadcast", "all_to_all_single",
}


def _env(*, path: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *path, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


_FAKE_TORCHTPU = {
    "torch_tpu/__init__.py": "",
    "torch_tpu/_loader.py": '''
"""TorchTPU 0.2.0's loader as it acts on a TPU host, inside `import torch` (its entry point in
torch.backends): PrivateUse1 renamed "tpu", its torch.tpu, its c10d backends "tpu" and
"tpu_dist". A stand-in for tests/test_compile_only.py: without a TPU the real one loads nothing."""
import types

import torch
import torch.distributed as dist


def _create(store, rank, size, timeout):
    raise RuntimeError("the stand-in TorchTPU's process group was created")


def load():
    torch.utils.rename_privateuse1_backend("tpu")
    module = types.ModuleType("torch.tpu")
    module.loaded_by = "torch_tpu"
    module.is_available = lambda: True
    torch._register_device_module("tpu", module)
    for name in ("tpu", "tpu_dist"):
        dist.Backend.register_backend(name, _create, devices=["tpu"])
''',
    "torch_tpu-0.2.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch_tpu\nVersion: 0.2.0\n",
    "torch_tpu-0.2.0.dist-info/entry_points.txt": (
        "[torch.backends]\ntorch_tpu = torch_tpu._loader:load\n"),
}
"""An installed torch-tpu that loads (as on a TPU host), on the path of the compile-only run of
the TorchTPU job: compile-only mode must not load it (tpu-launch starts the job with
TORCH_DEVICE_BACKEND_AUTOLOAD=0 and the emulation refuses ``import torch_tpu``)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, dict | None]]:
    """Every launch of this module: name -> (exit code, output, JSON report).

    As many run at once as the machine has cores, the longest first: all eight at once took more
    CPU and more time than two at a time on two cores (67-82 CPU-s and 35-42 s against 58-61
    CPU-s and 30-32 s, docs/decisions/0030-test-suite-time.md): each is a busy process from its
    start, nothing in it waits."""
    tmp = tmp_path_factory.mktemp("compile_only")
    counts = tmp / "counts"
    counts.mkdir()
    torchtpu = tmp / "torchtpu"
    for name, text in _FAKE_TORCHTPU.items():
        (torchtpu / name).parent.mkdir(parents=True, exist_ok=True)
        (torchtpu / name).write_text(text)
    commands = {  # longest first (alone: 9 s for the first three, 5-7 s for the others)
        "crash_in_slice": ([*LAUNCH, "--emulate", "tpu7x:16x16x32", "--compile-only"], _env()),
        # The launcher runs the compile-only job itself, except where it cannot or is told not
        # to: here (TPU_DIST_LAUNCH_PRELOAD=0) a fresh process runs it, with the same recording.
        "rank3": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--compile-only", "--compile-rank", "3"],
                  _env(TPU_DIST_LAUNCH_PRELOAD="0")),
        "crash": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--num-slices", "4", "--compile-only"],
                  _env()),
        "dcn": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--num-slices", "2", "--compile-only"],
                _env()),
        "too_big": ([*LAUNCH, "--emulate", "v5e:2x2", "--compile-only"], _env()),
        "flattened_v5e": ([*LAUNCH, "--emulate", "v5e:4x4", "--compile-only"], _env()),
        # A script written for TorchTPU (tensors on "tpu"), with torch-tpu installed (a
        # stand-in that loads), and the same script on CPU tensors without the emulation.
        "torchtpu": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--compile-only"],
                     _env(path=(str(torchtpu),))),
        "torchtpu_on_cpu": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--compile-only",
                             "--tpu-device", "none"], _env()),
        "rank0": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--compile-only"], _env()),
        "pipeline": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--compile-only"], _env()),
        "rank0_real": ([*LAUNCH, "--emulate", "v5p:2x2x1", "--compile-only", "--tensors", "real"],
                       _env()),
        "gloo": (
            [*LAUNCH, "--nproc-per-node", "4", JOB, "--backend", "countgloo",
             "--counts-dir", str(counts)],
            _env(TPU_DIST_TOPOLOGY="v5p:2x2x1"),
        ),
    }
    extra_args = {
        "dcn": ["--dcn"], "too_big": ["--too-big"], "crash": ["--partial-slices"],
        "pipeline": ["--schedule", "Interleaved1F1B", "--dp", "2", "--steps", "2"],
        "torchtpu": ["--facts", str(tmp / "torchtpu.facts.json")],
        "torchtpu_on_cpu": ["--device", "cpu", "--facts", str(tmp / "torchtpu_on_cpu.facts.json")],
    }

    def run(name: str) -> tuple[int, int, str, dict | None]:
        cmd, env = commands[name]
        report = tmp / f"{name}.json"
        if name != "gloo":
            job = {"crash_in_slice": CRASH_JOB, "flattened_v5e": FLAT_JOB,
                   "pipeline": PIPELINE, "torchtpu": TPU_JOB, "torchtpu_on_cpu": TPU_JOB,
                   }.get(name, JOB)
            cmd = [*cmd, "--compile-report", str(report), job, *extra_args.get(name, [])]
        proc = subprocess.Popen(
            cmd, env=env, cwd=str(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        data = json.loads(report.read_text()) if report.exists() else None
        return proc.pid, proc.returncode, out, data

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = dict(zip(commands, pool.map(run, commands)))
    results = {name: (code, out, data) for name, (_, code, out, data) in done.items()}
    results["pids"] = {name: pid for name, (pid, *_) in done.items()}
    results["gloo_counts"] = {
        rank: json.loads((counts / f"rank{rank}.json").read_text())
        for rank in range(4) if (counts / f"rank{rank}.json").exists()
    }
    results["gloo_device"] = {
        rank: json.loads((counts / f"rank{rank}.device.json").read_text())
        for rank in range(4) if (counts / f"rank{rank}.device.json").exists()
    }
    results["facts"] = {
        name: json.loads((tmp / f"{name}.facts.json").read_text())
        for name in ("torchtpu", "torchtpu_on_cpu") if (tmp / f"{name}.facts.json").exists()
    }
    return results


def _recorded(report: dict) -> tuple[collections.Counter, collections.Counter]:
    """Calls and bytes per torch op (a send's or recv's header program is not a call of its
    own: the backend runs one before every message's data)."""
    calls, data = collections.Counter(), collections.Counter()
    for row in report["collectives"]:
        if row["op"].endswith(" (header)"):
            continue
        calls[row["op"]] += row["count"]
        if row["op"] in _SAME_BYTES:
            data[row["op"]] += row["count"] * row["bytes_per_rank"]
    return calls, data


def _seen_by_gloo(entries: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    calls, data = collections.Counter(), collections.Counter()
    for entry in entries:
        op = _TORCH_NAME.get(entry["method"], entry["method"])
        calls[op] += 1
        if op in _SAME_BYTES:
            data[op] += entry["bytes"]
    return calls, data


@pytest.mark.parametrize("rank", [0, 3])
def test_recording_matches_what_gloo_sees(runs: dict, rank: int) -> None:
    code, out, report = runs[f"rank{rank}"]
    assert code == 0, out
    assert runs["gloo"][0] == 0, runs["gloo"][1]
    assert report["rank"] == rank and report["num_devices"] == 4
    ours_calls, ours_bytes = _recorded(report)
    gloo_calls, gloo_bytes = _seen_by_gloo(runs["gloo_counts"][rank])
    assert ours_calls == gloo_calls
    assert ours_bytes == gloo_bytes
    assert "VALUES ARE NOT MEANINGFUL" in out and "no data moved" in out


def test_flattened_dimensions_of_a_torch_mesh_compile_on_v5e(runs: dict) -> None:
    """TorchTitan's mesh on 16 v5e chips: FSDP2 over the flattened ``dp_shard_cp``, the loss
    over the flattened ``dp_cp`` (groups of 4, part of the slice). Registered after
    flattening, they run as family programs, which compile (their groups' own programs do not:
    ``device assignment should include all slice devices``)."""
    code, out, report = runs["flattened_v5e"]
    assert code == 0, out
    rows = report["collectives"]
    assert rows and all(row["compiled"] for row in rows), [r for r in rows if not r["compiled"]]
    dims = {row["mesh_dim"] for row in rows}
    assert {"tp", "dp_shard_cp", "dp_cp"} <= dims, dims
    for row in rows:
        if row["mesh_dim"] in ("dp_shard_cp", "dp_cp"):
            assert (row["group_size"], row["family_groups"]) == (4, 4), row


def test_a_pipeline_with_fsdp_compiles_every_program(runs: dict) -> None:
    """``examples/train_pp.py`` (Interleaved1F1B, two stages a rank, on a (pp 2, dp 2) mesh
    with FSDP2) under --compile-only: every send and recv (each with its header program) and
    FSDP's collectives over dp are recorded and compile."""
    code, out, report = runs["pipeline"]
    assert code == 0, out
    rows = report["collectives"]
    assert rows and all(row["compiled"] for row in rows), [r for r in rows if not r["compiled"]]
    calls = collections.Counter()
    for row in rows:
        calls[row["op"]] += row["count"]
    for op in ("send", "recv"):
        assert calls[op] > 0 and calls[f"{op} (header)"] == calls[op], calls
    dp_ops = {row["op"] for row in rows if row["mesh_dim"] == "dp"}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= dp_ops, dp_ops
    assert all(row["group_size"] == 2 for row in rows if row["op"].startswith(("send", "recv")))


def test_the_launcher_forks_the_job_unless_told_not_to(runs: dict) -> None:
    """``tpu-launch --compile-only`` runs the job in a child forked from itself (it imported
    torch already: about 2 CPU-s less than a fresh one), with torch's thread count set from the
    job's ``OMP_NUM_THREADS``; with ``TPU_DIST_LAUNCH_PRELOAD=0`` a fresh child runs it (rank3).
    Both record what gloo sees (test_recording_matches_what_gloo_sees)."""

    def job(name: str) -> dict[str, str]:
        code, out, _ = runs[name]
        assert code == 0, out
        line = next(line for line in out.splitlines() if line.startswith("JOB "))
        return dict(field.split("=", 1) for field in line.split()[1:])

    launcher = {name: str(pid) for name, pid in runs["pids"].items()}
    for name in ("rank0", "rank0_real", "rank3"):
        assert job(name)["ppid"] == launcher[name], (name, job(name), launcher[name])
        assert job(name)["fresh"] == str(name == "rank3"), (name, job(name))
    for name in ("rank0", "rank0_real", "rank3"):
        found = job(name)
        if found["omp"].isdigit():
            assert found["torch_threads"] == found["omp"], (name, found)


def test_a_variable_read_at_start_up_needs_a_fresh_process() -> None:
    """The launcher's environment against the job's: the rank, topology, JAX and libtpu
    variables may differ (read after start-up); ``--default-for-cpu``'s variable, which
    ``import tpu_dist`` reads, or a variable the job lacks, may not."""
    from tpu_dist.launch._compile_only import _LATE_VARS
    from tpu_dist.launch._zygote import early_differences

    def _early_vars_changed(env: dict[str, str], launcher: dict[str, str]) -> list[str]:
        return early_differences(env, launcher, _LATE_VARS)

    launcher = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "4"}
    job = {**launcher, "RANK": "3", "WORLD_SIZE": "4", "TPU_DIST_TOPOLOGY": "v5p:2x2x1",
           "TPU_DIST_NUM_SLICES": "1", "TPU_DIST_COMPILE_ONLY": "1", "JAX_PLATFORMS": "cpu",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "OMP_NUM_THREADS": "1"}
    assert _early_vars_changed(job, launcher) == []
    assert _early_vars_changed({**job, "TPU_DIST_DEFAULT_FOR_CPU": "1"}, launcher) == [
        "TPU_DIST_DEFAULT_FOR_CPU"]
    assert _early_vars_changed({k: v for k, v in job.items() if k != "PATH"}, launcher) == ["PATH"]


def test_fake_tensors_record_what_real_tensors_do(runs: dict) -> None:
    # The default (--tensors fake: the job's large tensors hold no data) records the same
    # collectives, with the same groups, sizes and counts, as a run with real tensors.
    fake_code, fake_out, fake = runs["rank0"]
    real_code, real_out, real = runs["rank0_real"]
    assert fake_code == 0 and real_code == 0, (fake_out, real_out)
    assert "ran with fake tensors" in fake_out and "ran with fake tensors" not in real_out

    def rows(report: dict) -> list[tuple]:
        return [(r["op"], r["reduce_op"], r["group_size"], r["mesh_dim"], r["bytes_per_rank"],
                 r["dtype"], r["count"], r["program"]) for r in report["collectives"]]

    assert rows(fake) == rows(real)


def test_a_torchtpu_script_records_what_it_does_on_cpu_tensors(runs: dict) -> None:
    """The job written for TorchTPU (tensors on "tpu:LOCAL_RANK", torch.tpu.set_device,
    init_process_group() with no backend, a torch DeviceMesh on "tpu", FSDP2 x TP, two steps,
    c10d collectives, then "cpu:gloo,tpu:tpu", "tpu:tpu,cpu:gloo" and "tpu" groups) against the
    same job on CPU tensors without the emulation: the same collectives (op, group, dimension,
    bytes, dtype, calls, program, who issued them, the script line), the same step (FLOPs,
    model FLOPs, tokens, communication, the bound) and the same memory, but for what a TPU
    keeps on its host: AdamW's step counters (4 bytes a parameter: CPU tensors unless
    capturable or fused) and DTensor's RNG state, and what TorchTPU's fused attention keeps
    that the CPU's flash kernel does not (its RNG seed and offset, 16 bytes a layer)."""
    (tpu_code, tpu_out, tpu), (cpu_code, cpu_out, cpu) = runs["torchtpu"], runs["torchtpu_on_cpu"]
    assert tpu_code == 0, tpu_out
    assert cpu_code == 0, cpu_out

    def rows(report: dict) -> list[tuple]:
        return [(r["op"], r["reduce_op"], r["group_size"], r["mesh_dim"], r["bytes_per_rank"],
                 r["dtype"], r["count"], r["program"], r["origin"], r["first_call"], r["compiled"])
                for r in report["collectives"]]

    assert rows(tpu) == rows(cpu)
    assert {"scatter", "reduce_scatter_tensor", "all_gather_into_tensor_coalesced",
            "all_to_all_single", "broadcast", "barrier"} <= {r[0] for r in rows(tpu)}
    step_tpu, step_cpu = tpu["step"], cpu["step"]
    for field in ("flops_per_device", "model_flops_per_device", "tokens_per_device",
                  "comm_seconds", "exposed_comm_seconds", "step_seconds", "collectives"):
        assert step_tpu[field] == step_cpu[field], field
    mem_tpu, mem_cpu = step_tpu["memory_bytes"], step_cpu["memory_bytes"]
    assert mem_tpu["Parameter"] > 0
    for kind in (set(mem_tpu) | set(mem_cpu)) - {"Optstate", "Activation"}:
        assert mem_tpu.get(kind) == mem_cpu.get(kind), kind
    params = runs["facts"]["torchtpu"]["optimizer_params"]
    assert mem_cpu["Optstate"] - mem_tpu["Optstate"] == 4 * params
    assert 0 <= mem_tpu["Activation"] - mem_cpu["Activation"] <= 16
    # The per-device configs: torch keeps the first Python group, the recording one.
    assert runs["facts"]["torchtpu"]["configs"] == [
        "cpu:gloo,tpu:tpu", "tpu:tpu,cpu:gloo", "cpu:tpu,tpu:tpu"]
    assert runs["facts"]["torchtpu"]["backend_config"] == "tpu:tpu"


def test_the_emulated_torch_tpu_answers_as_torchtpu(runs: dict) -> None:
    """``torch.tpu`` of the emulation against TorchTPU 0.2.0's (its ``_device_module.py`` and
    ``hardware.py``, read from the wheel): on a v5p 2x2x1 host, rank 0 is bound to device 0
    of the host's 4; "TPU v5p", 95 GiB of HBM a device; set_device to another index, or to a
    non-TPU device, raises its ValueError; 20 AMP dtypes; torch's available device type and
    accelerator are "tpu". The memory statistics are the step meter's tensor bytes on the
    device (the peak of the run, then the current bytes after a reset). torch-tpu is
    installed (a stand-in that loads inside ``import torch``) and is not loaded."""
    code, out, report = runs["torchtpu"]
    assert code == 0, out
    facts = runs["facts"]["torchtpu"]
    assert facts["available_device_type"] == "tpu" and facts["accelerator"] == "tpu"
    assert facts["is_available"] is True and facts["emulated"] is True
    assert (facts["device_count"], facts["current_device"]) == (4, 0)
    assert facts["device_name"] == "TPU v5p"
    assert facts["properties"] == ["TPU v5p", 95 * 2**30, 1]
    assert facts["set_same"] is None and facts["synchronize"] is None
    assert facts["set_other"] == (
        "ValueError: Cannot set TPU device to index 1, current process is bound to device "
        "index 0. Changing the active TPU device within a process is not supported.")
    assert facts["set_cuda"] == "ValueError: Invalid device type cuda"
    assert facts["amp_dtypes"] == 20 and facts["rng_state"] == [16]
    assert facts["tensor_is_tpu"] is True
    stats = facts["memory_stats"]
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 0
    assert stats["active_bytes.all.peak"] == stats["reserved_bytes.all.peak"] == facts[
        "max_memory_allocated"] >= report["step"]["tensor_peak_bytes"] > 0
    assert facts["peak_after_reset"] == stats["allocated_bytes.all.current"]
    assert facts["import_torch_tpu"].startswith("ModuleNotFoundError: No module named 'torch_tpu'")
    assert "not emulated" in facts["not_emulated"]


def test_a_normal_run_sees_no_tpu_device(runs: dict) -> None:
    """The emulation stays in compile-only mode: the real 4-rank run in the same environment
    (tpu-launch, gloo) has no "tpu" device, no torch.tpu, no accelerator, no "tpu" entry in
    torch's device-backend map."""
    assert runs["gloo"][0] == 0, runs["gloo"][1]
    assert sorted(runs["gloo_device"]) == [0, 1, 2, 3]
    for facts in runs["gloo_device"].values():
        assert facts == {"torch_tpu": False, "privateuse1": "privateuseone", "accelerator": "cpu",
                         "tpu_in_device_map": False}


def test_report_fields_and_every_program_compiles(runs: dict) -> None:
    code, out, report = runs["rank0"]
    assert code == 0, out
    assert report["topology"] == "v5p:2x2x1" and report["num_slices"] == 1
    fields = {"op", "reduce_op", "group_size", "mesh_dim", "crosses_dcn", "bytes_per_rank",
              "dtype", "count", "compiled", "hlo_collectives", "compile_seconds", "temp_bytes",
              "est_seconds"}
    for row in report["collectives"]:
        assert fields <= set(row), row
        assert row["compiled"] and row["hlo_collectives"], row
        assert row["error"] is None
        # The user's line (the job or the example code it calls), never tpu_dist's or torch's.
        assert row["first_call"].split(":")[0] in (JOB, *EXAMPLES), row
    dims = {row["mesh_dim"] for row in report["collectives"]}
    assert {"dp", "tp"} <= dims
    ops = {row["op"] for row in report["collectives"]}
    assert {"send", "all_to_all_single", "reduce_scatter_tensor", "barrier"} <= ops


def test_dcn_column_two_slices(runs: dict) -> None:
    code, out, report = runs["dcn"]
    assert code == 0, out
    assert report["num_slices"] == 2 and report["num_devices"] == 8
    by_dim = collections.defaultdict(set)
    for row in report["collectives"]:
        by_dim[row["mesh_dim"]].add(row["crosses_dcn"])
    # dcn_mesh_shape=(2, 1): dp pairs the two slices, tp stays on one host's chips.
    assert by_dim["dp"] == {True}
    assert by_dim["tp"] == {False}
    topo = Topology.parse("v5p:2x2x1", 2)
    for row in report["collectives"]:
        if row["mesh_dim"] == "dp" and row["op"] == "reduce_scatter_tensor":
            # The DCN share dominates: over ICI alone the same bytes take far less. (Half the
            # message crosses DCN: 2 ranks a slice, as libtpu splits such a group.)
            ici_only = estimate_seconds("reduce_scatter", topo, [0, 1], row["bytes_per_rank"])
            assert row["est_seconds"] > 5 * ici_only


def test_uncompilable_program_is_named_with_its_line(runs: dict) -> None:
    code, out, report = runs["too_big"]
    assert code == 1, out
    failed = [row for row in report["collectives"] if not row["compiled"]]
    assert len(failed) == 1, report
    (row,) = failed
    assert row["op"] == "all_reduce" and row["bytes_per_rank"] == 9 << 30
    assert "HBM" in row["error"]
    with open(JOB) as f:
        line = next(i for i, text in enumerate(f, 1) if "dist.all_reduce(big" in text)
    assert row["first_call"].startswith(f"{JOB}:{line}")
    assert "FAILED all_reduce" in out and "did not compile" in out
    assert all(r["compiled"] for r in report["collectives"] if r is not row)


def test_a_compiler_crash_fails_its_program_not_the_report(runs: dict) -> None:
    code, out, report = runs["crash"]
    assert code == 1, out
    failed = [row for row in report["collectives"] if not row["compiled"]]
    assert [(row["op"], row["group_size"]) for row in failed] == [("all_reduce", 8)], report
    assert "crashed" in failed[0]["error"]
    # The programs after it were compiled by a new compiler process.
    barrier = [row for row in report["collectives"] if row["op"] == "barrier"]
    assert barrier and barrier[0]["compiled"] and barrier[0]["crosses_dcn"]


def test_a_compiler_crash_within_one_slice_is_reported_and_the_rest_compiles(runs: dict) -> None:
    # Every program compiles in the crash-isolating child, not only groups across slices:
    # libtpu's SIGFPE on this one-slice group used to end the run with no report.
    code, out, report = runs["crash_in_slice"]
    assert code == 1, out
    assert report is not None, out
    rows = {row["group_size"]: row for row in report["collectives"]}
    assert sorted(rows) == [4, 8192, 16384], report
    assert not rows[8192]["compiled"] and "SIGFPE" in rows[8192]["error"], rows[8192]
    assert rows[8192]["first_call"].startswith(f"{CRASH_JOB}:"), rows[8192]
    assert rows[4]["compiled"] and rows[16384]["compiled"], report
    assert "FAILED all_reduce over 8192 devices" in out


def test_bad_requests_exit_2_before_starting() -> None:
    for args, expected in (
        (["--compile-only", JOB], "pass --emulate"),
        (["--emulate", "v5p:2x2x1", "--compile-only", "--compile-rank", "4", JOB],
         "outside 0..3"),
    ):
        proc = subprocess.run([*LAUNCH, *args], env=_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr


def test_estimate_follows_the_bandwidth_model() -> None:
    """Bandwidth plus latency (tpu_dist/compile_job/_estimate.py), on a 4-chip wrapped ring.

    v5p 4x4x4, 4 chips along x: L = 1200 / 6 / 2 = 100 GB/s per link and direction, a wrapped
    ring carries 2 L = 200 GB/s; a bidirectional ring of 4 chips is 4 // 2 = 2 hops of 1 us.
    reduce_scatter of b = 1 MiB: 0.75 b / 200e9 = 3.93 us + 2 us = 5.93 us. all_reduce = a
    reduce-scatter then an all-gather: twice that (bandwidth and hops). Twice the bytes: twice
    the bandwidth term, the same latency. all_gather of b per rank: S = 4 b, four times the
    bandwidth term, the same 2 hops.
    """
    topo = Topology.parse("v5p:4x4x4")
    ring = [int(r) for r in topo.rank_grid()[0, :, 0, 0, 0]]  # 4 chips along x: a wrapped ring
    b = 1 << 20
    bw = 0.75 * b / 200e9
    rs = estimate_seconds("reduce_scatter", topo, ring, b)
    assert rs == pytest.approx(bw + 2e-6)
    assert estimate_seconds("allreduce", topo, ring, b) == pytest.approx(2 * rs)
    assert estimate_seconds("reduce_scatter", topo, ring, 2 * b) == pytest.approx(2 * bw + 2e-6)
    assert estimate_seconds("allgather", topo, ring, b) == pytest.approx(4 * bw + 2e-6)
    # Two slices: the DCN cap (50 Gb/s per chip) rules: 2 * (1/2) * b / 6.25e9, plus one DCN
    # step (ceil(log2 2)) of 10 us per pass, two passes.
    two = Topology.parse("v5p:4x4x4", 2)
    across = [0, two.num_devices // 2]
    assert estimate_seconds("allreduce", two, across, b) == pytest.approx(b / 6.25e9 + 20e-6)
    # TPU7x's two TensorCores of one chip use no link.
    assert estimate_seconds("allreduce", Topology.parse("tpu7x:2x2x1"), [0, 1], b) is None


_FORKED_COMPILER = """
import json
from tpu_dist.collectives import ProgramKey
from tpu_dist.compile_job._compile import Compiler
from tpu_dist.mesh import Topology

def child_runs_this_command(compiler):
    with open(f"/proc/{compiler._proc.pid}/cmdline", "rb") as a, open("/proc/self/cmdline", "rb") as b:
        return a.read() == b.read()

topology = Topology.parse("v5p:2x2x1")
key = ProgramKey("allreduce", (0, 1, 2, 3), ((1024, "float32"),), ("SUM",))
found = {}
for case in ("before JAX starts", "after JAX started"):
    if case == "after JAX started":
        import jax
        jax.devices()  # this process's CPU backend: its threads run now
    compiler = Compiler(topology, fork=True)
    compiler.start()
    ok, ops, _, _, error = compiler.compile(key)
    forked = child_runs_this_command(compiler)  # after its answer: a spawned child exec'd by then
    compiler.close()
    found[case] = [forked, ok, list(ops), error]
print(json.dumps(found))
"""


def test_the_compiler_is_forked_only_before_jax_starts() -> None:
    """The compile-only process forks its compiler before libtpu or JAX start threads (a fresh
    one imports torch and JAX again, about 2 CPU-s); once a JAX backend runs, a fork could copy
    a lock its threads hold, so a fresh process (spawn) compiles. Both compile the program."""
    proc = subprocess.run([sys.executable, "-c", _FORKED_COMPILER], env=_env(JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {
        "before JAX starts": [True, True, ["all-reduce"], None],
        "after JAX started": [False, True, ["all-reduce"], None],
    }, found
