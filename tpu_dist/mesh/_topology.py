"""TPU topologies as data: generations, slices, hosts, chips, and which rank drives which chip.

Pure logic: no JAX backend, no torch, no processes. Everything here is computed from a
generation, a per-slice torus shape and a number of slices (or read off real device objects in
:meth:`Topology.from_devices`), so layouts for thousands of chips are built and checked anywhere.

Vocabulary (docs/reference/vocabulary.md): a *rank* is a process; the *device* of a rank is the one
JAX device it drives, which is a whole chip on v4, v5e, v5p and v6e (one TensorCore, or two fused
into one "megacore" device) and one of the two TensorCores of a chip on v7x; a *host* is a machine;
a *slice* is a set of chips joined by ICI; slices are joined by DCN.

Rank order (the order ``tpu-launch`` assigns): slice-major, then host, then the device's index on
its host. Inside a slice, hosts are numbered over their block coordinates with x fastest, then y,
then z; inside a host, chips are numbered the same way, then the core on the chip. This matches
the "process-tiled z, y, x, core" order of ``jax.devices()`` on a TPU slice.

The generations themselves are in :mod:`tpu_dist.mesh._generations`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_dist import _settings
from tpu_dist.mesh._generations import (
    V4,
    V5E,
    V5P,
    V6E,
    V7X,
    Generation,
    format_shape,
    generation_of_device_kind,
    generations,
    get_generation,
)

__all__ = ["Chip", "Topology"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Chip:
    """The device one rank drives: where it is in the TPU topology."""

    rank: int
    """The global rank that drives it."""
    coords: tuple[int, ...]
    """Position of its chip in the slice's chip grid: ``(x, y, z)``, or ``(x, y)`` on 2-D TPUs."""
    core: int
    """Which of the chip's devices it is (``core_on_chip``): 0 or 1 on v7x, else always 0."""
    slice_index: int
    """The slice it is in."""
    host: int
    """Global index of its host, slice-major (a one-process-per-host job's ``process_index``)."""
    local_index: int
    """Its index among its host's devices (the local rank on that host)."""


# -- topologies ----------------------------------------------------------------------------------

_SHAPE_RE = re.compile(r"^\s*\d+(\s*[x,]\s*\d+)*\s*$")
_ACCELERATOR_TYPE_RE = re.compile(r"^\s*([A-Za-z0-9]+?)-(\d+)\s*$")


