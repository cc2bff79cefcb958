"""What every rank runs: create the groups, then for each op and size time every backend.

All ranks run :func:`run_rank` with the same config (SPMD). Groups, created once:

* one process group per measured backend, each over all ranks (the "tpu" one is the default
  group when measured, since tpu_dist starts JAX with the default group; the others come from
  ``new_group(backend=...)``);
* one extra gloo group, *control*, for barriers and for gathering timings to rank 0, so that
  the measured groups carry nothing but the measured calls.

For each op, each size (every rank in the same order)::

    per backend: barrier, first call (timed; compilations counted), result check, warm-up
    tpu only:    compile the bare XLA program (:mod:`._xla`), warm it up
    R rounds:    per backend (and the bare program), in an order rotated every round:
                     barrier, then iters/R calls, each timed from call to end of wait()
    gather every rank's per-call times to rank 0 -> one table row per backend

Rank 0 prints the rows as they are measured and returns the report; the others return None.
"""

from __future__ import annotations

import gc
import os
import platform
import socket
import sys
import time
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist

from tpu_dist import _settings
from tpu_dist.bench._config import BenchConfig, element_count, format_bytes
from tpu_dist.bench._ops import OpCase, bus_factor, make_case
from tpu_dist.bench._report import (
    Row,
    format_header,
    format_legend,
    format_row,
    format_summary,
    mean_over_ranks,
    stats,
    write_line,
)

__all__ = ["SCHEMA", "run_rank"]

SCHEMA = "tpu_dist.bench/1"
"""The ``schema`` field of the JSON report."""

_XLA = "tpu:xla"


def _backend_names(config: BenchConfig) -> dict[str, str]:
    """Config backend name -> registered c10d name ("tpu" -> whatever tpu_dist registered)."""
    names = {}
    for backend in config.backends:
        if backend == "tpu":
            from tpu_dist.collectives import registered_name

            name = registered_name()
            if not name:
                raise RuntimeError(
                    "tpu_dist could not register its backend (the name is taken); set "
                    "TPU_DIST_BACKEND_NAME=tpu_dist and run again."
                )
            names[backend] = name
        else:
            names[backend] = backend
    return names


def environment() -> dict[str, Any]:
    """Versions and machine facts for the JSON report."""
    import jax

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "env": {
            k: os.environ[k]
            for k in (
                "XLA_FLAGS", "OMP_NUM_THREADS", _settings.PLATFORM.env, "JAX_PLATFORMS",
                "GLIBC_TUNABLES",
            )
            if k in os.environ
        },
    }


