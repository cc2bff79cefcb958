"""Slice shapes: how many chips and hosts an accelerator type has.

The launcher needs three numbers about a TPU slice: how many chips it has, how many chips sit on
one host (so how many workers one launcher starts), and the chip grid (``TPU_PROCESS_BOUNDS``
when every process owns one chip). The full topology model lives in :mod:`tpu_dist.mesh`; when
that is importable and knows the name, its chip and host counts are used. Otherwise this module's
small table answers, so the launcher works on its own. (Where the two differ, the mesh wins:
emulated workers read ``TPU_DIST_TOPOLOGY`` through it.)

Names understood (the same spellings Cloud TPU and ``TPU_DIST_TOPOLOGY`` use):

* ``v2-N``, ``v3-N``, ``v4-N``, ``v5p-N``: N counts TensorCores, two per chip, so ``v4-16`` is
  8 chips (a 2x2x2 torus, 2 hosts of 4 chips).
* ``v5litepod-N`` (alias ``v5e-N``), ``v6e-N``: N counts chips, so ``v5litepod-16`` is 16 chips
  (4x4, 4 hosts of 4 chips). Up to 8 chips fit on one host.
* ``GENERATION:TOPOLOGY``, e.g. ``v5p:2x2x2`` or ``v5e:2x4``: the chip grid given directly.

Default grids grow the way Cloud TPU's default topologies do: start from one host's chips and
double the smallest axis, the last one on a tie (``v4``: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...;
``v5e``: 2x2, 2x4, 4x4, 4x8, 8x8, ...).
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["SliceShape", "parse_slice", "placement"]

# generation -> (TensorCores per chip as counted in "gen-N" names, chips per host of a multi-host
# slice, the largest slice that fits on one host, number of torus axes)
_GENERATIONS: dict[str, tuple[int, int, int, int]] = {
    "v2": (2, 4, 4, 2),
    "v3": (2, 4, 4, 2),
    "v4": (2, 4, 4, 3),
    "v5p": (2, 4, 4, 3),
    "v5e": (1, 4, 8, 2),
    "v6e": (1, 4, 8, 2),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}
_TYPE_RE = re.compile(r"^(?P<gen>v\d+[a-z]*)-(?P<n>\d+)$")
_TOPO_RE = re.compile(r"^\d+(x\d+){0,2}$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceShape:
    """The chips of one TPU slice, as far as the launcher needs them."""

    name: str
    """The name as given, e.g. ``"v5litepod-8"`` or ``"v5p:2x2x2"``."""
    generation: str
    """Canonical generation: ``"v2"``, ``"v3"``, ``"v4"``, ``"v5p"``, ``"v5e"``, ``"v6e"``."""
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


def _canonical_generation(gen: str, name: str) -> str:
    gen = _ALIASES.get(gen.lower(), gen.lower())
    if gen not in _GENERATIONS:
        raise ValueError(
            f"unknown TPU generation {gen!r} in {name!r}; known: {', '.join(sorted(_GENERATIONS))} "
            "(and v5litepod for v5e)"
        )
    return gen


def _default_bounds(num_chips: int, first_host: int, axes: int, name: str) -> tuple[int, int, int]:
    """Cloud TPU's default grid for ``num_chips`` chips (see the module docstring)."""
    if num_chips < first_host:
        # Sub-host slices (v5litepod-1, v5litepod-4, v6e-4): a line or a square.
        dims = [1, 1, 1]
        side = math.isqrt(num_chips)
        if side * side == num_chips:
            dims[0] = dims[1] = side
        else:
            dims[1] = num_chips
        return (dims[0], dims[1], dims[2])
    dims = [2, 2, 1] if axes == 3 else [2, 2]
    while math.prod(dims) < num_chips:
        smallest = min(dims)
        last = max(i for i, d in enumerate(dims) if d == smallest)
        dims[last] *= 2
    if math.prod(dims) != num_chips:
        raise ValueError(
            f"{name!r} asks for {num_chips} chips, which is not a standard slice size; "
            "give the grid instead, e.g. 'v5p:2x2x4'"
        )
    while len(dims) < 3:
        dims.append(1)
    return (dims[0], dims[1], dims[2])


