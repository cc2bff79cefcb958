"""tpu-dist-bench: the formulas and the TPU model (pure logic), and one short real run.

The real runs start together (a module fixture). The first starts 2 ranks through the console entry point (``python -m tpu_dist.bench``), tpu
vs gloo, every op at two tiny sizes with 2 timed calls, and checks the JSON: positive times,
algbw/busbw from the nccl-tests formulas for the known sizes, correct results, and no program
compiled after each size's first call (a steady-state loop compiles nothing new). Timings are
never asserted. ``benchmarks/train_step.py`` runs once per wrapper (FSDP2, DDP) on 2 ranks for a
few steps: it must finish and find the tpu and gloo losses equal up to rounding.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_dist.bench import OPS, BenchConfig, bus_factor, expected_busbw
from tpu_dist.bench._cli import build_parser, config_from_args
from tpu_dist.bench._config import element_count, parse_bytes, size_sweep
from tpu_dist.bench._report import stats
from tpu_dist.mesh import Topology

# -- pure logic ------------------------------------------------------------------------------


def test_bus_factors_match_nccl_tests() -> None:
    # nccl-tests PERFORMANCE.md, n = 4 ranks.
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert bus_factor(op, 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 4) == 1.0
    assert bus_factor("send_recv", 4) == 1.0


def test_sizes_and_counts() -> None:
    assert parse_bytes("4K") == 4096
    assert parse_bytes("64MiB") == 64 << 20
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="not a size in bytes"):
        parse_bytes("4 kilobytes")
    assert size_sweep(1024, 65536, 4) == (1024, 4096, 16384, 65536)
    assert element_count(1002, 2, 4) == 250  # 250 floats = 1000 bytes, even split
    assert element_count(4, 4, 4) == 4  # at least one element per rank


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown ops"):
        BenchConfig(ops=("allreduce_typo",))
    with pytest.raises(ValueError, match="baseline"):
        BenchConfig(backends=("tpu",), baseline="gloo")
    assert BenchConfig(backends=("tpu", "gloo")).reference == "gloo"
    args = build_parser().parse_args(["--ops", "ar,ag", "--sizes", "4K,1M", "-i", "7", "-r", "3"])
    config = config_from_args(args)
    assert config.ops == ("all_reduce", "all_gather_into_tensor")
    assert config.sizes == (4096, 1 << 20)
    assert config.per_round == 3  # 7 calls in 3 rounds -> 3 per round, 9 timed calls


def test_help_names_matplotlib_as_optional() -> None:
    text = build_parser().format_help()
    assert "matplotlib" in text and "--plot" in text


def test_stats() -> None:
    s = stats([3.0, 1.0, 2.0, 4.0, 100.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 100.0, 5)
    assert s.p10 == pytest.approx(1.4)


def test_table_never_shows_a_negative_host_time_and_flags_noisy_rows() -> None:
    """A measured run once printed ``host ... median -4534 us`` and spreads of 428 % unflagged."""
    from tpu_dist.bench._report import Row, format_legend, format_row, format_summary

    def row(backend: str, times: list[float], host: float | None) -> Row:
        return Row(op="all_reduce", backend=backend, bytes=1024, count=256, dtype="float32", nranks=2,
                   time=stats(times), algbw_gbytes_per_s=0.0, busbw_gbytes_per_s=0.0, first_call_s=0.01,
                   xla_time=stats([t + 1e-3 for t in times]) if host is not None else None,
                   host_overhead_s=host, ratio=1.0, check="ok")

    quiet = [100e-6] * 9 + [101e-6]
    noisy = [100e-6, 100e-6, 100e-6, 100e-6, 100e-6, 1e-3, 2e-3, 3e-3, 4e-3, 5e-3]
    line = format_row([row("tpu", noisy, -4534e-6), row("gloo", quiet, None)], "gloo", False)
    host = line.split("|")[1].split()[-1]
    assert host == "~0" and not re.search(r" -\d", line), line
    assert line.endswith("noisy (tpu)"), line
    assert "noisy" not in format_row([row("tpu", quiet, 5e-6), row("gloo", quiet, None)], "gloo", False)
    summary = format_summary("all_reduce", [row("tpu", noisy, -4534e-6), row("tpu", quiet, 20e-6)])
    assert "median 10 us (range 0..20; 1 size(s) ~0, below the noise)" in summary and "1 noisy" in summary
    legend = format_legend(["tpu", "gloo"], "gloo")
    assert "host = the tpu time minus the xla time" in legend and "'noisy'" in legend


def test_expected_busbw_model() -> None:
    # v5p 4x4x4: every axis wraps around; L = 1200 / 6 / 2 = 100 GB/s per link and direction.
    cube = Topology("v5p", "4x4x4")
    assert expected_busbw(cube, range(64), "all_reduce").busbw_gbytes_per_s == 600
    assert expected_busbw(cube, range(64), "send_recv").busbw_gbytes_per_s == 100
    # Ranks 0..3 are one host's 2x2x1 block: axes x and y, each wrapping -> 2 * 2 * 100.
    assert expected_busbw(cube, range(4), "all_reduce").busbw_gbytes_per_s == 400
    # v5e 2x4 has no wraparound: L = 400 / 4 / 2 = 50, two axes -> 100.
    v5e = Topology("v5e", "2x4")
    assert expected_busbw(v5e, range(8), "all_gather_into_tensor").busbw_gbytes_per_s == 100
    # Two v5e 1x1 slices: DCN only, 25 Gb/s = 3.125 GB/s.
    two = Topology("v5e", "1x1", num_slices=2)
    found = expected_busbw(two, range(2), "all_reduce")
    assert found.busbw_gbytes_per_s == pytest.approx(3.125) and "DCN" in found.basis
    # Two devices of one v7x chip: no link is used, no expectation.
    assert expected_busbw(Topology("v7x", "2x2x1"), [0, 1], "all_reduce") is None


# -- the real runs ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """The module's three real runs, started at once (each is mostly start-up and waiting on
    its two ranks): name -> (finished process, JSON path, PNG path or None)."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench.json"
    bench = [
        sys.executable, "-m", "tpu_dist.bench", "--nproc", "2", "--sizes", "1002,4K",
        "--iters", "2", "--rounds", "2", "--warmup", "1", "--json", str(out), "-q",
    ]
    plot = tmp / "bench.png"
    try:
        import matplotlib  # noqa: F401

        bench += ["--plot", str(plot)]
    except ImportError:
        plot = None
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"
    commands = {"bench": bench}
    for wrap in ("fsdp", "ddp"):
        commands[wrap] = [
            sys.executable, "-m", "_tpu_dist_launch", "--nproc-per-node", "2", str(script),
            "--wrap", wrap, "--rounds", "2", "--steps-per-round", "1", "--warmup", "1",
        ]
    procs = {
        name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for name, command in commands.items()
    }
    finished = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            finished[name] = (
                subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out, plot
            )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return finished


