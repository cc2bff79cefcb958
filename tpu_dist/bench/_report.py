"""Statistics, result rows, the nccl-tests-style table and the JSON report.

A *row* is one (op, size, backend). Its time is the median over the timed calls of the per-call
time averaged over ranks (each rank times each call from its start to the end of ``wait()``;
calls are matched across ranks by their index), with the 10th and 90th percentiles as the
spread. algbw and busbw are computed from the median time (formulas in :mod:`._ops`).

Table, one block per op (2 ranks, tpu vs gloo, sizes in bytes; ``+-%`` is half the p10-p90
range relative to the median; ``xla`` is the bare program, ``host`` the c10d call minus it)::

    # all_reduce  float32 sum  2 ranks  (time: median us per call, +-: half p10..p90)
    #       size     count |      tpu   +-%  algbw  busbw     xla    host |     gloo   +-%  algbw  busbw | tpu/gloo
            1024       256 |    312.0   12%   0.00   0.00    95.1   216.9 |    110.2    8%   0.01   0.01 |     2.83

Sizes and bandwidths: GB/s = 1e9 bytes per second. A legend before the first block says what
every column means. ``host`` is never shown negative: when the bare program's median comes out
larger than the call's (they are timed separately), it shows ``~0``. A row whose ``+-%`` exceeds
:data:`NOISY_SPREAD` on some backend ends in ``noisy (BACKEND)``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["NOISY_SPREAD", "Row", "Stats", "format_header", "format_legend", "format_row", "format_summary", "stats"]

NOISY_SPREAD = 0.5
"""A row whose half p10..p90 range exceeds this fraction of its median is flagged ``noisy``."""


@dataclasses.dataclass(frozen=True)
class Stats:
    """Order statistics of per-call times, in seconds."""

    median: float
    p10: float
    p90: float
    min: float
    max: float
    mean: float
    n: int

    def to_json(self) -> dict[str, float | int]:
        """Microseconds, rounded to 0.1 us."""
        out: dict[str, float | int] = {
            k: round(v * 1e6, 1) for k, v in dataclasses.asdict(self).items() if k != "n"
        }
        out["n"] = self.n
        return out


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 1] of already sorted values."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats(samples: Sequence[float]) -> Stats:
    """Median, p10, p90, min, max, mean of ``samples`` (seconds).

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("stats() needs at least one sample, got none")
    ordered = sorted(samples)
    return Stats(
        median=statistics.median(ordered),
        p10=_percentile(ordered, 0.1),
        p90=_percentile(ordered, 0.9),
        min=ordered[0],
        max=ordered[-1],
        mean=statistics.fmean(ordered),
        n=len(ordered),
    )


def mean_over_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-call times averaged over ranks, call ``i`` of every rank being the same collective."""
    return [statistics.fmean(calls) for calls in zip(*per_rank)]


@dataclasses.dataclass(kw_only=True)
class Row:
    """One op at one size on one backend."""

    op: str
    backend: str
    bytes: int
    """Message size S (see :mod:`._config`)."""
    count: int
    """Elements of the message."""
    dtype: str
    nranks: int
    time: Stats
    algbw_gbytes_per_s: float
    busbw_gbytes_per_s: float
    first_call_s: float
    """The first call of this size (for tpu: includes tracing and compiling its programs)."""
    compiles_first_call: int | None = None
    """tpu only: programs compiled by the first call (``tpu_dist.collectives.compile_count``)."""
    compiles_steady: int | None = None
    """tpu only: programs compiled by every later call (warm-up, check, timed); should be 0."""
    xla_time: Stats | None = None
    """tpu only: the bare XLA program (:mod:`._xla`)."""
    xla_compile_s: float | None = None
    host_overhead_s: float | None = None
    """tpu only: median c10d call minus median bare program. Negative when the bare program's
    median came out larger (they are timed separately: noise); the table shows that as ``~0``."""
    ratio: float | None = None
    """Median time over the reference backend's median time at this size."""
    expected_busbw_gbytes_per_s: float | None = None
    """TPU devices only: the topology model's bound (:mod:`tpu_dist.mesh._bandwidth`)."""
    expected_basis: str | None = None
    check: str = "skipped"
    """``ok``, ``skipped`` or what was wrong."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": self.op,
            "backend": self.backend,
            "bytes": self.bytes,
            "count": self.count,
            "dtype": self.dtype,
            "nranks": self.nranks,
            "time_us": self.time.to_json(),
            "algbw_gbytes_per_s": self.algbw_gbytes_per_s,
            "busbw_gbytes_per_s": self.busbw_gbytes_per_s,
            "first_call_ms": round(self.first_call_s * 1e3, 3),
            "check": self.check,
        }
        if self.ratio is not None:
            out["ratio_to_reference"] = round(self.ratio, 4)
        if self.compiles_first_call is not None:
            out["compiles_first_call"] = self.compiles_first_call
            out["compiles_steady"] = self.compiles_steady
        if self.xla_time is not None:
            out["xla_time_us"] = self.xla_time.to_json()
            out["xla_compile_ms"] = round((self.xla_compile_s or 0.0) * 1e3, 3)
            out["host_overhead_us"] = round((self.host_overhead_s or 0.0) * 1e6, 1)
        if self.expected_busbw_gbytes_per_s is not None:
            out["expected_busbw_gbytes_per_s"] = self.expected_busbw_gbytes_per_s
            out["achieved_fraction"] = round(
                self.busbw_gbytes_per_s / self.expected_busbw_gbytes_per_s, 4
            )
            out["expected_basis"] = self.expected_basis
        return out


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f}"


def _half_spread(s: Stats) -> float:
    return (s.p90 - s.p10) / 2 / s.median if s.median > 0 else 0.0


def _spread(s: Stats) -> str:
    return f"{min(_half_spread(s) * 100, 999):4.0f}%"


def _host(seconds: float | None) -> str:
    """The host column: a duration, never negative. A bare program whose median exceeds the
    call's (noise: the two are timed separately) shows as ``~0``."""
    if seconds is None:
        return f"{'-':>9}"
    return f"{'~0':>9}" if seconds < 0 else _us(seconds)


