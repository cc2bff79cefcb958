"""Rank layouts for device meshes: which rank sits at each position of an ICI x DCN mesh.

:func:`plan_mesh` is JAX's ``create_hybrid_device_mesh`` for a :class:`Topology`, with rings:

1. **Per slice, JAX decides which torus axes each mesh axis gets.** One slice's devices go to
   ``jax.experimental.mesh_utils.create_device_mesh`` as mock TPU devices carrying ``coords``
   and ``core_on_chip``. Its N-D torus assignment gives the most traffic-heavy mesh axis (the
   last one) whole physical axes first, preferring more axes (more links, more bandwidth), and
   splits a physical axis only when no product of whole axes fits (then the heavier axis gets
   the *minor*, contiguous part of the split axis). Example: a v5p ``4x4x4`` slice and mesh
   ``(4, 16)``: the 16-way axis gets the x-y plane (4x4 = 16 chips, 4 links per chip), the 4-way
   axis gets z.
2. **We then order each mesh axis as a snake (boustrophedon) through its torus axes**, so that
   consecutive members are ICI neighbours. JAX lists the x-y plane above row by row,
   ``(0,0) (0,1) (0,2) (0,3) (1,0) ...``: ``(0,3) -> (1,0)`` is 2 hops (1 with y's wraparound,
   plus 1 in x). The snake is ``(0,0) (0,1) (0,2) (0,3) (1,3) (1,2) ... (3,0)``: every step is
   one hop, so ring and pipeline collectives along the axis only use neighbour links. The
   members of each group are the same as JAX's; only their order changes.
3. **Slices compose as JAX composes them**: the DCN mesh multiplies the ICI mesh axis by axis,
   slice ``s`` taking block ``unravel(s, dcn_mesh_shape)`` (``np.block`` order). So every ICI
   group stays inside one slice, and an axis with a DCN factor crosses that many slices.

Worked example, a v5e ``4x4`` slice (four hosts of 2x2 chips; rank = 4 * host + x % 2 +
2 * (y % 2)) and mesh ``(16,)``::

    chip (x, y) -> rank       plan_mesh(v5e 4x4, (16,))
    y=0:  0  1 |  4  5        [0, 2, 8, 10, 11, 9, 3, 1, 4, 6, 12, 14, 15, 13, 7, 5]
    y=1:  2  3 |  6  7        = (0,0) (0,1) (0,2) (0,3) (1,3) (1,2) (1,1) (1,0) (2,0) ...
    y=2:  8  9 | 12 13        every consecutive pair one ICI hop apart.
    y=3: 10 11 | 14 15

v7x: the two TensorCores of a chip are two devices linked on the package, faster than any
ICI link (JAX's own TPU7x handler assigns them first for that reason), so when the innermost
axis has an even size it takes a chip's two devices as consecutive members, and the chips are
planned as above for the rest.

Why JAX's device-kind handlers are bypassed: ``create_device_mesh`` first tries a handler per
``device_kind`` (v5e, v5p, v6e, v7x) with ring orders hard-coded for the order in which real
devices are numbered (e.g. its v5e 2x4 ring is not a ring on the chip grid's coordinates). Our
emulated chips have no such numbering, so the mocks present themselves as a kind without a
handler ("TPU v4", or "TPU v5p" with two cores per chip for v7x, the same 4-D ``(x, y, z,
core)`` grid JAX builds for TPU7x) and the snake supplies the rings.

Cost: one slice is planned (devices of one slice, O(n)), every slice reuses it through its own
``rank_grid``, and the DCN composition is a reshape; 2 slices of v5p 16x16x24 (12,288 chips)
plan in well under a second. Plans are cached per (slice grid, mesh shape).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from tpu_dist import _process
from tpu_dist.mesh._generations import format_shape, subset_products
from tpu_dist.mesh._topology import Topology

__all__ = ["AxisReport", "plan_mesh", "report_axes", "split_dcn"]

# Device kinds JAX's create_device_mesh has no special-case handler for (see module docstring).
_JAX_KIND_ONE_DEVICE_PER_CHIP = "TPU v4"
_JAX_KIND_TWO_DEVICES_PER_CHIP = "TPU v5p"


class _MockTpuDevice:
    """What ``jax.experimental.mesh_utils`` reads off a TPU device (a plain class: fast to make)."""

    __slots__ = ("id", "coords", "core_on_chip", "device_kind")
    platform = "tpu"
    slice_index = 0
    process_index = 0

    def __init__(self, id: int, coords: tuple[int, ...], core_on_chip: int, device_kind: str):
        self.id = id
        self.coords = coords
        self.core_on_chip = core_on_chip
        self.device_kind = device_kind

    def __repr__(self) -> str:
        return f"_MockTpuDevice(id={self.id}, coords={self.coords}, core={self.core_on_chip})"


def plan_mesh(
    topology: Topology,
    ici_mesh_shape: Sequence[int],
    dcn_mesh_shape: Sequence[int] | None = None,
) -> np.ndarray:
    """Global ranks laid out as a device mesh whose inner axes ride ICI and outer axes DCN.

    Axes are ordered by increasing network traffic (as in JAX): put data parallelism first and
    tensor parallelism last. The last axis of size > 1 gets the best ICI links, and consecutive
    members of each of its groups are ICI neighbours (one hop, wraparound links counted).

    Args:
        topology: The chips; rank ``r`` drives ``topology.chips[r]``.
        ici_mesh_shape: The mesh inside one slice; its product is the devices per slice.
        dcn_mesh_shape: How slices multiply each axis; its product is ``topology.num_slices``.
            Default: ``ici_mesh_shape`` is then the whole mesh, and the slices are split off its
            outermost axes (see :func:`split_dcn`); with one slice, all ones.

    Returns:
        An int64 array of shape ``ici * dcn`` (elementwise), holding every rank once. Along
        axis ``k``, index ``i`` is DCN block ``i // ici[k]`` and ICI position ``i % ici[k]``.

    Raises:
        ValueError: the shapes do not fit the topology; the message says what would.
    """
    ici = _check_shape("ici_mesh_shape", ici_mesh_shape)
    if dcn_mesh_shape is None:
        dcn, ici = split_dcn(ici, topology.num_slices)
    else:
        dcn = _check_shape("dcn_mesh_shape", dcn_mesh_shape)
        if len(dcn) != len(ici):
            raise ValueError(
                f"dcn_mesh_shape and ici_mesh_shape need the same number of axes, got "
                f"{dcn=} {ici=}"
            )
    if math.prod(dcn) != topology.num_slices:
        raise ValueError(
            f"dcn_mesh_shape={dcn} spans {math.prod(dcn)} slices, but the topology has "
            f"{topology.num_slices}: its product must be the number of slices"
        )
    if math.prod(ici) != topology.devices_per_slice:
        raise ValueError(_ici_mismatch_message(topology, ici))

    positions = _plan_slice(topology.shape, topology.devices_per_chip, ici)
    grid = topology.rank_grid().reshape(topology.num_slices, -1)
    per_slice = grid[:, positions]  # (num_slices, *ici)
    nd = len(ici)
    blocks = per_slice.reshape(dcn + ici)
    interleave = [a for k in range(nd) for a in (k, nd + k)]
    ranks = blocks.transpose(interleave).reshape(tuple(d * i for d, i in zip(dcn, ici)))
    return np.ascontiguousarray(ranks)


def split_dcn(
    mesh_shape: Sequence[int], num_slices: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split ``num_slices`` off the outermost axes of a whole mesh: ``(dcn, ici)`` shapes.

    Greedy from axis 0: axis ``k`` takes ``gcd(slices left, mesh_shape[k])`` slices. So on 2
    slices ``(4, 8)`` becomes dcn ``(2, 1)`` x ici ``(2, 8)``: the data-parallel axis crosses DCN
    and the rest stays on ICI.

    Raises:
        ValueError: the slices do not divide into the axes.
    """
    shape = _check_shape("mesh_shape", mesh_shape)
    left = num_slices
    dcn = []
    for size in shape:
        g = math.gcd(left, size)
        dcn.append(g)
        left //= g
    if left != 1:
        raise ValueError(
            f"cannot split {num_slices} slices off mesh shape {shape}: the product of the "
            f"mesh is {math.prod(shape)}; pass dcn_mesh_shape explicitly (its product must be "
            f"{num_slices}), with ici_mesh_shape the mesh inside one slice"
        )
    return tuple(dcn), tuple(s // d for s, d in zip(shape, dcn))


@functools.lru_cache(maxsize=64)
def _plan_slice(
    shape: tuple[int, ...], devices_per_chip: int, ici: tuple[int, ...]
) -> np.ndarray:
    """Positions (flat indices into ``(*shape, devices_per_chip)``) laid out as ``ici``."""
    from jax.experimental import mesh_utils  # JAX's backend is never touched here.

    phys = (*shape, devices_per_chip)
    n = math.prod(phys)
    inner = max((k for k, size in enumerate(ici) if size > 1), default=None)
    if devices_per_chip > 1 and inner is not None and ici[inner] % devices_per_chip == 0:
        # The innermost axis takes the chip's own devices first (see the module docstring):
        # plan whole chips, then make each chip position `devices_per_chip` consecutive ones.
        chip_ici = tuple(s // devices_per_chip if k == inner else s for k, s in enumerate(ici))
        chips = _plan_slice(shape, 1, chip_ici)
        devices = chips[..., None] * devices_per_chip + np.arange(devices_per_chip)
        devices = np.moveaxis(devices, -1, inner + 1).reshape(ici)
        order = snake_order([ici[inner] // devices_per_chip, devices_per_chip])
        positions = np.take(devices, order, axis=inner)
        positions.setflags(write=False)
        return positions
    kind = (
        _JAX_KIND_ONE_DEVICE_PER_CHIP if devices_per_chip == 1 else _JAX_KIND_TWO_DEVICES_PER_CHIP
    )
    idx = np.stack(np.unravel_index(np.arange(n), phys), axis=-1)
    pad = (0,) * (3 - len(shape))
    # Thousands of small objects: a burst like this can set off a full garbage collection,
    # which costs ~0.5 s in a process holding torch and JAX; planning itself takes ~30 ms.
    with _process.gc_paused():
        devices = [
            _MockTpuDevice(i, tuple(row[:-1]) + pad, row[-1], kind)
            for i, row in enumerate(idx.tolist())
        ]
        try:
            mesh = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
        except Exception as err:  # Bad input is rejected before: this is a JAX change.
            raise RuntimeError(
                f"jax.experimental.mesh_utils.create_device_mesh failed for mesh {ici} on a "
                f"{format_shape(shape)} grid x {devices_per_chip} device(s) per chip: {err}"
            ) from err
        positions = np.fromiter((d.id for d in mesh.flat), dtype=np.int64, count=n)
        del devices, mesh
    positions = positions.reshape(ici)
    positions = _snake_axes(positions, phys)
    if not np.array_equal(np.sort(positions, axis=None), np.arange(n)):
        raise RuntimeError(f"internal error: the plan for {ici} lost or repeated a device")
    positions.setflags(write=False)
    return positions


def _snake_axes(positions: np.ndarray, phys: tuple[int, ...]) -> np.ndarray:
    """Reorder every mesh axis as a snake through the physical axes it spans."""
    coords = np.stack(np.unravel_index(positions, phys), axis=-1)
    for axis in range(positions.ndim):
        if positions.shape[axis] <= 2:
            continue
        line = coords[tuple(slice(None) if k == axis else 0 for k in range(positions.ndim))]
        radices = _line_radices(line)
        if len(radices) <= 1:
            continue
        order = snake_order(radices)
        positions = np.take(positions, order, axis=axis)
        coords = np.take(coords, order, axis=axis)
    return positions


def _line_radices(line: np.ndarray) -> list[int]:
    """Mixed-radix digits of one mesh axis (most significant first), from its members' coords.

    JAX lays a mesh axis out as a reshape/transpose of the physical grid, so its index is a
    mixed-radix number whose digits are positions along the physical axes it spans.
    """
    length = line.shape[0]
    varying = []
    for p in range(line.shape[1]):
        col = line[:, p]
        values = np.unique(col)
        if values.size > 1:
            first_change = int(np.argmax(col != col[0]))
            varying.append((first_change, np.searchsorted(values, col), values.size))
    varying.sort(key=lambda v: v[0])  # least significant digit first
    index = np.zeros(length, dtype=np.int64)
    weight = 1
    for _, digits, radix in varying:
        index += digits * weight
        weight *= radix
    if not np.array_equal(index, np.arange(length)):
        raise RuntimeError(
            "internal error: jax.experimental.mesh_utils laid a mesh axis out in an order that "
            "is not a reshape of the chip grid; tpu_dist.mesh's snake ordering assumes it is"
        )
    return [radix for _, _, radix in reversed(varying)]


def snake_order(radices: Sequence[int]) -> np.ndarray:
    """The boustrophedon order of a mixed-radix grid, as lexicographic indices.

    ``snake_order([2, 3])`` is ``[0, 1, 2, 5, 4, 3]``: (0,0) (0,1) (0,2) (1,2) (1,1) (1,0).
    Consecutive entries differ by one in exactly one digit.
    """
    n = math.prod(radices)
    u = np.arange(n, dtype=np.int64)
    lex = np.zeros(n, dtype=np.int64)
    for j, r in enumerate(radices):
        w = math.prod(radices[j + 1 :])
        d = u // w
        u = u % w
        u = np.where(d % 2 == 1, w - 1 - u, u)
        lex = lex * r + d
    return lex


# -- reports -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class AxisReport:
    """How one mesh axis of a plan sits on the hardware."""

    index: int
    """Position of the axis in the mesh."""
    name: str
    """Its name (``axis<index>`` if none was given)."""
    size: int
    """Members per group."""
    ici: int
    """The axis's ICI factor (its size within one slice)."""
    dcn: int
    """The axis's DCN factor (slices a group spans)."""
    within_slice: bool
    """Every group stays inside one slice (pure ICI)."""
    max_hops: int
    """Largest ICI hop count between consecutive members of a group (same slice only)."""
    mean_hops: float
    """Mean of those hop counts."""
    ring_hops: int
    """Largest ICI hops from the last member of a group back to the first (-1: DCN)."""
    hosts_per_group: int
    """Distinct hosts in a group (the most over groups)."""
    gbytes_per_s: float | None
    """Rough bandwidth per chip available to the axis, GB/s; None if on-chip only."""
    network: str
    """``"ICI"``, ``"DCN"``, ``"ICI+DCN"``, ``"on-chip"`` or ``"-"`` (size 1)."""
    example: tuple[int, ...]
    """The group that holds rank 0 (mesh position 0 on the other axes)."""


def report_axes(
    topology: Topology,
    ranks: np.ndarray,
    ici_mesh_shape: Sequence[int],
    dcn_mesh_shape: Sequence[int],
    names: Sequence[str] | None = None,
) -> list[AxisReport]:
    """Describe each axis of a plan: network, ICI hops between neighbours, bandwidth estimate.

    The bandwidth estimate is a model, not a measurement: an axis crossing DCN gets the DCN
    bandwidth per chip; a pure ICI axis gets one link per torus axis it spans with 2 positions
    and two links (both directions of the line or ring) per torus axis it spans with more, each
    link worth ``ici_gbytes_per_s / ici_ports``.
    """
    gen = topology.generation
    names = list(names) if names is not None else [f"axis{k}" for k in range(ranks.ndim)]
    link = gen.ici_gbytes_per_s / gen.ici_ports
    reports = []
    for k in range(ranks.ndim):
        size = ranks.shape[k]
        moved = np.moveaxis(ranks, k, -1).reshape(-1, size)  # one row per group
        example = tuple(int(r) for r in moved[0])
        if size > 1:
            hops = topology.ici_hops(moved[:, :-1], moved[:, 1:])
            same = hops >= 0
            max_hops = int(hops[same].max()) if same.any() else -1
            mean_hops = float(hops[same].mean()) if same.any() else -1.0
            ring_hops = int(topology.ici_hops(moved[:, -1], moved[:, 0]).max())
            slices = topology.slice_of(moved)
            within = bool(np.all(slices == slices[:, :1]))
            hosts = max(len(np.unique(topology.host_of(row))) for row in moved[:64])
        else:
            max_hops, mean_hops, ring_hops, within, hosts = 0, 0.0, 0, True, 1
        coords = topology.coords_of(moved[0])
        spans = [len(np.unique(coords[:, d])) for d in range(coords.shape[1])]
        links = sum(0 if s == 1 else 1 if s == 2 else 2 for s in spans)
        if size == 1:
            network, bandwidth = "-", None
        elif not within:
            network = "DCN" if ici_mesh_shape[k] == 1 else "ICI+DCN"
            bandwidth = gen.dcn_gbits_per_s / 8
        elif links == 0:
            network, bandwidth = "on-chip", None
        else:
            network, bandwidth = "ICI", links * link
        reports.append(
            AxisReport(
                index=k,
                name=names[k],
                size=size,
                ici=int(ici_mesh_shape[k]),
                dcn=int(dcn_mesh_shape[k]),
                within_slice=within,
                max_hops=max_hops,
                mean_hops=mean_hops,
                ring_hops=ring_hops,
                hosts_per_group=hosts,
                gbytes_per_s=bandwidth,
                network=network,
                example=example,
            )
        )
    return reports


# -- input checks --------------------------------------------------------------------------------


def _check_shape(what: str, shape: Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of positive ints, got the string {shape!r}")
    try:
        out = tuple(int(s) for s in shape)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be a sequence of positive ints, got {shape!r}") from err
    if not out or any(s < 1 for s in out) or any(
        isinstance(s, bool) or (isinstance(s, float) and not s.is_integer()) for s in shape
    ):
        raise ValueError(f"{what} must be a sequence of positive ints, got {shape!r}")
    return out


def _ici_mismatch_message(topology: Topology, ici: tuple[int, ...]) -> str:
    per_chip = topology.devices_per_chip
    sides = [s for s in topology.shape if s > 1] + ([per_chip] if per_chip > 1 else [])
    grid = topology.topology + (f" chips x {per_chip} devices per chip" if per_chip > 1 else "")
    return (
        f"ici_mesh_shape={ici} has {math.prod(ici)} devices, but a {topology.generation.name} "
        f"{topology.topology} slice has {topology.devices_per_slice}: the product of "
        f"ici_mesh_shape must be {topology.devices_per_slice} (the devices of one slice). "
        f"Axis sizes that take whole axes of the {grid} get the most bandwidth: "
        f"{', '.join(map(str, subset_products(sides)))}"
    )
