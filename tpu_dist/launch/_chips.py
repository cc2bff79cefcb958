"""Slice shapes: how many chips and hosts an accelerator type has.

The launcher needs three numbers about a TPU slice: how many chips it has, how many chips sit on
one host (so how many workers one launcher starts), and the chip grid (``TPU_PROCESS_BOUNDS``
when every process owns one chip). They come from :mod:`tpu_dist.mesh`'s generations, the one
record of TPU hardware facts in this package (checked against libtpu), so the launcher and the
workers (which read ``TPU_DIST_TOPOLOGY`` through the same model) always agree.

Names understood (the same spellings Cloud TPU and ``TPU_DIST_TOPOLOGY`` use):

* ``v4-N``, ``v5p-N``, ``tpu7x-N``: N counts TensorCores, two per chip, so ``v4-16`` is 8 chips
  (a 2x2x2 torus, 2 hosts of 4 chips).
* ``v5litepod-N`` (alias ``v5e-N``), ``v6e-N``: N counts chips. A slice of up to 8 chips is one
  host (``v5litepod-8``: 2x4); larger ones are hosts of 4 chips (``v5litepod-16``: 4x4, 4 hosts).
* ``GENERATION:TOPOLOGY``, e.g. ``v5p:2x2x2`` or ``v5e:2x4``: the chip grid given directly.

v2 and v3 are not modelled.
"""

from __future__ import annotations

import dataclasses
import math

from tpu_dist.mesh import Topology

__all__ = ["SliceShape", "parse_slice", "placement"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceShape:
    """The chips of one TPU slice, as far as the launcher needs them."""

    name: str
    """The name as given, e.g. ``"v5litepod-8"`` or ``"v5p:2x2x2"``."""
    generation: str
    """Canonical generation: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``, ``"v7x"``."""
    bounds: tuple[int, int, int]
    """Chips along x, y, z (z is 1 for 2-D generations)."""
    chips_per_host: int
    """Chips attached to one host of this slice."""
    devices_per_chip: int = 1
    """JAX devices (so workers) per chip: 2 on v7x, else 1."""

    def __post_init__(self) -> None:
        if self.num_chips % self.chips_per_host:
            raise ValueError(
                f"slice {self.name!r} has {self.num_chips} chips, which is not a multiple of "
                f"{self.chips_per_host} chips per host"
            )

    @property
    def num_chips(self) -> int:
        """Chips in the slice."""
        return math.prod(self.bounds)

    @property
    def num_devices(self) -> int:
        """Devices in the slice: the workers of an emulation, one per device."""
        return self.num_chips * self.devices_per_chip

    @property
    def num_hosts(self) -> int:
        """Hosts in the slice."""
        return self.num_chips // self.chips_per_host

    @property
    def bounds_str(self) -> str:
        """``"x,y,z"``, the spelling of ``TPU_PROCESS_BOUNDS``."""
        return ",".join(str(d) for d in self.bounds)


def parse_slice(name: str) -> SliceShape:
    """Reads an accelerator type or ``generation:topology`` name.

    Args:
        name: e.g. ``"v5litepod-8"``, ``"v4-16"``, ``"v5p:2x2x2"``.

    Raises:
        ValueError: the name is not understood (the message lists what is).
    """
    topo = Topology.parse(name)
    dims = tuple(int(d) for d in topo.shape) + (1,) * (3 - len(topo.shape))
    return SliceShape(
        name=name,
        generation=topo.generation.name,
        bounds=(dims[0], dims[1], dims[2]),
        chips_per_host=topo.chips_per_slice // topo.hosts_per_slice,
        devices_per_chip=topo.devices_per_chip,
    )


def placement(name: str, num_slices: int, rank: int) -> str | None:
    """Where ``rank`` sits in the emulated topology, as :mod:`tpu_dist.mesh` places it."""
    try:
        chip = Topology.parse(name, num_slices).chips[rank]
    except (ValueError, IndexError):  # descriptive only; the caller falls back to arithmetic
        return None
    coords = ",".join(str(c) for c in chip.coords)
    return f"slice {chip.slice_index} host {chip.host} chip {chip.local_index} at ({coords})"
