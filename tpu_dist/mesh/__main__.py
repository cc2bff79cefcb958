"""``python -m tpu_dist.mesh``: print the rank layout of a device mesh on a TPU topology.

Example::

    python -m tpu_dist.mesh --topology v5p:16x16x24 --num-slices 2 --ici 1,384,16 --dcn 2,1,1

prints the topology (chips, hosts, slices, wraparound), then one line per mesh axis: its ICI
and DCN factors, whether its groups stay inside one slice (ICI) or cross slices (DCN), the ICI
hops between consecutive members (max and mean) and from the last member back to the first,
the hosts a group spans, a rough per-chip bandwidth, and the group that holds rank 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from tpu_dist.mesh._layout import plan_mesh, report_axes, split_dcn
from tpu_dist.mesh._generations import generations
from tpu_dist.mesh._topology import Topology


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace("x", ",").split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints like 1,384,16, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints like 1,384,16, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    gens = ", ".join(
        f"{g.name} ({g.accelerator_prefix}-N)" for g in generations().values()
    )
    parser = argparse.ArgumentParser(
        prog="python -m tpu_dist.mesh",
        description="Print how a device mesh is laid out on a TPU topology (no TPU needed).",
        epilog=f"Generations: {gens}.",
    )
    parser.add_argument(
        "--topology",
        required=True,
        help="an accelerator type (v5p-128, v5litepod-16) or generation:topology (v5p:16x16x24)",
    )
    parser.add_argument(
        "--num-slices", type=int, default=1, help="slices joined by DCN (default 1)"
    )
    parser.add_argument(
        "--ici",
        type=_int_list,
        required=True,
        help="mesh shape inside one slice, comma-separated, last axis the most traffic (1,384,16); "
        "without --dcn, the whole mesh (slices are split off its outermost axes)",
    )
    parser.add_argument(
        "--dcn", type=_int_list, default=None, help="how slices multiply each axis (2,1,1)"
    )
    parser.add_argument("--names", default=None, help="axis names, comma-separated (dp,fsdp,tp)")
    parser.add_argument(
        "--show", type=int, default=8, help="members of each example group to print (default 8)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for bad arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    names = None
    if args.names is not None:
        names = [n.strip() for n in args.names.split(",")]
        if len(names) != len(args.ici) or len(set(names)) != len(names):
            parser.error(f"--names needs {len(args.ici)} distinct names, got {args.names!r}")
    try:
        topology = Topology.parse(args.topology, args.num_slices)
        if args.dcn is None:
            dcn, ici = split_dcn(args.ici, topology.num_slices)
        else:
            dcn, ici = args.dcn, args.ici
        import jax.experimental.mesh_utils  # noqa: F401  (a one-off import, not planning time)

        start = time.perf_counter()
        ranks = plan_mesh(topology, ici, dcn)
        elapsed = time.perf_counter() - start
    except ValueError as err:
        parser.error(str(err))
    print(_render(topology, ranks, ici, dcn, names, elapsed, args.show))
    return 0


def _render(
    topology: Topology,
    ranks,
    ici: Sequence[int],
    dcn: Sequence[int],
    names: Sequence[str] | None,
    elapsed: float,
    show: int,
) -> str:
    gen = topology.generation
    lines = [
        f"topology: {topology.describe()}",
        f"mesh: {tuple(ranks.shape)} = ici {tuple(ici)} x dcn {tuple(dcn)}, "
        f"planned in {elapsed * 1e3:.1f} ms",
        f"bandwidth model: ICI {gen.ici_gbytes_per_s:g} GB/s per chip over {gen.ici_ports} links, "
        f"DCN {gen.dcn_gbits_per_s:g} Gb/s per chip ({gen.source})",
        "",
    ]
    header = ("axis", "size", "ici", "dcn", "network", "hops max/mean", "ring", "hosts", "GB/s")
    rows = []
    examples = []
    for a in report_axes(topology, ranks, ici, dcn, names):
        hops = "-" if a.max_hops < 0 or a.size == 1 else f"{a.max_hops}/{a.mean_hops:.2f}"
        ring = "DCN" if a.ring_hops < 0 else ("-" if a.size <= 2 else str(a.ring_hops))
        bandwidth = "-" if a.gbytes_per_s is None else f"{a.gbytes_per_s:g}"
        network = a.network + ("" if a.within_slice or a.size == 1 else " (crosses slices)")
        rows.append(
            (a.name, str(a.size), str(a.ici), str(a.dcn), network, hops, ring,
             str(a.hosts_per_group), bandwidth)
        )
        members = ", ".join(
            f"{r}{tuple(int(c) for c in topology.coords_of(r))}"
            + (f"c{int(topology.core_of(r))}" if topology.devices_per_chip > 1 else "")
            + (f"s{int(topology.slice_of(r))}" if topology.num_slices > 1 else "")
            for r in a.example[:show]
        )
        more = f", ... ({a.size} in all)" if a.size > show else ""
        examples.append(f"  {a.name}: [{members}{more}]")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    marks = "".join(
        [", then cK: core K of the chip" if topology.devices_per_chip > 1 else "",
         ", then sN: slice N" if topology.num_slices > 1 else ""]
    )
    lines += ["", f"group of rank 0 on each axis, each member as rank(chip coordinates){marks}:", *examples]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
