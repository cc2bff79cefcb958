"""``--plot``: a PNG of time and bus bandwidth against message size, one row of panels per op.

matplotlib is optional (``pip install matplotlib``); it is imported only here, only when a plot
is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["write_plot"]


def write_plot(report: Mapping[str, Any], path: str) -> None:
    """Draw ``report`` (the JSON report as a dict) to the PNG file ``path``.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(
            "--plot needs matplotlib, which tpu_dist does not install; run "
            "`pip install matplotlib` or drop --plot (the JSON report has every figure)."
        ) from err
    rows = report["rows"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        ax_t, ax_bw = axes[i]
        for backend in backends:
            mine = sorted((r for r in rows if r["op"] == op and r["backend"] == backend),
                          key=lambda r: r["bytes"])
            if not mine:
                continue
            sizes = [r["bytes"] for r in mine]
            med = [r["time_us"]["median"] for r in mine]
            lo = [r["time_us"]["median"] - r["time_us"]["p10"] for r in mine]
            hi = [r["time_us"]["p90"] - r["time_us"]["median"] for r in mine]
            (line,) = ax_t.plot(sizes, med, marker="o", label=backend)
            ax_t.errorbar(sizes, med, yerr=[lo, hi], fmt="none", ecolor=line.get_color())
            ax_bw.plot(sizes, [r["busbw_gbytes_per_s"] for r in mine], marker="o", label=backend)
            if any("xla_time_us" in r for r in mine):
                ax_t.plot(sizes, [r["xla_time_us"]["median"] for r in mine], linestyle="--",
                          color=line.get_color(), label=f"{backend} (bare XLA program)")
            exp = [r.get("expected_busbw_gbytes_per_s") for r in mine]
            if all(e is not None for e in exp):
                ax_bw.plot(sizes, exp, linestyle=":", color="gray", label="expected (model)")
        for ax in (ax_t, ax_bw):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("message size (bytes)")
        ax_t.set_ylabel("time per call (us)")
        ax_bw.set_ylabel("busbw (GB/s)")
        ax_t.set_title(f"{op}: time (median, p10..p90)")
        ax_bw.set_title(f"{op}: bus bandwidth")
        ax_t.legend(fontsize="small")
    nranks = report["config"]["nranks"]
    fig.suptitle(f"tpu-dist-bench, {nranks} ranks, {report['config']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
