"""TPU generations: chip grids, hosts, slice shapes, link speeds, and their registry.

Pure data (no JAX, no torch). A :class:`Generation` knows which slice shapes exist, which axes
wrap around, how chips are grouped on hosts and what its ICI and DCN links carry; the registry
(:func:`register_generation`, :func:`get_generation`) is the seam for generations to come.

Generations and the figures used for each (bidirectional ICI bandwidth per chip, DCN bandwidth
per chip), with their sources in each generation's ``source`` field:

======= ========== ============ ====== ============ ============ ===== ==== ================
name    chip grid  wraparound   cores  devices/chip chips/host   ICI   DCN  device_kind
======= ========== ============ ====== ============ ============ ===== ==== ================
v4      3-D        whole cubes  2      1 (megacore) 4 (2x2x1)    540   25   "TPU v4"
v5e     2-D        16-chip side 1      1            4 (2x2) [*]  400   25   "TPU v5 lite"
v5p     3-D        whole cubes  2      1 (megacore) 4 (2x2x1)    1200  50   "TPU v5"
v6e     2-D        16-chip side 1      1            4 (2x2) [*]  800   100  "TPU v6 lite"
v7x     3-D        whole cubes  2      2            4 (2x2x1)    1200  100  "TPU7x"
======= ========== ============ ====== ============ ============ ===== ==== ================

(ICI in GB/s summed over a chip's links, DCN in Gb/s.) v2 and v3 are not modelled.

Compute and memory per chip (Cloud TPU docs, each generation's ``compute_source``) and per JAX
device (a rank: the chip, or on v7x one of its two TensorCores), used by the step estimate
(:mod:`tpu_dist.compile_job`):

======= ============= ======== ========== ==================================================
name    bf16 TFLOP/s  HBM GiB  HBM GB/s   per device
======= ============= ======== ========== ==================================================
v4      275           32       1200       = chip (one megacore device)
v5e     197           16       819        = chip
v5p     459           95       2765       = chip (one megacore device)
v6e     918           32       1638       = chip
v7x     2307          192      7380       chip / 2: 1153.5 TFLOP/s, 96 GiB, 3690 GB/s
======= ============= ======== ========== ==================================================

[*] Hosts of a *multi-host* v5e/v6e slice hold a 2x2 block of chips (the 4-chip VM types
``ct5lp-hightpu-4t`` / ``ct6e-standard-4t``, and what libtpu lays out); a slice of at most 8
chips is served by one host, so ``v5litepod-8`` / ``v6e-8`` is a single 2x4 host (the 8-chip VM
types ``ct5lp-hightpu-8t`` / ``ct6e-standard-8t``). libtpu's compile-only topologies put such a
slice on two 2x2 hosts unless told ``chips_per_host_bounds=(2, 4, 1)``; the deployment wins.

Where each fact was checked: device kinds, chips and cores per host, core numbering and host
numbering of v4 (megacore), v5e, v5p, v6e and TPU7x against libtpu's compile-only devices
(``tests/test_libtpu_topology.py``; the libtpu version checked: docs/reference/libtpu.md); slice
shapes, accelerator-type names and link speeds from the Cloud TPU documentation (each
generation's ``source``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal

__all__ = [
    "Generation",
    "format_shape",
    "generations",
    "get_generation",
    "register_generation",
    "subset_products",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    """One TPU generation: how its chips, hosts and slices are laid out, and its link speeds.

    Slice shapes follow one of two rules, chosen by ``torus_ndim``:

    * 3-D (v4, v5p, v7x): chips sit in 4x4x4 *cubes* joined by optical circuit switches. A slice
      is either one of ``small_shapes`` (less than a cube: 2x2x1, 2x2x2, 2x2x4, 2x4x4) or
      ``AxBxC`` with ``A <= B <= C``, every side a multiple of 4 (whole cubes), and at most
      ``max_chips_per_slice`` chips. Whole-cube slices are full 3-D tori (every axis wraps
      around); smaller ones are 3-D meshes without wraparound.
    * 2-D (v5e, v6e): a pod is one 16x16 2-D torus; a slice is one of ``small_shapes`` (1x1 up
      to 16x16). An axis wraps around only where the slice spans the pod's full side
      (``pod_side`` chips); a smaller slice is a 2-D mesh along that axis. The Cloud docs only
      say "2D torus" for the pod; JAX's v5e mesh handler builds explicit snake rings for 2x2,
      2x4 and 4x4 slices, which it would not need if those slices wrapped around.
    """

    name: str
    """Canonical name: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``, ``"v7x"``."""
    aliases: tuple[str, ...] = ()
    """Other names it goes by; each also works as an accelerator-type prefix (``v5e-16``)."""
    device_kind: str
    """``jax.Device.device_kind`` of its devices as the TPU runtime reports it: how real TPU
    devices are recognised (v5p reports ``"TPU v5"``, not ``"TPU v5p"``)."""
    other_device_kinds: tuple[str, ...] = ()
    """Other spellings of ``device_kind`` that JAX knows for this generation (also accepted)."""
    libtpu_name: str | None = None
    """The generation's name in libtpu's topology names (``"tpu7x"`` in ``"tpu7x:4x4x4"``), or
    ``None`` when libtpu cannot describe it."""
    torus_ndim: Literal[2, 3]
    """Dimensions of the chip grid of a slice."""
    tensorcores_per_chip: int
    """TensorCores on one chip."""
    devices_per_chip: int
    """JAX devices (so ranks) per chip: 2 on v7x, whose chiplets are separate devices; else 1."""
    chips_per_host: int
    """Chips attached to one host (TPU VM) of a multi-host slice."""
    host_shape: tuple[int, ...]
    """The block of the chip grid that one host of a multi-host slice holds."""
    single_host_chips: int | None = None
    """The largest slice (in chips) that one host serves alone; ``None`` means
    ``chips_per_host``. 8 on v5e/v6e, whose 8-chip VMs hold a whole 2x4 slice while their
    multi-host slices are made of 4-chip (2x2) hosts."""
    accelerator_prefix: str
    """The prefix of its Cloud TPU accelerator types (``"v5litepod"`` in ``v5litepod-16``)."""
    accelerator_type_counts: Literal["chips", "tensorcores"]
    """What ``N`` counts in the accelerator type ``<prefix>-N`` (``v5p-128`` is 64 chips)."""
    small_shapes: tuple[tuple[int, ...], ...]
    """Documented slice shapes: all of them (2-D), or those smaller than one cube (3-D)."""
    max_chips_per_slice: int
    """Largest single slice, in chips."""
    pod_side: int | None = None
    """2-D only: chips along a side of the pod's torus; such a full side wraps around."""
    ici_gbytes_per_s: float
    """Bidirectional ICI bandwidth per chip, GB/s, summed over its ``ici_ports`` links."""
    ici_ports: int
    """ICI links per chip (6 on a 3-D torus, 4 on a 2-D one)."""
    dcn_gbits_per_s: float
    """Data-center-network bandwidth per chip, Gb/s."""
    source: str
    """Where the figures come from."""
    peak_bf16_tflops_per_chip: float | None = None
    """Peak dense bf16 matrix throughput of one chip, TFLOP/s (1e12), as Cloud TPU's docs state
    it; ``None``: not known (the step estimate then has no compute time). Per device:
    :attr:`peak_bf16_flops_per_device`."""
    hbm_gib_per_chip: float | None = None
    """HBM capacity of one chip, GiB (2**30 bytes); ``None``: not known. Per device:
    :attr:`hbm_bytes_per_device`."""
    hbm_gbytes_per_s_per_chip: float | None = None
    """HBM bandwidth of one chip, GB/s (1e9 bytes); ``None``: not known. Per device:
    :attr:`hbm_bytes_per_s_per_device`."""
    compute_source: str = ""
    """Where the three compute and memory figures above come from (a Cloud TPU docs page)."""
    mxu_size: int | None = None
    """Side of the MXU's systolic array (its matmul tile), or None: not known. 128 on v4, v5e
    and v5p, 256 on v6e (the JAX scaling book, "How to Scale Your Model", the TPU chapter: 128 x
    128 up to v5, 256 x 256 on v6e; cloud.google.com/tpu/docs/v6e: two MXUs a TensorCore);
    TPU7x: 256, **assumed** as v6e's (no source stored here states Ironwood's). The predicted
    step pads each matmul's dimensions to it (:func:`tpu_dist.compile_job.predict_step`)."""
    collectives_span_slice: bool = False
    """Whether the TPU compiler compiles a collective over part of a slice only inside a program
    over the whole slice (libtpu, docs/reference/libtpu.md; on v5e: ``device assignment should
    include all slice devices``, "limited ICI routing"; on v6e: ``Unexpected device_id ... in
    replica group`` for many groups). The "tpu" backend then runs a mesh dimension's collectives
    as family programs (``tpu_dist.collectives.ProgramKey.groups``). Measured with libtpu's
    compile-only devices: docs/decisions/0020-family-programs.md."""
    collective_compiler_options: tuple[tuple[str, bool | int | str], ...] = ()
    """XLA:TPU compiler options (``lowered.compile(compiler_options=...)``) every collective
    program of the "tpu" backend is compiled with on this generation, as (name, value) pairs.
    TPU7x: ``xla_tpu_enable_sparse_core_collective_offload_all_reduce=False``. libtpu
    (docs/reference/libtpu.md) fails an all-reduce over a whole TPU7x slice of more than about
    32 KiB a device (``RET_CHECK ... async-update instruction should have 1 operands but sees
    2``) unless this SparseCore offload is off; XLA turns whole-slice all-gathers and
    reduce-scatters into such all-reduces, so FSDP over a whole slice did not compile. With the
    option they compile (an all-reduce over the slice, as before), and the programs over part of
    a slice that compiled without it compile to the same HLO but for instruction names and order
    (docs/decisions/0021-tpu7x-sparsecore-all-reduce-offload-off.md;
    benchmarks/slice_programs.py)."""

    all_gather_block_multiple: int = 1
    """The "tpu" backend pads each rank's all-gather block (in words: ``_plan_blocks.words``) to a
    multiple of this many elements on this generation (and of
    ``tpu_dist.collectives._plan_algorithms.TPU_BLOCK_ALIGN``, 128, on every TPU), and drops the padding
    from the result.
    1,024 on every generation in the table (the 1-D tile of XLA:TPU's layouts). libtpu
    (docs/reference/libtpu.md has the version) compiles an int16 (bf16 words) all-gather over 4
    devices of ``tpu7x:2x2x1`` in about 0.6 s when the block is a multiple of 1,024 elements
    (1,000,448, 4,000,768, 30,000,128) and in 5-126 s, with scratch up to 3.5x the output, when
    it is not (1,000,064, 4,000,000, 30,000,000); int32 blocks of 4,000,000 compiled fast. On
    v4, v5e and v6e a block of 1,000,064 (a multiple of 128, not of 1,024) took 16-33 s and
    1.1-1.3 GiB, 1,000,448 0.4-1.4 s; across two v5p slices 1,000,000 took 80 s and 3.2 GiB,
    1,000,448 1.7 s (docs/decisions/0022-tpu-block-alignment.md). The padding costs at most
    1,023 elements a rank and a copy of the block and of the result."""

    def __post_init__(self) -> None:
        if self.torus_ndim not in (2, 3):
            raise ValueError(f"torus_ndim must be 2 or 3, got {self.torus_ndim=}")
        if len(self.host_shape) != self.torus_ndim or math.prod(self.host_shape) != (
            self.chips_per_host
        ):
            raise ValueError(
                f"host_shape must be a {self.torus_ndim}-D block of chips_per_host chips, got "
                f"{self.host_shape=} {self.chips_per_host=}"
            )
        if self.devices_per_chip not in (1, self.tensorcores_per_chip):
            raise ValueError(
                f"devices_per_chip must be 1 or tensorcores_per_chip, got "
                f"{self.devices_per_chip=} {self.tensorcores_per_chip=}"
            )
        if self.single_host_chips is not None and self.single_host_chips < self.chips_per_host:
            raise ValueError(
                f"single_host_chips must be at least chips_per_host, got "
                f"{self.single_host_chips=} {self.chips_per_host=}"
            )
        if self.torus_ndim == 2 and self.pod_side is None:
            raise ValueError(f"a 2-D generation needs pod_side, got {self.name=}")
        for field in ("peak_bf16_tflops_per_chip", "hbm_gib_per_chip",
                      "hbm_gbytes_per_s_per_chip"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(
                    f"{field} must be positive or None (not known), got {value!r} for "
                    f"{self.name}"
                )

    # -- one device's compute and memory -------------------------------------------------------
    #
    # A JAX device (a rank) is a whole chip on v4 and v5p (megacore: one device drives both
    # TensorCores), v5e and v6e (one TensorCore), and one of the two TensorCores of a TPU7x chip
    # (``devices_per_chip == 2``): each per-device figure is the chip's over devices_per_chip.
    # TPU7x: 2,307 / 2 = 1,153.5 TFLOP/s, 192 / 2 = 96 GiB, 7,380 / 2 = 3,690 GB/s per device.

    @property
    def peak_bf16_flops_per_device(self) -> float | None:
        """Peak dense bf16 FLOP/s of one JAX device (the chip's over ``devices_per_chip``)."""
        if self.peak_bf16_tflops_per_chip is None:
            return None
        return self.peak_bf16_tflops_per_chip * 1e12 / self.devices_per_chip

    @property
    def hbm_bytes_per_device(self) -> int | None:
        """HBM bytes of one JAX device (the chip's over ``devices_per_chip``)."""
        if self.hbm_gib_per_chip is None:
            return None
        return int(self.hbm_gib_per_chip * 2**30) // self.devices_per_chip

    @property
    def hbm_bytes_per_s_per_device(self) -> float | None:
        """HBM bytes/s of one JAX device (the chip's over ``devices_per_chip``)."""
        if self.hbm_gbytes_per_s_per_chip is None:
            return None
        return self.hbm_gbytes_per_s_per_chip * 1e9 / self.devices_per_chip

    # -- slice shapes ---------------------------------------------------------------------------

    def is_valid_shape(self, shape: Sequence[int]) -> bool:
        """Whether ``shape`` is a slice shape of this generation (see the class docstring)."""
        shape = tuple(shape)
        if len(shape) != self.torus_ndim:
            return False
        if shape in self.small_shapes:
            return True
        if self.torus_ndim == 2:
            return False
        return (
            all(s % 4 == 0 and s > 0 for s in shape)
            and list(shape) == sorted(shape)
            and math.prod(shape) <= self.max_chips_per_slice
        )

    def shapes_with_chips(self, num_chips: int) -> list[tuple[int, ...]]:
        """Every valid slice shape of ``num_chips`` chips, the most cube-like first."""
        found = [s for s in self.small_shapes if math.prod(s) == num_chips]
        if (
            self.torus_ndim == 3
            and num_chips % 64 == 0
            and 0 < num_chips <= self.max_chips_per_slice
        ):
            cubes = num_chips // 64
            for a in range(1, cubes + 1):
                for b in range(a, cubes // a + 1):
                    if cubes % (a * b) == 0 and cubes // (a * b) >= b:
                        found.append((4 * a, 4 * b, 4 * (cubes // (a * b))))
        return sorted(set(found), key=lambda s: (max(s), -min(s), s))

    def default_shape(self, num_chips: int) -> tuple[int, ...]:
        """The slice shape Cloud TPU gives ``num_chips`` chips: the most cube-like one.

        Raises:
            ValueError: no slice of this generation has ``num_chips`` chips.
        """
        shapes = self.shapes_with_chips(num_chips)
        if not shapes:
            raise ValueError(
                f"no {self.name} slice has {num_chips} chips; {self.name} slices have "
                f"{_format_counts(self.valid_chip_counts())} chips ({self.describe_shapes()})"
            )
        return shapes[0]

    def valid_chip_counts(self, limit: int = 64) -> list[int]:
        """Chip counts of valid slices, smallest first (at most ``limit`` of them)."""
        counts = sorted({math.prod(s) for s in self.small_shapes})
        if self.torus_ndim == 3:
            counts += range(64, self.max_chips_per_slice + 1, 64)
        return sorted(set(counts))[:limit]

    def describe_shapes(self) -> str:
        """The shape rule in words, for error messages."""
        small = ", ".join(format_shape(s) for s in self.small_shapes)
        if self.torus_ndim == 2:
            return f"{self.name} slice shapes: {small}"
        return (
            f"{self.name} slice shapes: {small}, or AxBxC with A<=B<=C, each a multiple of 4 "
            f"(whole 4x4x4 cubes), at most {self.max_chips_per_slice} chips, e.g. 4x4x4, "
            "4x4x8, 8x16x16"
        )

    def check_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """``shape`` as a tuple, if it is a valid slice shape.

        Raises:
            ValueError: it is not; the message lists the shapes of that many chips, if any.
        """
        shape = tuple(int(s) for s in shape)
        if self.is_valid_shape(shape):
            return shape
        if len(shape) != self.torus_ndim:
            raise ValueError(
                f"a {self.name} slice is a {self.torus_ndim}-D grid of chips, got "
                f"topology {format_shape(shape)}; {self.describe_shapes()}"
            )
        n = math.prod(shape)
        same = self.shapes_with_chips(n)
        hint = (
            f"{n}-chip {self.name} slices: {', '.join(map(format_shape, same))}"
            if same
            else f"no {self.name} slice has {n} chips"
        )
        raise ValueError(
            f"{format_shape(shape)} is not a {self.name} slice shape ({hint}); "
            f"{self.describe_shapes()}"
        )

    def wraparound(self, shape: Sequence[int]) -> tuple[bool, ...]:
        """For each axis of a slice of ``shape``, whether its ICI links wrap around (a ring)."""
        if self.torus_ndim == 3:
            whole_cubes = all(s % 4 == 0 for s in shape)
            return tuple(whole_cubes for _ in shape)
        return tuple(s == self.pod_side for s in shape)

    def host_block(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The block of chips one host holds in a slice of ``shape``.

        A slice of at most :attr:`max_single_host_chips` chips (v5e 1x1, 2x2, 2x4; v5p 2x2x1) is
        a single host holding the whole slice; a larger one is split into ``host_shape`` blocks.
        """
        shape = tuple(shape)
        if math.prod(shape) <= self.max_single_host_chips:
            return shape
        if any(s % h for s, h in zip(shape, self.host_shape)):
            raise ValueError(
                f"a {format_shape(shape)} {self.name} slice does not split into hosts of "
                f"{format_shape(self.host_shape)} chips"
            )
        return self.host_shape

    @property
    def max_single_host_chips(self) -> int:
        """The largest slice, in chips, that one host serves alone."""
        return self.single_host_chips or self.chips_per_host

    @property
    def device_kinds(self) -> tuple[str, ...]:
        """Every ``device_kind`` spelling that names this generation, the runtime's first."""
        return (self.device_kind, *self.other_device_kinds)

    def accelerator_type(self, num_chips: int) -> str:
        """The Cloud TPU accelerator type of a slice of ``num_chips`` chips (``"v5p-128"``)."""
        per_chip = self.tensorcores_per_chip if self.accelerator_type_counts == "tensorcores" else 1
        return f"{self.accelerator_prefix}-{num_chips * per_chip}"


# -- the registry of generations -----------------------------------------------------------------

_GENERATIONS: dict[str, Generation] = {}
_BY_ALIAS: dict[str, Generation] = {}
_BY_DEVICE_KIND: dict[str, Generation] = {}


def register_generation(generation: Generation) -> Generation:
    """Add a generation (or replace one of the same name); its name and aliases become valid.

    The extension seam for TPU generations this package does not know yet.
    """
    for alias in _names(generation):
        other = _BY_ALIAS.get(alias)
        if other is not None and other.name != generation.name:
            raise ValueError(f"{alias=} of {generation.name} already names {other.name}")
    for kind in generation.device_kinds:
        other = _BY_DEVICE_KIND.get(kind)
        if other is not None and other.name != generation.name:
            raise ValueError(
                f"device kind {kind!r} of {generation.name} is already {other.name}'s; a device "
                "kind names one generation"
            )
    old = _GENERATIONS.get(generation.name)
    if old is not None:
        for alias in _names(old):
            _BY_ALIAS.pop(alias, None)
        for kind in old.device_kinds:
            _BY_DEVICE_KIND.pop(kind, None)
    _GENERATIONS[generation.name] = generation
    for alias in _names(generation):
        _BY_ALIAS[alias] = generation
    for kind in generation.device_kinds:
        _BY_DEVICE_KIND[kind] = generation
    return generation


def _names(generation: Generation) -> set[str]:
    return {
        n.lower() for n in (generation.name, generation.accelerator_prefix, *generation.aliases)
    }


def get_generation(name: str | Generation) -> Generation:
    """The generation called ``name`` (a canonical name or an alias, any case).

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    if isinstance(name, Generation):
        return name
    found = _BY_ALIAS.get(str(name).strip().lower())
    if found is None:
        raise ValueError(f"unknown TPU generation {name!r}; supported: {_supported_names()}")
    return found


def generation_of_device_kind(device_kind: str) -> Generation | None:
    """The registered generation whose devices report ``device_kind`` (JAX's
    ``Device.device_kind``, e.g. ``"TPU v5 lite"``), or None if none does."""
    return _BY_DEVICE_KIND.get(device_kind)


def generations() -> Mapping[str, Generation]:
    """The registered generations by canonical name (read-only view)."""
    return MappingProxyType(_GENERATIONS)


def _supported_names() -> str:
    parts = []
    for g in _GENERATIONS.values():
        others = sorted(_names(g) - {g.name.lower()})
        parts.append(f"{g.name} (also {', '.join(others)})" if others else g.name)
    return "; ".join(parts)


_CUBE_SMALL_SHAPES = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
_POD_2D_SHAPES = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))

V4 = register_generation(
    Generation(
        name="v4",
        device_kind="TPU v4",
        mxu_size=128,
        libtpu_name="v4",
        torus_ndim=3,
        tensorcores_per_chip=2,
        devices_per_chip=1,
        chips_per_host=4,
        host_shape=(2, 2, 1),
        accelerator_prefix="v4",
        accelerator_type_counts="tensorcores",
        small_shapes=_CUBE_SMALL_SHAPES,
        max_chips_per_slice=4096,
        ici_gbytes_per_s=540.0,
        ici_ports=6,
        dcn_gbits_per_s=25.0,
        source=(
            "shapes, megacore, 4096-chip pod: cloud.google.com/tpu/docs/v4 and "
            "/tpu/docs/types-topologies (AxBxC, A<=B<=C, all <=4 or all multiples of 4); "
            "ICI: 6 links x 45 GB/s each way (jax-ml.github.io/scaling-book/tpus); "
            "DCN: not published for v4, 25 Gb/s per chip is an estimate; device kind, 2x2x1 "
            "hosts and one megacore device per chip: libtpu 0.0.52 (chip_config_name='megacore')"
        ),
        peak_bf16_tflops_per_chip=275.0,
        hbm_gib_per_chip=32.0,
        hbm_gbytes_per_s_per_chip=1200.0,
        compute_source=(
            "cloud.google.com/tpu/docs/v4 (System architecture): peak compute per chip 275 "
            "TFLOP/s (bf16 or int8), HBM2 32 GiB at 1200 GB/s; one megacore device per chip"
        ),
        all_gather_block_multiple=1024,
    )
)
V5E = register_generation(
    Generation(
        name="v5e",
        collectives_span_slice=True,
        aliases=("v5lite",),
        device_kind="TPU v5 lite",
        mxu_size=128,
        other_device_kinds=("TPU v5e",),  # jax/_src/mesh_utils.py knows this spelling too
        libtpu_name="v5e",
        torus_ndim=2,
        tensorcores_per_chip=1,
        devices_per_chip=1,
        chips_per_host=4,
        host_shape=(2, 2),
        single_host_chips=8,
        accelerator_prefix="v5litepod",
        accelerator_type_counts="chips",
        small_shapes=_POD_2D_SHAPES,
        max_chips_per_slice=256,
        pod_side=16,
        ici_gbytes_per_s=400.0,
        ici_ports=4,
        dcn_gbits_per_s=25.0,
        source=(
            "cloud.google.com/tpu/docs/v5e: 400 GB/s bidirectional ICI per chip, 4 ICI ports, "
            "2 x 100 Gb/s NICs per 8-chip host (25 Gb/s per chip), 16x16 2-D torus pod; hosts: "
            "slices up to 8 chips are one VM (ct5lp-hightpu-1t/4t/8t, v5litepod-8 is one 2x4 "
            "host), multi-host slices are made of 4-chip 2x2 VMs (ct5lp-hightpu-4t, "
            "cloud.google.com/kubernetes-engine/docs/concepts/tpus), as libtpu 0.0.52 lays "
            "them out"
        ),
        peak_bf16_tflops_per_chip=197.0,
        hbm_gib_per_chip=16.0,
        hbm_gbytes_per_s_per_chip=819.0,
        compute_source=(
            "cloud.google.com/tpu/docs/v5e (System architecture): peak compute per chip (bf16) "
            "197 TFLOP/s, HBM 16 GiB at 819 GB/s (older versions of the page say '16 GB' and "
            "'800 GiBps'; the current table's 16 GiB / 819 GBps is used)"
        ),
        all_gather_block_multiple=1024,
    )
)
V5P = register_generation(
    Generation(
        name="v5p",
        # What the runtime reports (libtpu: docs/reference/libtpu.md; JAX's TPU tests and
        # MaxText match on it).
        device_kind="TPU v5",
        mxu_size=128,
        other_device_kinds=("TPU v5p",),  # jax/_src/mesh_utils.py's spelling
        libtpu_name="v5p",
        torus_ndim=3,
        tensorcores_per_chip=2,
        devices_per_chip=1,
        chips_per_host=4,
        host_shape=(2, 2, 1),
        accelerator_prefix="v5p",
        accelerator_type_counts="tensorcores",
        small_shapes=_CUBE_SMALL_SHAPES,
        max_chips_per_slice=6144,
        ici_gbytes_per_s=1200.0,
        ici_ports=6,
        dcn_gbits_per_s=50.0,
        source=(
            "cloud.google.com/tpu/docs/v5p: 1200 GB/s bidirectional ICI and 50 Gb/s DCN per "
            "chip, 4-chip VMs, slices up to 16x16x24 (6144 chips), 4x4x4 and larger are full "
            "3-D tori; device kind 'TPU v5' and 2x2x1 hosts: libtpu 0.0.52"
        ),
        peak_bf16_tflops_per_chip=459.0,
        hbm_gib_per_chip=95.0,
        hbm_gbytes_per_s_per_chip=2765.0,
        compute_source=(
            "cloud.google.com/tpu/docs/v5p (System architecture): peak compute per chip (BF16) "
            "459 TFLOP/s, HBM capacity per chip 95 GiB, HBM bandwidth 2765 GB/s; one megacore "
            "device per chip"
        ),
        all_gather_block_multiple=1024,
    )
)
V6E = register_generation(
    Generation(
        name="v6e",
        collectives_span_slice=True,
        aliases=("trillium",),
        device_kind="TPU v6 lite",
        mxu_size=256,
        libtpu_name="v6e",
        torus_ndim=2,
        tensorcores_per_chip=1,
        devices_per_chip=1,
        chips_per_host=4,
        host_shape=(2, 2),
        single_host_chips=8,
        accelerator_prefix="v6e",
        accelerator_type_counts="chips",
        small_shapes=_POD_2D_SHAPES,
        max_chips_per_slice=256,
        pod_side=16,
        ici_gbytes_per_s=800.0,
        ici_ports=4,
        dcn_gbits_per_s=100.0,
        source=(
            "cloud.google.com/tpu/docs/v6e and /tpu/docs/tpu7x: 800 GB/s bidirectional ICI per "
            "chip, 4 ICI ports, 4 x 200 Gb/s NICs per 8-chip host (100 Gb/s per chip), 16x16 "
            "2-D torus pod; hosts: slices up to 8 chips are one VM (ct6e-standard-1t/4t/8t, "
            "v6e-8 is one 2x4 host), multi-host slices are made of 4-chip 2x2 VMs "
            "(ct6e-standard-4t), as libtpu 0.0.52 lays them out"
        ),
        peak_bf16_tflops_per_chip=918.0,
        hbm_gib_per_chip=32.0,
        hbm_gbytes_per_s_per_chip=1638.0,
        compute_source=(
            "cloud.google.com/tpu/docs/v6e (System architecture): peak compute per chip (bf16) "
            "918 TFLOP/s, HBM bandwidth 1638 GB/s; capacity 32 GiB from the comparison table "
            "of cloud.google.com/tpu/docs/tpu7x ('HBM capacity per chip (GiB)': 32; the v6e "
            "page itself says '32 GB')"
        ),
        all_gather_block_multiple=1024,
    )
)
V7X = register_generation(
    Generation(
        name="v7x",
        aliases=("ironwood",),
        device_kind="TPU7x",
        mxu_size=256,
        libtpu_name="tpu7x",
        torus_ndim=3,
        tensorcores_per_chip=2,
        devices_per_chip=2,
        chips_per_host=4,
        host_shape=(2, 2, 1),
        accelerator_prefix="tpu7x",
        accelerator_type_counts="tensorcores",
        small_shapes=_CUBE_SMALL_SHAPES,
        max_chips_per_slice=9216,
        ici_gbytes_per_s=1200.0,
        ici_ports=6,
        dcn_gbits_per_s=100.0,
        source=(
            "cloud.google.com/tpu/docs/tpu7x: 1200 GB/s bidirectional ICI and 100 Gb/s DCN per "
            "chip, two TensorCores per chip exposed as two devices, 4-chip VMs, 9216-chip pod; "
            "the slice shapes are assumed to follow v5p's cube rules; device kind, two devices "
            "per chip (core_on_chip 0/1) and 2x2x1-chip hosts: libtpu 0.0.52"
        ),
        peak_bf16_tflops_per_chip=2307.0,
        hbm_gib_per_chip=192.0,
        hbm_gbytes_per_s_per_chip=7380.0,
        compute_source=(
            "cloud.google.com/tpu/docs/tpu7x (System architecture): peak compute per chip "
            "(BF16) 2307 TFLOP/s, HBM capacity per chip 192 GiB at 7380 GB/s; two devices per "
            "chip, so 1153.5 TFLOP/s, 96 GiB and 3690 GB/s per device"
        ),
        collective_compiler_options=(
            ("xla_tpu_enable_sparse_core_collective_offload_all_reduce", False),
        ),
        all_gather_block_multiple=1024,
    )
)


# -- helpers -------------------------------------------------------------------------------------


def format_shape(shape: Iterable[int]) -> str:
    return "x".join(str(s) for s in shape)


def _format_counts(counts: Sequence[int]) -> str:
    if len(counts) > 10:
        return ", ".join(map(str, counts[:10])) + f", ... {counts[-1]}"
    return ", ".join(map(str, counts))


def subset_products(sides: Iterable[int]) -> list[int]:
    """Products of every non-empty subset of ``sides``, sorted: the sizes of whole-axis groups."""
    sides = list(sides)
    return sorted(
        {
            math.prod(c)
            for k in range(1, len(sides) + 1)
            for c in itertools.combinations(sides, k)
        }
    )