def test_two_ranks_end_to_end(runs: dict) -> None:
    proc, out, plot = runs["bench"]
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "tpu/gloo" in proc.stdout
    assert "[Gloo]" not in proc.stdout  # jaxlib gloo's connection lines, dropped in the ranks
    report = json.loads(out.read_text())
    assert report["schema"] == "tpu_dist.bench/1"
    rows = report["rows"]
    assert {(r["op"], r["backend"]) for r in rows} == {
        (op, b) for op in OPS for b in ("tpu", "gloo")
    }
    assert sorted({r["bytes"] for r in rows}) == [1000, 4096]  # 1002 -> 250 floats
    for r in rows:
        where = f"{r['backend']} {r['op']} {r['bytes']}"
        assert r["check"] == "ok", where
        assert r["count"] * 4 == r["bytes"], where
        t = r["time_us"]
        assert 0 < t["min"] <= t["median"] <= t["max"], where
        assert t["n"] == 2, where
        algbw = r["bytes"] / (t["median"] * 1e-6) / 1e9
        assert r["algbw_gbytes_per_s"] == pytest.approx(algbw, rel=1e-3), where
        assert r["busbw_gbytes_per_s"] == pytest.approx(
            r["algbw_gbytes_per_s"] * bus_factor(r["op"], 2)
        ), where
        if r["backend"] == "tpu":
            assert r["compiles_first_call"] >= 1, where
            assert r["compiles_steady"] == 0, f"{where}: compiled in steady state"
            assert r["xla_time_us"]["median"] > 0, where
        else:
            assert r["ratio_to_reference"] == 1.0, where
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_train_step_benchmark_runs_and_backends_agree(runs: dict, wrap: str) -> None:
    proc, _, _ = runs[wrap]
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "losses on tpu and gloo agree" in proc.stdout, proc.stdout[-3000:]
    assert "step time tpu/gloo:" in proc.stdout, proc.stdout[-3000:]