def format_legend(backends: Sequence[str], reference: str) -> str:
    """What every column of the table means, printed once before the first block."""
    lines = [
        "# size: bytes, count: elements. Per backend: time = median us per call (each rank times "
        "each call from the call to the end of wait(), averaged over ranks); +-% = half the "
        "p10..p90 range, in % of the median; algbw = size / time, busbw = algbw x the op's "
        "nccl-tests factor, GB/s (1e9 bytes/s).",
    ]
    if "tpu" in backends:
        lines.append(
            "# tpu only: xla = the same collective as a bare jitted XLA program (no torch, no "
            "c10d); host = the tpu time minus the xla time, the cost of the c10d layer (~0 when "
            "the bare program's median came out larger: the difference is below the noise)."
        )
    others = [b for b in backends if b != reference]
    if others:
        lines.append(
            f"# {others[0][:5]}/{reference[:5]} = time over {reference}'s time at that size "
            "(below 1: faster)."
        )
    lines.append(
        f"# A row ending in 'noisy' has a +-% above {NOISY_SPREAD:.0%} on some backend: trust its "
        "times and ratio less (a loaded machine; more --iters help)."
    )
    return "\n".join(lines)


def format_header(
    op: str, dtype: str, nranks: int, backends: Sequence[str], reference: str, expected: bool
) -> str:
    """The two comment lines that open an op's block of the table."""
    reduction = " sum" if op in ("all_reduce", "reduce_scatter_tensor") else ""
    parts = ["#       size      count"]
    for b in backends:
        cols = f" | {b[:9]:>9}   +-%  algbw  busbw"
        if b == "tpu":
            cols += "       xla      host"
        if expected:
            cols += "   %exp"
        parts.append(cols)
    others = [b for b in backends if b != reference]
    if others:
        parts.append(" |" + "".join(f" {b[:5]}/{reference[:5]:<5}" for b in others))
    title = (
        f"# {op}  {dtype}{reduction}  {nranks} ranks  "
        "(time: median us per call; +-: half the p10..p90 range"
    )
    if "tpu" in backends:
        title += "; xla: bare XLA program; host: c10d call minus xla"
    return title + ")\n" + "".join(parts)


def format_row(rows: Sequence[Row], reference: str, expected: bool) -> str:
    """One table line: the rows of one (op, size), one per backend, in backend order."""
    first = rows[0]
    line = [f"{first.bytes:12d} {first.count:10d}"]
    for row in rows:
        cols = (
            f" | {_us(row.time.median)} {_spread(row.time)} "
            f"{row.algbw_gbytes_per_s:6.2f} {row.busbw_gbytes_per_s:6.2f}"
        )
        if row.backend == "tpu":
            if row.xla_time is not None:
                cols += f" {_us(row.xla_time.median)} {_host(row.host_overhead_s)}"
            else:
                cols += f" {'-':>9} {'-':>9}"
        if expected:
            exp = row.expected_busbw_gbytes_per_s
            cols += f" {100 * row.busbw_gbytes_per_s / exp:5.1f}%" if exp else f" {'-':>6}"
        line.append(cols)
    ratios = [r for r in rows if r.backend != reference]
    if ratios:
        line.append(" |" + "".join(f" {(r.ratio or 0.0):11.2f}" for r in ratios))
    noisy = [r.backend for r in rows if _half_spread(r.time) > NOISY_SPREAD]
    if noisy:
        line.append(f"   noisy ({', '.join(noisy)})")
    bad = [f"{r.backend}: {r.check}" for r in rows if r.check not in ("ok", "skipped")]
    if bad:
        line.append("   WRONG RESULT " + "; ".join(bad))
    return "".join(line)


def format_summary(op: str, rows: Sequence[Row]) -> str:
    """Per-backend lines under an op's block: first-call cost, compilations, host overhead."""
    lines = []
    for backend in dict.fromkeys(r.backend for r in rows):
        mine = [r for r in rows if r.backend == backend]
        first = ", ".join(f"{r.first_call_s * 1e3:.0f}" for r in mine)
        text = f"#   {backend}: first call per size (ms): {first}"
        if mine[0].compiles_first_call is not None:
            compiled = sum(r.compiles_first_call or 0 for r in mine)
            steady = sum(r.compiles_steady or 0 for r in mine)
            text += f"; programs compiled: {compiled} by first calls, {steady} in steady state"
        overheads = [r.host_overhead_s for r in mine if r.host_overhead_s is not None]
        if overheads:
            shown = [max(o, 0.0) * 1e6 for o in overheads]
            text += (
                f"; host overhead per call: median {statistics.median(shown):.0f} us "
                f"(range {min(shown):.0f}..{max(shown):.0f}"
            )
            below = sum(o < 0 for o in overheads)
            text += f"; {below} size(s) ~0, below the noise)" if below else ")"
        noisy = sum(_half_spread(r.time) > NOISY_SPREAD for r in mine)
        if noisy:
            text += f"; {noisy} noisy size(s)"
        lines.append(text)
    return "\n".join(lines)


def write_line(stream: TextIO, text: str) -> None:
    """Print and flush (rows stream out while the run goes on)."""
    stream.write(text + "\n")
    stream.flush()