def run_rank(
    config: BenchConfig, rank: int, world_size: int, init_method: str
) -> dict[str, Any] | None:
    """Run the whole benchmark on this rank; rank 0 returns the report (see module doc)."""
    names = _backend_names(config)
    default = names["tpu"] if "tpu" in names else names[config.backends[0]]
    timeout = timedelta(seconds=config.timeout_s)
    dist.init_process_group(
        default, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        groups = {
            b: dist.group.WORLD if names[b] == default else dist.new_group(backend=names[b])
            for b in config.backends
        }
        control = dist.new_group(backend="gloo", timeout=timeout)
        return _Runner(config, rank, world_size, groups, control).run()
    finally:
        dist.destroy_process_group()


class _Runner:
    """Rank-local state of one run: groups, devices, the TPU topology (if any)."""

    def __init__(
        self,
        config: BenchConfig,
        rank: int,
        world_size: int,
        groups: dict[str, dist.ProcessGroup],
        control: dist.ProcessGroup,
    ) -> None:
        self.config = config
        self.rank = rank
        self.n = world_size
        self.groups = groups
        self.control = control
        self.devices = None
        self.topology = None
        self.topology_note = None
        if "tpu" in config.backends:
            from tpu_dist.collectives import global_devices

            self.devices = global_devices()
            if self.devices[0].platform == "tpu":
                self._load_topology()

    def _load_topology(self) -> None:
        from tpu_dist.mesh import Topology

        try:
            self.topology = Topology.from_devices(self.devices)
        except ValueError as err:
            self.topology_note = f"no busbw expectation: {err}"

    def _say(self, text: str, stream: TextIO | None = None) -> None:
        if self.rank == 0:
            write_line(stream or sys.stdout, text)

    def _progress(self, text: str) -> None:
        if self.rank == 0 and self.config.progress:
            write_line(sys.stderr, text)

    def run(self) -> dict[str, Any] | None:
        cfg = self.config
        env = environment()
        self._say(
            f"# tpu-dist-bench: {self.n} ranks, backends {', '.join(cfg.backends)}, "
            f"{cfg.dtype}, warm-up {cfg.warmup}, {cfg.rounds} rounds x {cfg.per_round} calls, "
            f"ratios against {cfg.reference}; torch {env['torch']}, jax {env['jax']}"
        )
        if self.topology is not None:
            self._say(f"# TPU topology: {self.topology.describe()}")
        elif self.topology_note:
            self._say(f"# {self.topology_note}")
        self._say(format_legend(cfg.backends, cfg.reference))
        rows: list[Row] = []
        started = time.perf_counter()
        total = len(cfg.ops) * len(cfg.sizes)
        step = 0
        for op in cfg.ops:
            self._say("")
            self._say(
                format_header(
                    op, cfg.dtype, self.n, cfg.backends, cfg.reference, self.topology is not None
                )
            )
            op_rows: list[Row] = []
            for size in cfg.sizes:
                step += 1
                self._progress(f"[{step}/{total}] {op} {format_bytes(size)}")
                measured = self._measure(op, size)
                if measured is not None:
                    op_rows.extend(measured)
                    self._say(format_row(measured, cfg.reference, self.topology is not None))
            if self.rank == 0:
                self._say(format_summary(op, op_rows))
            rows.extend(op_rows)
        if self.rank != 0:
            return None
        env["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        return {
            "schema": SCHEMA,
            "config": {
                "ops": list(cfg.ops),
                "backends": list(cfg.backends),
                "reference": cfg.reference,
                "sizes": list(cfg.sizes),
                "dtype": cfg.dtype,
                "nranks": self.n,
                "warmup": cfg.warmup,
                "iters": cfg.rounds * cfg.per_round,
                "rounds": cfg.rounds,
                "check": cfg.check,
                "xla_baseline": cfg.xla_baseline,
            },
            "environment": env,
            "topology": self.topology.describe() if self.topology is not None else None,
            "wall_s": round(time.perf_counter() - started, 3),
            "rows": [r.to_json() for r in rows],
        }

    # -- one op at one size ------------------------------------------------------------------

    def _barrier(self) -> None:
        dist.barrier(group=self.control)

    def _measure(self, op: str, size: int) -> list[Row] | None:
        from tpu_dist.collectives import compile_count

        cfg = self.config
        dtype = cfg.torch_dtype
        count = element_count(size, self.n, dtype.itemsize)
        cases: dict[str, OpCase] = {
            b: make_case(op, g, self.rank, self.n, count, dtype) for b, g in self.groups.items()
        }
        first: dict[str, float] = {}
        compiles_first: dict[str, int] = {}
        checks: dict[str, str] = {}
        steady_from = compile_count() if "tpu" in cases else 0
        for backend, case in cases.items():
            self._barrier()
            before = compile_count() if backend == "tpu" else 0
            start = time.perf_counter()
            case.call()
            first[backend] = time.perf_counter() - start
            if backend == "tpu":
                compiles_first[backend] = compile_count() - before
                steady_from = compile_count()
            if cfg.check:
                case.fill()
                case.call()
                checks[backend] = case.verify() or "ok"
                case.clear()
            for _ in range(cfg.warmup):
                case.call()
        calls = {b: c.call for b, c in cases.items()}
        xla_compile_s = None
        if "tpu" in cases and cfg.xla_baseline:
            from tpu_dist.bench._xla import make_xla_case

            self._barrier()
            xla = make_xla_case(op, self.devices, self.rank, count, dtype)
            xla_compile_s = xla.compile_s
            for _ in range(max(cfg.warmup, 1)):
                xla.call()
            calls[_XLA] = xla.call
        samples: dict[str, list[float]] = {k: [] for k in calls}
        order = list(calls)
        clock = time.perf_counter
        for round_index in range(cfg.rounds):
            shift = round_index % len(order)
            for key in order[shift:] + order[:shift]:
                call = calls[key]
                out = samples[key]
                self._barrier()
                for _ in range(cfg.per_round):
                    start = clock()
                    call()
                    out.append(clock() - start)
        compiles_steady = compile_count() - steady_from if "tpu" in cases else 0
        report = {
            "samples": samples,
            "first": first,
            "compiles_first": compiles_first,
            "compiles_steady": compiles_steady,
            "checks": checks,
        }
        gathered: list[Any] | None = [None] * self.n if self.rank == 0 else None
        dist.gather_object(report, gathered, dst=0, group=self.control)
        del cases, calls
        gc.collect()
        if self.rank != 0:
            return None
        return self._rows(op, count, dtype, gathered, xla_compile_s)

    def _rows(
        self,
        op: str,
        count: int,
        dtype: torch.dtype,
        gathered: list[dict[str, Any]],
        xla_compile_s: float | None,
    ) -> list[Row]:
        cfg = self.config
        nbytes = count * dtype.itemsize
        factor = bus_factor(op, self.n)
        times = {
            key: stats(mean_over_ranks([g["samples"][key] for g in gathered]))
            for key in gathered[0]["samples"]
        }
        expectation = None
        if self.topology is not None:
            from tpu_dist.mesh import expected_busbw

            expectation = expected_busbw(self.topology, range(self.n), op)
        rows = []
        for backend in cfg.backends:
            t = times[backend]
            algbw = nbytes / t.median / 1e9
            checks = [g["checks"].get(backend, "skipped") for g in gathered]
            wrong = [f"rank {r}: {c}" for r, c in enumerate(checks) if c not in ("ok", "skipped")]
            row = Row(
                op=op,
                backend=backend,
                bytes=nbytes,
                count=count,
                dtype=cfg.dtype,
                nranks=self.n,
                time=t,
                algbw_gbytes_per_s=algbw,
                busbw_gbytes_per_s=algbw * factor,
                first_call_s=max(g["first"][backend] for g in gathered),
                ratio=t.median / times[cfg.reference].median,
                check="; ".join(wrong) if wrong else checks[0],
            )
            if backend == "tpu":
                row.compiles_first_call = max(g["compiles_first"]["tpu"] for g in gathered)
                row.compiles_steady = max(g["compiles_steady"] for g in gathered)
                if _XLA in times:
                    row.xla_time = times[_XLA]
                    row.xla_compile_s = xla_compile_s
                    row.host_overhead_s = t.median - times[_XLA].median
                if expectation is not None:
                    row.expected_busbw_gbytes_per_s = expectation.busbw_gbytes_per_s
                    row.expected_basis = expectation.basis
            rows.append(row)
        return rows