def _chips_per_host(gen: str, num_chips: int) -> int:
    _, per_host, single_host_max, _ = _GENERATIONS[gen]
    return num_chips if num_chips <= single_host_max else per_host


def _from_table(name: str) -> SliceShape:
    text = name.strip()
    if ":" in text:
        gen_text, topo = text.split(":", 1)
        gen = _canonical_generation(gen_text, name)
        if not _TOPO_RE.match(topo):
            raise ValueError(f"topology {topo!r} in {name!r} is not of the form 2x2 or 2x2x2")
        dims = [int(d) for d in topo.split("x")] + [1, 1]
        if min(dims) < 1:
            raise ValueError(f"topology {topo!r} in {name!r} has an empty axis")
        bounds = (dims[0], dims[1], dims[2])
        return SliceShape(
            name=name,
            generation=gen,
            bounds=bounds,
            chips_per_host=_chips_per_host(gen, math.prod(bounds)),
        )
    match = _TYPE_RE.match(text.lower())
    if not match:
        raise ValueError(
            f"cannot read accelerator type {name!r}: expected e.g. 'v5litepod-8', 'v4-16' or "
            "'v5p:2x2x2'"
        )
    gen = _canonical_generation(match["gen"], name)
    cores_per_chip, per_host, single_host_max, axes = _GENERATIONS[gen]
    count = int(match["n"])
    if count % cores_per_chip or count == 0:
        raise ValueError(
            f"{name!r}: {gen} names count TensorCores, {cores_per_chip} per chip, so the number "
            f"must be a positive multiple of {cores_per_chip}"
        )
    num_chips = count // cores_per_chip
    bounds = _default_bounds(num_chips, min(per_host, single_host_max), axes, name)
    return SliceShape(
        name=name, generation=gen, bounds=bounds, chips_per_host=_chips_per_host(gen, num_chips)
    )


def _from_mesh(name: str) -> SliceShape | None:
    """The slice as :mod:`tpu_dist.mesh` models it, when importable; ``None`` otherwise."""
    try:
        from tpu_dist.mesh import Topology  # optional and heavy: imported on use
    except ImportError:
        return None
    topo = Topology.parse(name)
    dims = tuple(int(d) for d in topo.shape) + (1,) * (3 - len(topo.shape))
    return SliceShape(
        name=name,
        generation=str(topo.generation.name),
        bounds=(dims[0], dims[1], dims[2]),
        chips_per_host=topo.chips_per_slice // topo.hosts_per_slice,
        devices_per_chip=int(topo.devices_per_chip),
    )


def parse_slice(name: str, *, use_mesh: bool = True) -> SliceShape:
    """Reads an accelerator type or ``generation:topology`` name.

    Args:
        name: e.g. ``"v5litepod-8"``, ``"v4-16"``, ``"v5p:2x2x2"``.
        use_mesh: ask :mod:`tpu_dist.mesh` first (so the launcher and the workers, which read
            ``TPU_DIST_TOPOLOGY`` through it, agree on hosts and chips); the local table answers
            when the mesh package is missing or does not know the generation.

    Raises:
        ValueError: the name is not understood.
    """
    mesh_error: ValueError | None = None
    if use_mesh:
        try:
            shape = _from_mesh(name)
        except ValueError as err:
            shape, mesh_error = None, err
        if shape is not None:
            return shape
    try:
        return _from_table(name)
    except ValueError:
        if mesh_error is not None:
            raise mesh_error from None
        raise


def placement(name: str, num_slices: int, rank: int) -> str | None:
    """Where ``rank`` sits in the emulated topology, as :mod:`tpu_dist.mesh` places it."""
    try:
        from tpu_dist.mesh import Topology

        chip = Topology.parse(name, num_slices).chips[rank]
    except Exception:  # descriptive only; the caller falls back to arithmetic
        return None
    coords = ",".join(str(c) for c in chip.coords)
    return f"slice {chip.slice_index} host {chip.host} chip {chip.local_index} at ({coords})"
