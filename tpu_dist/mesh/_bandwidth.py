"""What a TPU topology's links allow a collective: the bus-bandwidth model.

Shared by ``tpu-dist-bench`` (``achieved / expected`` busbw on TPU devices) and compile-only
mode (a collective's estimated time), so it lives with the hardware facts it is built from
(:class:`tpu_dist.mesh.Generation`).

**Bus bandwidth** (nccl-tests' convention, ``doc/PERFORMANCE.md``): with ``S`` the message size
in bytes, ``t`` the time of one call and ``n`` the ranks, ``algbw = S / t`` and ``busbw = algbw
* factor`` (:func:`bus_factor`), the factor making busbw comparable to the bandwidth of the
slowest link whatever the op and ``n``: all_reduce ``2 (n-1) / n`` (a reduce-scatter then an
all-gather); all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single ``(n-1) / n``;
broadcast and send_recv 1.

**The bound** (:func:`expected_busbw`) is an upper bound computed from the generation's link
figures (``ici_gbytes_per_s`` summed over ``ici_ports`` links, both directions;
``dcn_gbits_per_s`` per chip), not a promise:

* One ICI link carries ``L = ici_gbytes_per_s / ici_ports / 2`` GB/s each way (v4: 45, v5e: 50,
  v5p: 100, v6e: 100, v7x: 100).
* A collective over the group rides rings along every torus axis its chips span (the axes on
  which their coordinates differ). An axis that wraps around is a ring in both directions: each
  chip sends on two links, ``2 L``. An axis without wraparound (a line of chips, or a 2-chip
  side) carries a ring that comes back over the same links: ``L``. The axes run concurrently,
  so the ICI bound is the sum over spanned axes.
* send_recv moves one message over one path: ``L``.
* A group that spans slices is bounded by DCN as well: ``dcn_gbits_per_s / 8`` GB/s per chip.
* Two devices of one chip (v7x) need no ICI; such a group gets no expectation.

Worked example, v5p 4x4x4 (wraps around on every axis), all 64 chips, all_reduce:
``L = 1200 / 6 / 2 = 100`` GB/s; 3 spanned wraparound axes -> ``3 * 2 * 100 = 600`` GB/s busbw.
The same group as 4 slices of 4x4x4 over DCN: ``min(600, 50 / 8) = 6.25`` GB/s.

Measured busbw near the bound means the program rides the links well; far below it at large
sizes points at the lowering (e.g. a ring along one axis only) or at the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from tpu_dist.mesh._topology import Topology

__all__ = ["BUS_FACTORS", "Expectation", "bus_factor", "expected_busbw", "link_gbytes_per_s"]


BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}
"""busbw / algbw per op, as a function of the number of ranks (module doc)."""


def bus_factor(op: str, nranks: int) -> float:
    """busbw / algbw for ``op`` on ``nranks`` ranks (the module docstring's table)."""
    return BUS_FACTORS[op](nranks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Expectation:
    """The modelled busbw bound for one op on one group, with how it was reached."""

    busbw_gbytes_per_s: float
    """The bound, GB/s (1e9 bytes), comparable to the measured busbw."""
    basis: str
    """One line saying which links bound it, e.g. ``"ICI: 3 wraparound axes x 2 x 100 GB/s"``."""


def link_gbytes_per_s(topology: Topology) -> float:
    """One ICI link's bandwidth in one direction, GB/s."""
    gen = topology.generation
    return gen.ici_gbytes_per_s / gen.ici_ports / 2


def expected_busbw(topology: Topology, ranks: Sequence[int], op: str) -> Expectation | None:
    """The busbw bound for ``op`` over the group of global ``ranks`` (module docstring).

    Returns None when the model has nothing to say (one chip, so no links are used).
    """
    ranks_arr = np.asarray(list(ranks), dtype=np.int64)
    if ranks_arr.size < 2:
        return None
    link = link_gbytes_per_s(topology)
    coords = topology.coords_of(ranks_arr)
    slices = topology.slice_of(ranks_arr)
    spanned = [
        axis for axis in range(coords.shape[1]) if np.unique(coords[:, axis]).size > 1
    ]
    wrap = topology.wraparound
    if op == "send_recv":
        ici = link if spanned else None
        ici_basis = f"ICI: one link at {link:g} GB/s"
    elif spanned:
        rings = sum(2 if wrap[a] else 1 for a in spanned)
        ici = rings * link
        names = ",".join("xyz"[a] for a in spanned)
        ici_basis = (
            f"ICI: axes {names} ({sum(wrap[a] for a in spanned)} wrap around) = "
            f"{rings} x {link:g} GB/s"
        )
    else:
        ici, ici_basis = None, ""
    if np.unique(slices).size > 1:
        dcn = topology.generation.dcn_gbits_per_s / 8
        if ici is None or dcn < ici:
            return Expectation(busbw_gbytes_per_s=dcn, basis=f"DCN: {dcn:g} GB/s per chip")
    if ici is None:
        return None
    return Expectation(busbw_gbytes_per_s=ici, basis=ici_basis)