class Topology:
    """The TPU chips of a job: generation, per-slice chip grid, slices, hosts, rank -> chip.

    Build one with :meth:`create`, :meth:`from_accelerator_type`, :meth:`parse` (the
    ``TPU_DIST_TOPOLOGY`` syntax), :meth:`for_world_size` (the emulation default) or
    :meth:`from_devices` (real TPU devices). ``Topology(generation, shape, num_slices)`` is
    :meth:`create`.

    Example, a v5p slice of 4 chips (``v5p-8``, one host), ranks in ``tpu-launch`` order::

        >>> topo = Topology.from_accelerator_type("v5p-8")
        >>> topo.shape, topo.num_chips, topo.num_hosts
        ((2, 2, 1), 4, 1)
        >>> [c.coords for c in topo.chips]
        [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    """

    def __init__(
        self,
        generation: str | Generation,
        shape: str | Sequence[int],
        num_slices: int = 1,
    ) -> None:
        gen = get_generation(generation)
        shape = gen.check_shape(_parse_shape(shape))
        num_slices = _check_num_slices(num_slices)
        grid = _canonical_rank_grid(gen, shape, num_slices)
        hosts = _canonical_hosts(gen, shape, num_slices)
        self._init(gen, shape, num_slices, gen.devices_per_chip, grid, hosts)

    def _init(
        self,
        generation: Generation,
        shape: tuple[int, ...],
        num_slices: int,
        devices_per_chip: int,
        rank_grid: np.ndarray,
        host_of_rank: np.ndarray,
    ) -> None:
        self._generation = generation
        self._shape = shape
        self._num_slices = num_slices
        self._devices_per_chip = devices_per_chip
        rank_grid.setflags(write=False)
        self._rank_grid = rank_grid  # (num_slices, *shape, devices_per_chip) -> rank
        n = rank_grid.size
        # Per-rank tables: the inverse of rank_grid.
        idx = np.empty((n, rank_grid.ndim), dtype=np.int64)
        idx[rank_grid.reshape(-1)] = np.stack(
            np.unravel_index(np.arange(n), rank_grid.shape), axis=-1
        )
        self._slice_of = idx[:, 0]
        self._coords_of = idx[:, 1:-1]
        self._core_of = idx[:, -1]
        self._host_of = host_of_rank
        local = np.empty(n, dtype=np.int64)
        order = np.argsort(host_of_rank, kind="stable")
        _, starts = np.unique(host_of_rank[order], return_index=True)
        counts = np.diff(np.append(starts, n))
        local[order] = np.arange(n) - np.repeat(starts, counts)
        self._local_of = local
        for a in (self._slice_of, self._coords_of, self._core_of, self._host_of, self._local_of):
            a.setflags(write=False)

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def create(
        cls, generation: str | Generation, topology: str | Sequence[int], num_slices: int = 1
    ) -> Topology:
        """A topology from a generation and a per-slice chip grid: ``create("v5p", "16x16x24")``.

        Args:
            generation: A generation name or alias (``"v5p"``, ``"v5litepod"``, ``"tpu7x"``).
            topology: The chip grid of one slice, ``"AxBxC"`` (``"AxB"`` on v5e/v6e) or a tuple.
            num_slices: Identical slices joined by DCN.

        Raises:
            ValueError: unknown generation, or a shape the generation has no slice of.
        """
        return cls(generation, topology, num_slices)

    @classmethod
    def from_accelerator_type(cls, accelerator_type: str, num_slices: int = 1) -> Topology:
        """A topology from a Cloud TPU accelerator type: ``"v5p-128"`` is a 4x4x4 slice.

        ``N`` in ``<prefix>-N`` counts TensorCores on v4, v5p and v7x (two per chip) and chips on
        v5e (``v5litepod-N``, ``v5e-N``) and v6e. The slice gets the default (most cube-like)
        shape for its chip count; use :meth:`create` for another shape of the same size.

        Raises:
            ValueError: not ``<prefix>-N``, unknown prefix, or no slice of that size.
        """
        match = _ACCELERATOR_TYPE_RE.match(accelerator_type)
        if match is None:
            raise ValueError(
                f"expected an accelerator type like 'v5p-128' or 'v5litepod-16', got "
                f"{accelerator_type!r}"
            )
        gen = get_generation(match.group(1))
        n = int(match.group(2))
        if gen.accelerator_type_counts == "tensorcores":
            if n % gen.tensorcores_per_chip:
                raise ValueError(
                    f"{accelerator_type!r}: {gen.name} accelerator types count TensorCores, "
                    f"{gen.tensorcores_per_chip} per chip, so N must be a multiple of "
                    f"{gen.tensorcores_per_chip}, e.g. {gen.accelerator_type(4)}"
                )
            chips = n // gen.tensorcores_per_chip
        else:
            chips = n
        shapes = gen.shapes_with_chips(chips)
        if not shapes:
            valid = ", ".join(gen.accelerator_type(c) for c in gen.valid_chip_counts(limit=12))
            raise ValueError(
                f"{accelerator_type!r} is {chips} chips, and no {gen.name} slice has {chips} "
                f"chips; valid: {valid}, ... ({gen.describe_shapes()})"
            )
        return cls(gen, shapes[0], num_slices)

    @classmethod
    def parse(cls, spec: str, num_slices: int = 1) -> Topology:
        """A topology from ``"v5p-128"`` (accelerator type) or ``"v5p:4x4x4"`` (generation:grid).

        This is the syntax of ``TPU_DIST_TOPOLOGY`` and of the CLI's ``--topology``.

        Raises:
            ValueError: neither form, or an invalid generation or shape.
        """
        if ":" in spec:
            gen, _, shape = spec.partition(":")
            return cls(gen.strip(), shape.strip(), num_slices)
        return cls.from_accelerator_type(spec, num_slices)

    @classmethod
    def for_world_size(cls, world_size: int) -> Topology:
        """The emulated topology used when nothing else says what the chips are.

        The fewest slices first, then the first generation among v5p, v5e, v6e, v4, v7x that
        has a slice of ``world_size / num_slices`` devices. So 4 ranks are one ``v5p-8``
        (2x2x1), 8 ranks one ``v5p-16`` (2x2x2), 1 rank a ``v5litepod-1``, 2 ranks two
        ``v5litepod-1`` slices, 12 ranks three ``v5p-8`` slices.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size=}")
        order = [g for g in (V5P, V5E, V6E, V4, V7X) if g.name in generations()]
        for num_slices in _divisors(world_size):
            per_slice = world_size // num_slices
            for gen in order:
                if per_slice % gen.devices_per_chip:
                    continue
                shapes = gen.shapes_with_chips(per_slice // gen.devices_per_chip)
                if shapes:
                    return cls(gen, shapes[0], num_slices)
        # Unreachable while v5e (with its 1x1 slice) is registered.
        raise ValueError(f"no emulated TPU topology has {world_size} devices")

    @classmethod
    def from_devices(cls, devices: Sequence[Any]) -> Topology:
        """The topology of real TPU devices, rank ``r`` driving ``devices[r]``.

        Reads ``device_kind``, ``coords``, ``core_on_chip``, ``slice_index`` (0 if absent) and
        ``process_index`` (the host) of each device. Every slice must be a full cuboid of chips,
        all slices of one shape. Shapes are taken as they are (not checked against the
        generation's documented shapes): the hardware is the authority.

        Raises:
            ValueError: mixed or unknown device kinds, holes, duplicates, or unequal slices.
        """
        devices = list(devices)
        if not devices:
            raise ValueError("from_devices needs at least one device, got none")
        kinds = sorted({d.device_kind for d in devices})
        if len(kinds) != 1:
            raise ValueError(f"devices of one TPU generation expected, got kinds {kinds}")
        gen = generation_of_device_kind(kinds[0])
        if gen is None:
            known = sorted(k for g in generations().values() for k in g.device_kinds)
            raise ValueError(
                f"unknown TPU device_kind {kinds[0]!r}; known: {known}; "
                "register_generation() can add it"
            )
        nd = gen.torus_ndim
        coords = np.array([tuple(d.coords) for d in devices], dtype=np.int64)
        if coords.ndim != 2 or coords.shape[1] < nd or np.any(coords[:, nd:] != 0):
            raise ValueError(
                f"{gen.name} devices have {nd}-D chip coordinates, got e.g. {devices[0].coords}"
            )
        coords = coords[:, :nd]
        cores = np.array([d.core_on_chip for d in devices], dtype=np.int64)
        slices = np.array([getattr(d, "slice_index", 0) or 0 for d in devices], dtype=np.int64)
        hosts = np.array([d.process_index for d in devices], dtype=np.int64)
        slice_ids = np.unique(slices)
        if not np.array_equal(slice_ids, np.arange(len(slice_ids))):
            raise ValueError(f"slice indices must be 0..S-1, got {slice_ids.tolist()}")
        core_ids = np.unique(cores)
        cpc = len(core_ids)
        cores = np.searchsorted(core_ids, cores)
        shape = None
        for s in slice_ids:
            c = coords[slices == s]
            lo, hi = c.min(axis=0), c.max(axis=0)
            sshape = tuple(int(v) for v in hi - lo + 1)
            if shape is None:
                shape = sshape
            elif sshape != shape:
                raise ValueError(
                    f"all slices must have one shape, got {format_shape(shape)} and "
                    f"{format_shape(sshape)} (slice {s})"
                )
            coords[slices == s] -= lo
        assert shape is not None
        grid = np.full((len(slice_ids), *shape, cpc), -1, dtype=np.int64)
        where = (slices, *coords.T, cores)
        if len(devices) != grid.size:
            raise ValueError(
                f"{len(devices)} devices do not fill {len(slice_ids)} slice(s) of "
                f"{format_shape(shape)} chips x {cpc} device(s) per chip (holes in the grid)"
            )
        grid[where] = np.arange(len(devices))
        if np.any(grid < 0):
            raise ValueError("two devices have the same slice, chip coordinates and core")
        topo = cls.__new__(cls)
        topo._init(gen, shape, len(slice_ids), cpc, grid, hosts)
        return topo

    # -- what it is ----------------------------------------------------------------------------

    @property
    def generation(self) -> Generation:
        """The TPU generation."""
        return self._generation

    @property
    def shape(self) -> tuple[int, ...]:
        """The chip grid of one slice: ``(x, y, z)``, or ``(x, y)`` on v5e/v6e."""
        return self._shape

    @property
    def topology(self) -> str:
        """``shape`` as Cloud TPU writes it: ``"4x4x4"``."""
        return format_shape(self._shape)

    @property
    def spec(self) -> str:
        """``"generation:topology"``, as ``TPU_DIST_TOPOLOGY`` and :meth:`parse` take it."""
        return f"{self._generation.name}:{self.topology}"

    @property
    def accelerator_type(self) -> str:
        """The Cloud TPU accelerator type of one slice: ``"v5p-128"``."""
        return self._generation.accelerator_type(self.chips_per_slice)

    @property
    def num_slices(self) -> int:
        """Slices (joined by DCN)."""
        return self._num_slices

    @property
    def wraparound(self) -> tuple[bool, ...]:
        """For each axis of the chip grid, whether its ICI links wrap around."""
        return self._generation.wraparound(self._shape)

    @property
    def devices_per_chip(self) -> int:
        """Devices (ranks) per chip: 2 on v7x, else 1."""
        return self._devices_per_chip

    @property
    def chips_per_slice(self) -> int:
        """Chips in one slice."""
        return math.prod(self._shape)

    @property
    def num_chips(self) -> int:
        """Chips in all slices."""
        return self.chips_per_slice * self._num_slices

    @property
    def devices_per_slice(self) -> int:
        """Devices (ranks) in one slice."""
        return self.chips_per_slice * self._devices_per_chip

    @property
    def num_devices(self) -> int:
        """Devices in all slices: the world size of a job that uses them all."""
        return self._rank_grid.size

    @property
    def num_hosts(self) -> int:
        """Hosts in all slices."""
        return int(np.unique(self._host_of).size)

    @property
    def hosts_per_slice(self) -> int:
        """Hosts in one slice."""
        return self.num_hosts // self._num_slices

    @functools.cached_property
    def chips(self) -> tuple[Chip, ...]:
        """One :class:`Chip` per rank, indexed by rank."""
        return tuple(
            Chip(
                rank=r,
                coords=tuple(int(v) for v in self._coords_of[r]),
                core=int(self._core_of[r]),
                slice_index=int(self._slice_of[r]),
                host=int(self._host_of[r]),
                local_index=int(self._local_of[r]),
            )
            for r in range(self.num_devices)
        )

    def rank_grid(self) -> np.ndarray:
        """Ranks by position: ``grid[slice, *chip_coords, core]`` is the rank driving that device.

        Shape ``(num_slices, *shape, devices_per_chip)``; read-only.
        """
        return self._rank_grid

    def coords_of(self, ranks: np.ndarray | int) -> np.ndarray:
        """Chip coordinates of ``ranks``: an array of shape ``ranks.shape + (len(shape),)``."""
        return self._coords_of[np.asarray(ranks)]

    def slice_of(self, ranks: np.ndarray | int) -> np.ndarray:
        """Slice index of ``ranks``, elementwise."""
        return self._slice_of[np.asarray(ranks)]

    def host_of(self, ranks: np.ndarray | int) -> np.ndarray:
        """Global host index of ``ranks``, elementwise."""
        return self._host_of[np.asarray(ranks)]

    def core_of(self, ranks: np.ndarray | int) -> np.ndarray:
        """Core on its chip (``core_on_chip``) of ``ranks``, elementwise."""
        return self._core_of[np.asarray(ranks)]

    def ici_hops(self, a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
        """ICI hops between the chips of ranks ``a`` and ``b``, elementwise.

        The shortest path on the slice's torus (wraparound links counted where the axis wraps);
        0 for two devices of one chip; -1 for ranks in different slices (no ICI path: DCN).
        """
        a, b = np.asarray(a), np.asarray(b)
        delta = np.abs(self._coords_of[a] - self._coords_of[b])
        sides = np.array(self._shape)
        wrap = np.array(self.wraparound)
        delta = np.where(wrap, np.minimum(delta, sides - delta), delta)
        hops = delta.sum(axis=-1)
        return np.where(self._slice_of[a] == self._slice_of[b], hops, -1)

    def env(self) -> dict[str, str]:
        """The environment variables that make emulated ranks see this topology.

        ``TPU_DIST_TOPOLOGY`` (the spec) and ``TPU_DIST_NUM_SLICES`` (the slice count), what
        ``tpu-launch --emulate`` sets.
        """
        return {_settings.TOPOLOGY.env: self.spec, _settings.NUM_SLICES.env: str(self._num_slices)}

    # -- dunder ----------------------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return (self._generation.name, self._shape, self._num_slices, self._devices_per_chip)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return (
            self._key() == other._key()
            and np.array_equal(self._rank_grid, other._rank_grid)
            and np.array_equal(self._host_of, other._host_of)
        )

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"Topology({self._generation.name!r}, {self.topology!r}, "
            f"num_slices={self._num_slices})"
        )

    def describe(self) -> str:
        """One paragraph: generation, grid, wraparound, slices, hosts, chips, devices."""
        wrap = [name for name, w in zip("xyz", self.wraparound) if w]
        torus = f"wraps around on {','.join(wrap)}" if wrap else "no wraparound (a mesh)"
        per_host = self.devices_per_slice // max(self.hosts_per_slice, 1)
        return (
            f"{self._generation.name} {self.topology} ({self.accelerator_type}), {torus}; "
            f"{self._num_slices} slice(s) x {self.chips_per_slice} chips = {self.num_chips} chips, "
            f"{self.num_devices} devices ({self._devices_per_chip} per chip), "
            f"{self.num_hosts} hosts ({self.hosts_per_slice} per slice, {per_host} devices each)"
        )


# -- helpers -------------------------------------------------------------------------------------


def _canonical_rank_grid(gen: Generation, shape: tuple[int, ...], num_slices: int) -> np.ndarray:
    """``grid[slice, *coords, core] -> rank`` in tpu-launch order (see the module docstring)."""
    block = gen.host_block(shape)
    hosts_grid = tuple(s // b for s, b in zip(shape, block))
    cpc = gen.devices_per_chip
    idx = np.indices((*shape, cpc), dtype=np.int64)
    coords, core = idx[:-1], idx[-1]
    # Flatten with the first axis (x) fastest: weights 1, n_x, n_x * n_y, ...
    host = np.zeros(shape + (cpc,), dtype=np.int64)
    chip = np.zeros_like(host)
    hw = cw = 1
    for d in range(len(shape)):
        host += (coords[d] // block[d]) * hw
        chip += (coords[d] % block[d]) * cw
        hw *= hosts_grid[d]
        cw *= block[d]
    per_host = math.prod(block) * cpc
    local = chip * cpc + core
    in_slice = host * per_host + local
    per_slice = math.prod(shape) * cpc
    return np.arange(num_slices, dtype=np.int64).reshape((-1,) + (1,) * (len(shape) + 1)) * (
        per_slice
    ) + in_slice[None]


def _canonical_hosts(gen: Generation, shape: tuple[int, ...], num_slices: int) -> np.ndarray:
    """Global host of each rank in tpu-launch order: ranks come host by host."""
    per_host = math.prod(gen.host_block(shape)) * gen.devices_per_chip
    n = math.prod(shape) * gen.devices_per_chip * num_slices
    return np.arange(n, dtype=np.int64) // per_host


def _parse_shape(shape: str | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, str):
        if not _SHAPE_RE.match(shape):
            raise ValueError(f"expected a chip grid like '4x4x4' or '2x4', got {shape!r}")
        return tuple(int(s) for s in re.split(r"[x,]", shape.replace(" ", "")))
    try:
        out = tuple(int(s) for s in shape)
    except (TypeError, ValueError) as err:
        raise ValueError(f"expected a chip grid like (4, 4, 4), got {shape!r}") from err
    if not out or any(s < 1 for s in out):
        raise ValueError(f"chip grid sides must be positive, got {shape!r}")
    return out


def _check_num_slices(num_slices: int) -> int:
    if (
        isinstance(num_slices, bool)
        or not isinstance(num_slices, (int, np.integer))
        or num_slices < 1
    ):
        raise ValueError(f"num_slices must be a positive int, got {num_slices=}")
    return int(num_slices)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
