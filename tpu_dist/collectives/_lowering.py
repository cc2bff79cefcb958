"""Each collective as an XLA program, and the cache of compiled programs.

A program runs SPMD over the group's devices: a one-axis ``jax.sharding.Mesh``
whose axis ``"x"`` lists the group's JAX devices in group-rank order. Every
argument and result is a 1-D array sharded along ``"x"``: the block a rank
owns is the flat tensor it passes in or gets back, so a group rank only ever
touches its own block. Example, all_reduce of 3 floats on 2 ranks::

    global input  (6,) = [a0 a1 a2 | b0 b1 b2]      rank 0 owns a, rank 1 owns b
    body (per block)   psum(x, "x")
    global output (6,) = [s0 s1 s2 | s0 s1 s2]      s = a + b, each rank reads its block

A group registered as one of a *family* (the equal groups of a mesh dimension,
``tpu_dist.mesh.register_mesh``) runs a *family program* instead: one program over
every device of the family, on a mesh ``("g", "x")`` whose rows are the groups, the
collective over ``"x"`` (XLA's replica groups are the family's groups). The body is the
same; each rank still passes and gets back only its own block. Every group of the
family has the same key, so the program is compiled once for all of them. On TPU v5e
and v6e this is the only way a collective over part of a slice compiles (libtpu
requires the program to span the slice); on CPU only the group's members take part
(XLA:CPU makes one communicator per replica group), as with a group's own program.

Programs are built once per :class:`ProgramKey` (op, reduce op, group
devices, block sizes, dtypes) and kept, in memory by the process's
:class:`ProgramCache` (the runtime's ``programs``) and on disk for
later processes (:mod:`tpu_dist.collectives._compile_cache`). On CPU a program is
compiled once per key *without* its devices: a group of the same size and layout
loads the one another group compiled, onto its own devices (~2 ms instead of
35-320 ms; ``_compile_cache``'s doc says why that is correct there and not on TPU).
:func:`tpu_dist.collectives.compile_count` tells how many programs this process has built, so tests can
check that a steady loop builds nothing new. The functions that build program
bodies and lower them are pure: this module keeps no state of its own.

The algorithm is part of the key (:attr:`ProgramKey.algorithm`), chosen when the call is
planned (:func:`tpu_dist.collectives._plan_algorithms.choose_algorithm`: on the CPU platform,
reduce-scatters and small all-reduces and all-gathers run as all-to-all exchanges instead of
XLA's own rings, which are slow there); lowering follows it.

Data-movement programs (gather, scatter, broadcast, all-to-all, permute) move
raw words (int8/16/32 views of any dtype), so they are exact for every dtype
and share programs across dtypes of one width.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_dist import _settings
from tpu_dist.collectives import _compile_cache, _jaxlib
from tpu_dist.collectives._types import Kind, ProgramKey
from tpu_dist.mesh import generation_of_device_kind

logger = logging.getLogger(__name__)

AXIS = "x"
"""The name of the mesh axis every program's collective runs over (the group's ranks)."""
GROUPS_AXIS = "g"
"""A family program's outer mesh axis: one row per group of the family."""


@dataclass(frozen=True)
class Program:
    """A compiled program and the fastest way this process has to start it."""

    compiled: jax.stages.Compiled
    execute: Callable[[list[jax.Array]], list[jax.Array]] | None
    """The loaded executable's own ``execute`` on this rank's single-device blocks, when the
    program has exactly one device in this process (always, with one device per rank); None
    otherwise, or when jaxlib does not offer it."""


def mesh_of(devices: Sequence[jax.Device], groups: int = 1) -> tuple[Mesh, NamedSharding]:
    """The program's mesh over ``devices`` and the 1-D sharding of its blocks (not cached).

    One group: one axis ``"x"``, the group's ranks. A family program of ``groups`` groups:
    axes ``("g", "x")``, row ``i`` the ``i``-th group (``devices`` lists them group after
    group), so a collective over ``"x"`` has the family's groups as replica groups; blocks
    are sharded over both axes, ``devices[j]`` owning block ``j``.
    """
    array = np.array(list(devices), dtype=object)
    if groups == 1:
        mesh = Mesh(array, (AXIS,))
        return mesh, NamedSharding(mesh, P(AXIS))
    mesh = Mesh(array.reshape(groups, -1), (GROUPS_AXIS, AXIS))
    return mesh, NamedSharding(mesh, P((GROUPS_AXIS, AXIS)))


PROGRAM_BYTES = 512 * 1024
"""What one compiled collective program is counted as holding in the process's memory (its
code, XLA's executable and JAX's objects around it), for :class:`ProgramCache`'s budget:
measured on CPU (jaxlib 0.10.2, 100 programs of each kind built, then all dropped), 0.3-0.8 MiB
each (all-reduces, all-gathers, uneven all-to-alls), all of it freed when the program is
dropped (docs/decisions/0033-varying-sizes-and-memory.md). XLA:CPU reports no code size
(``memory_analysis()``'s ``generated_code_size_in_bytes`` is 0), so a measured figure it is."""


@dataclass(frozen=True)
class ProgramCacheInfo:
    """What a :class:`ProgramCache` holds (:func:`tpu_dist.collectives.program_cache_info`)."""

    programs: int
    """Compiled programs held."""
    serialized: int
    """Serialized programs held (CPU: one per size and layout, loaded onto a new group's
    devices in ~2 ms instead of compiling)."""
    bytes: int
    """What they are counted as holding: :data:`PROGRAM_BYTES` a program, plus the
    serialized programs' own bytes."""
    budget_bytes: int
    """The most they may hold (``TPU_DIST_PROGRAM_CACHE_MB``); the least recently used are
    dropped past it (at least the program in use is kept)."""
    built: int
    """Programs built so far (``compile_count()``): compiled, or loaded; a dropped program
    built again counts again."""
    dropped: int
    """Programs dropped to stay within the budget."""


class ProgramCache:
    """The compiled programs of one process, by key; owned by the runtime
    (its ``programs``), or made on its own by a test.

    Programs are built on first use (on CPU loaded from a program compiled here for another
    group of the same size and layout, else from the on-disk compile cache, else compiled)
    and kept while they fit ``budget_bytes`` (:data:`PROGRAM_BYTES` each, and the serialized
    copies' own bytes): past it the least recently used are dropped, and built again (on CPU
    usually loaded, in milliseconds) if they are needed again. :attr:`compilations` counts the
    builds, :attr:`origins` says where each held program came from, :meth:`info` what is held.
    """

    def __init__(
        self,
        jaxlib: _jaxlib.JaxlibCalls | None = None,
        disk: _compile_cache.CompileCache | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        self.jaxlib = jaxlib if jaxlib is not None else _jaxlib.JaxlibCalls()
        """Which private jaxlib calls still work (the runtime's; a new one if none is given)."""
        self.disk = disk if disk is not None else _compile_cache.CompileCache()
        """The on-disk compile cache (the runtime's; a new one if none is given)."""
        self.budget_bytes = (
            budget_bytes if budget_bytes is not None
            else _settings.PROGRAM_CACHE_MB.get() * 1024 * 1024
        )
        """The most the held programs may count for (class doc; ``TPU_DIST_PROGRAM_CACHE_MB``
        when not given)."""
        self.by_key: collections.OrderedDict[ProgramKey, Program] = collections.OrderedDict()
        """The programs held, least recently used first. Tests may replace an entry (a program
        without its direct ``execute``, to take the public path)."""
        self.compilations = 0
        """How many programs were built: compiled, or loaded (another group's, or from the
        on-disk cache)."""
        self.dropped = 0
        """How many programs were dropped to stay within :attr:`budget_bytes`."""
        self.origins: dict[ProgramKey, str] = {}
        """Where each held program came from: ``"compiled"`` (XLA compiled it here, or JAX's
        persistent cache served it), ``"reused"`` (one this process built for another group of
        the same size and layout, loaded onto this group's devices), ``"disk"`` (the on-disk
        compile cache)."""
        self.platform: str | None = None
        """The running runtime's platform, set when JAX starts: only programs for its devices
        go to the on-disk cache (not those of compile-only devices)."""
        self._meshes: dict[tuple, tuple[Mesh, NamedSharding]] = {}
        self._by_id: dict[int, jax.Device] = {}
        self._serialized: collections.OrderedDict[tuple, _compile_cache.Serialized] = (
            collections.OrderedDict()
        )
        """CPU programs XLA compiled (never loaded ones: ``_compile_cache``'s doc), serialized,
        by :func:`._compile_cache.placement_key`, least recently used first: the next group of
        the same size and layout loads one (~2 ms) instead of compiling (35-320 ms)."""
        self._serialized_bytes = 0
        self._lock = threading.Lock()
        self._skip_reasons: set[str] = set()

    def mesh_for(
        self, devices: Sequence[jax.Device], groups: int = 1
    ) -> tuple[Mesh, NamedSharding]:
        """:func:`mesh_of` ``devices``, cached by the device objects, not their ids:
        compile-only TPU devices (:mod:`tpu_dist.collectives.compile_only`) reuse the ids of
        the process's own devices."""
        ids = (tuple(devices), groups)
        found = self._meshes.get(ids)
        if found is None:
            found = self._meshes[ids] = mesh_of(devices, groups)
        return found

    def program_devices(
        self, key: ProgramKey, devices: Sequence[jax.Device]
    ) -> Sequence[jax.Device]:
        """The devices ``key``'s program runs over, given the calling group's ``devices``:
        those, or for a family program (``key.groups > 1``) every device its key names (the
        same client's)."""
        if key.groups == 1:
            return devices
        if not self._by_id:
            self._by_id = {d.id: d for d in devices[0].client.devices()}
        return [self._by_id[i] for i in key.devices]

    def program(self, key: ProgramKey, devices: Sequence[jax.Device]) -> Program:
        """The compiled program for ``key`` over ``devices`` (the group's), built on first
        use (and again after it was dropped: class doc)."""
        found = self.by_key.get(key)
        if found is not None:
            try:
                self.by_key.move_to_end(key)  # the most recently used (atomic: the GIL)
            except KeyError:  # dropped by another thread just now: the caller still has it
                pass
            return found
        with self._lock:
            found = self.by_key.get(key)
            if found is None:
                compiled = self._load_or_compile(key, self.program_devices(key, devices))
                found = Program(compiled, self.jaxlib.loaded_execute(compiled))
                self.by_key[key] = found
                self._trim()
        return found

    def held_bytes(self) -> int:
        """What the held programs count for (:class:`ProgramCacheInfo`'s ``bytes``)."""
        return len(self.by_key) * PROGRAM_BYTES + self._serialized_bytes

    def info(self) -> ProgramCacheInfo:
        """What this cache holds, and has built and dropped."""
        return ProgramCacheInfo(
            programs=len(self.by_key), serialized=len(self._serialized),
            bytes=self.held_bytes(), budget_bytes=self.budget_bytes,
            built=self.compilations, dropped=self.dropped,
        )

    def _trim(self) -> None:
        """Drop the least recently used programs (then serialized copies) past the budget;
        the newest program stays (it is about to run). Holds :attr:`_lock`."""
        while self.held_bytes() > self.budget_bytes:
            if len(self.by_key) > 1:
                key, _ = self.by_key.popitem(last=False)
                self.origins.pop(key, None)
                self.dropped += 1
            elif self._serialized:
                _, kept = self._serialized.popitem(last=False)
                self._serialized_bytes -= len(kept.blob)
            else:
                return

    def _keep_serialized(self, placement: tuple, kept: _compile_cache.Serialized) -> None:
        """Keep ``kept`` for other groups of the same size and layout (holds :attr:`_lock`)."""
        if placement in self._serialized:
            self._serialized.move_to_end(placement)
            return
        self._serialized[placement] = kept
        self._serialized_bytes += len(kept.blob)

    def run(
        self, key: ProgramKey, devices: Sequence[jax.Device], local_blocks: Sequence[jax.Array]
    ) -> list[jax.Array]:
        """Dispatch ``key``'s program on this rank's blocks; returns this rank's result blocks.

        Asynchronous: the returned arrays are futures of JAX's dispatch; the data has moved
        once they are ready.

        The loaded executable's own ``execute`` takes and returns the local single-device blocks.
        ``Compiled.__call__`` wants global arrays instead: building one from this rank's block
        (``make_array_from_single_device_arrays``) and taking the block back out of each result
        (``addressable_data``) cost ~120 us of a ~450 us small all_reduce on CPU
        (docs/decisions/0002-direct-dlpack-and-execute.md). The executable is reached through JAX
        internals (:meth:`._jaxlib.JaxlibCalls.loaded_execute`), so anything unexpected falls back
        to the public call.
        """
        found = self.program(key, devices)
        if found.execute is not None:
            # The executable runs on the blocks' own dtypes: no JAX dtype rules apply, so no
            # x64 scope either (~1-2 us a call saved).
            try:
                return found.execute(list(local_blocks))
            except TypeError as err:  # jaxlib changed the private call: the public one now
                self.jaxlib.execute_failed(err)
                found = self.by_key[key] = Program(found.compiled, None)
        with _jaxlib.x64_scope():
            devices = self.program_devices(key, devices)
            _, sharding = self.mesh_for(devices, key.groups)
            size = len(devices)
            global_args = [
                jax.make_array_from_single_device_arrays(
                    (size * block.shape[0],), sharding, [block]
                )
                for block in local_blocks
            ]
            outs = found.compiled(*global_args)
            return [out.addressable_data(0) for out in outs]

    def _load_or_compile(
        self, key: ProgramKey, devices: Sequence[jax.Device]
    ) -> jax.stages.Compiled:
        """``key``'s program: loaded from one this process compiled for another group of the
        same size and layout (CPU only, :func:`._compile_cache.placement_key`), else from the
        on-disk cache (:mod:`._compile_cache`), else compiled and, when XLA really compiled it
        here (not JAX's persistent cache), kept serialized for other groups and stored there.

        With the cache on, one process of the host compiles a new program while the others
        wait for its compile turn (:meth:`._compile_cache.CompileCache.compile_turn`) and load
        it."""
        platform = devices[0].platform if devices else ""
        cached = platform == self.platform
        disk = self.disk
        root = disk.directory(platform) if cached else None
        reuse = cached and platform == "cpu"  # programs serve other groups on CPU only
        placement = _compile_cache.placement_key(key, devices) if reuse else None
        kept = self._serialized.get(placement) if reuse else None
        if kept is not None:
            self._serialized.move_to_end(placement)
        compiled, origin = None, "reused"
        if kept is not None:
            compiled = _compile_cache.deserialize(kept, devices, len(key.blocks))
        if compiled is None:
            found = disk.load(key, devices, platform) if root is not None else None
            if found is None:
                turn = (
                    contextlib.nullcontext() if root is None
                    else disk.compile_turn(_compile_cache.entry_name(key, devices), root)
                )
                with turn:  # ours, or another process's that has ended: it may have stored it
                    if root is not None:
                        found = disk.load(key, devices, platform)
                    if found is None:  # one call site: the program's source metadata is the same
                        compiled, kept = self._compile(
                            key, devices, reuse or root is not None, root is not None
                        )
                        origin = "compiled"
            if found is not None:
                (compiled, kept), origin = found, "disk"
        if kept is not None and reuse:
            self._keep_serialized(placement, kept)
        self.compilations += 1
        self.origins[key] = origin
        return compiled

    def _compile(
        self, key: ProgramKey, devices: Sequence[jax.Device], keep: bool, store: bool
    ) -> tuple[jax.stages.Compiled, _compile_cache.Serialized | None]:
        """Lower and compile ``key``'s program. When XLA really compiled it here and ``keep``
        (it serves other groups, or goes to the on-disk cache), also return it serialized, and
        with ``store`` put it in the on-disk cache."""
        lowered = lower(key, devices, self.mesh_for(devices, key.groups))
        with _jaxlib.x64_scope(), _compile_cache.watch_compile() as watch:
            try:
                compiled = compile_lowered(lowered, devices, key)
            except Exception as err:
                hint = part_of_slice_hint(key, str(err))
                if hint is None:
                    raise
                raise RuntimeError(f"{err}\n{hint}") from err
        kept = None
        platform = devices[0].platform
        if keep and watch.compiled:
            kept = _compile_cache.serialize(key, devices, compiled)
            if kept is not None and store:
                self.disk.store(key, devices, platform, kept)
        elif store and watch.reason not in self._skip_reasons:
            self._skip_reasons.add(watch.reason)
            logger.info(
                "tpu_dist: a %s program is not put in the compile cache: %s. XLA:CPU "
                "cannot serialize a loaded program whole, so only programs compiled here "
                "are stored.",
                key.kind, watch.reason,
            )
        return compiled, kept


_PART_OF_SLICE_ERRORS = (
    "LogicalDeviceCount",  # v5e: "device assignment should include all slice devices"
    "kMaxDeviceCount",  # v6e: "Unexpected device_id ... in replica group"
)
"""How libtpu (docs/reference/libtpu.md) rejects a collective over part of a v5e / v6e slice
(docs/decisions/0020-family-programs-study.md, section 1)."""


def part_of_slice_hint(key: ProgramKey, message: str) -> str | None:
    """What to do, when a group's own program (not a family's) failed to compile for TPU
    because the group is part of a slice (v5e and v6e compile such collectives only as family
    programs); None for any other failure."""
    if key.groups != 1 or not any(marker in message for marker in _PART_OF_SLICE_ERRORS):
        return None
    return (
        f"this TPU generation compiles a collective over part of a slice (here a group of "
        f"{len(key.devices)} devices) only as one program over the whole family of groups it "
        "belongs to: make the group a mesh dimension (tpu_dist.mesh.init_device_mesh), or "
        "register a torch DeviceMesh with tpu_dist.mesh.register_mesh(mesh) on every rank "
        "(after its _flatten() calls, for flattened dimensions); a "
        "new_group used by only some ranks, and send/recv between two ranks, cannot run on "
        "v5e, and only on some device sets of v6e"
    )


FAST_COMPILE_MAX_BYTES = 16 * 1024
"""On CPU, a program whose blocks hold at most this many bytes times the group size (what its
largest local step can touch: an exchange or gather makes ``group size`` rows of a block) is
compiled for a short compilation (:data:`CPU_FAST_COMPILE_OPTIONS`), not for fast code."""

CPU_FAST_COMPILE_OPTIONS: Mapping[str, bool | int | str] = types.MappingProxyType({
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 0,
    "xla_cpu_parallel_codegen_split_count": 1,
})
"""XLA:CPU options for small programs (:data:`FAST_COMPILE_MAX_BYTES`). Most of a collective
program's compilation is generating code for its few local steps (the slices, concatenations
and reductions around the exchange): 20-30 ms each with XLA's default fusion emitters and LLVM
at its default level. With XLA's older fusion code generator, no LLVM optimization and one
code-generation module, the programs compile 2-5x faster (an exchange all-reduce over 2 CPU
devices: 104 -> 20 ms) and, this small, run about as fast (4 KB a rank on 2 devices: within
0-10 us of a call of 40-110 us in one process, where a call between processes takes ~300 us);
from 16 KB a rank the unoptimized code costs up to 2x more a call, so larger programs keep
XLA's defaults (``benchmarks/compile_options.py``,
docs/decisions/0007-fast-compile-for-small-cpu-programs.md). Every rank
compiles a program with the same options (they follow from its key), so all ranks run the
same code, and the results are the same bits as with XLA's defaults (XLA:CPU reassociates
nothing either way: it does not enable fast math)."""


def _block_bytes(key: ProgramKey) -> int:
    return sum(length * jnp.dtype(dtype).itemsize for length, dtype in key.blocks)


def compiler_options(
    devices: Sequence[jax.Device], key: ProgramKey | None = None
) -> dict[str, bool | int | str]:
    """The compiler options a program over ``devices`` is compiled with.

    TPU: those of the devices' generation (``tpu_dist.mesh.Generation.
    collective_compiler_options``; TPU7x: no SparseCore offload of all-reduces, which libtpu fails
    on whole-slice programs: docs/reference/libtpu.md), none for generations that need none or that
    ``tpu_dist.mesh`` does not know. CPU: :data:`CPU_FAST_COMPILE_OPTIONS` for ``key``'s program
    when it is small (:data:`FAST_COMPILE_MAX_BYTES`), else none (XLA's defaults; also without a
    ``key``)."""
    if not devices:
        return {}
    platform = devices[0].platform
    if platform == "cpu":
        if key is not None and _block_bytes(key) * key.group_size <= FAST_COMPILE_MAX_BYTES:
            return dict(CPU_FAST_COMPILE_OPTIONS)
        return {}
    if platform != "tpu":
        return {}
    generation = generation_of_device_kind(devices[0].device_kind)
    return dict(generation.collective_compiler_options) if generation is not None else {}


def compile_lowered(
    lowered: jax.stages.Lowered, devices: Sequence[jax.Device], key: ProgramKey | None = None
) -> jax.stages.Compiled:
    """``lowered.compile()`` with the :func:`compiler_options` of ``devices`` and ``key`` (none:
    the call without options, as JAX's own)."""
    options = compiler_options(devices, key)
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def body_for(key: ProgramKey, devices: Sequence[jax.Device]) -> Callable:
    """The per-block function ``key``'s program runs under ``shard_map`` over ``devices``
    (the program's: a family program's body sees one group, ``key.group_size`` ranks).

    Raises:
        ValueError: ``key.algorithm`` is None or has no program for ``key.kind``.
    """
    factory = _ALGORITHMS.get(key.algorithm, {}).get(key.kind)
    if factory is None:
        raise ValueError(
            f"{key.kind}: no program for algorithm {key.algorithm!r}; choose one with "
            "tpu_dist.collectives._plan_algorithms.choose_algorithm (algorithms per kind: "
            + "; ".join(f"{a}: {', '.join(sorted(b))}" for a, b in _ALGORITHMS.items())
            + ")."
        )
    return factory(len(devices) // key.groups, *key.params)


def lower(
    key: ProgramKey,
    devices: Sequence[jax.Device],
    mesh: tuple[Mesh, NamedSharding] | None = None,
) -> jax.stages.Lowered:
    """``key``'s program over ``devices`` (the program's: every device ``key.devices`` names,
    in that order), lowered (not compiled, not cached, not counted); ``mesh``: :func:`mesh_of`
    ``devices``, if the caller has it.

    Raises:
        TypeError: complex128 blocks on TPU: XLA:TPU has no complex128, and libtpu's compiler
            crashes the process on any complex128 program, even an identity
            (docs/reference/libtpu.md).
    """
    if devices and devices[0].platform == "tpu":
        wide = [dtype for _, dtype in key.blocks if dtype == "complex128"]
        if wide:
            raise TypeError(
                f"{key.kind}: complex128 collectives cannot be compiled for TPU (XLA:TPU has "
                "no complex128); use complex64, or view the tensor as float64 pairs "
                "(torch.view_as_real) for sums."
            )
    mesh, sharding = mesh if mesh is not None else mesh_of(devices, key.groups)
    size = len(devices)
    body = body_for(key, devices)
    n_args = len(key.blocks)
    spec = sharding.spec
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec,) * n_args,
        out_specs=(spec,) * n_args,
        check_vma=False,
    )
    abstract = [
        jax.ShapeDtypeStruct((size * length,), jnp.dtype(dtype), sharding=sharding)
        for length, dtype in key.blocks
    ]
    with _jaxlib.x64_scope():
        return jax.jit(mapped).lower(*abstract)


# ---------------------------------------------------------------------------
# Program bodies. Each factory takes the group size and the key's params and
# returns a function of the local blocks (1-D arrays) that returns a tuple of
# local blocks.


def _axis_reduce(op: str, stacked: jax.Array) -> jax.Array:
    """Reduce ``stacked`` (shape [size, n]) over its first axis with ``op``."""
    if op == "PRODUCT":
        return jnp.prod(stacked, axis=0, dtype=stacked.dtype)
    if op == "MIN":
        return jnp.min(stacked, axis=0)
    if op == "MAX":
        return jnp.max(stacked, axis=0)
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        return jnp.sum(stacked, axis=0, dtype=stacked.dtype)
    bitwise = {"BAND": jnp.bitwise_and, "BOR": jnp.bitwise_or, "BXOR": jnp.bitwise_xor}[op]
    return functools.reduce(bitwise, [stacked[i] for i in range(stacked.shape[0])])


def _finish(op: str, size: int, x: jax.Array) -> jax.Array:
    if op == "AVG":
        return (x / size).astype(x.dtype)
    return x


def _premul(op: str, factor: float | None, x: jax.Array) -> jax.Array:
    if op == "PREMUL_SUM":
        return x * jnp.asarray(factor, dtype=x.dtype)
    return x


def _allreduce(size: int, op: str, factor: float | None = None, *, gather_min_max: bool = False):
    def body(*blocks):
        outs = []
        for x in blocks:
            x = _premul(op, factor, x)
            if op in ("SUM", "AVG", "PREMUL_SUM"):
                y = lax.psum(x, AXIS)
            elif op == "MAX" and not gather_min_max:
                y = lax.pmax(x, AXIS)
            elif op == "MIN" and not gather_min_max:
                y = lax.pmin(x, AXIS)
            else:  # PRODUCT and bitwise ops: XLA all-reduce only sums, mins and maxes.
                y = _axis_reduce(op, lax.all_gather(x, AXIS, axis=0))
            outs.append(_finish(op, size, y))
        return tuple(outs)

    return body


def _exchange(size: int, rows: jax.Array) -> jax.Array:
    """All-to-all of ``rows`` ([size, k]): row j goes to rank j; row i of the result came
    from rank i. Rows of a 16-bit type move as 32-bit words where ``k`` is even (exact: a
    bitcast; XLA:CPU moves them faster: decision 0035)."""
    if rows.dtype.itemsize == 2 and rows.shape[1] % 2 == 0:
        pairs = lax.bitcast_convert_type(rows.reshape(size, -1, 2), jnp.uint32)
        moved = lax.all_to_all(pairs, AXIS, 0, 0, tiled=True)
        return lax.bitcast_convert_type(moved, rows.dtype).reshape(size, -1)
    return lax.all_to_all(rows, AXIS, 0, 0, tiled=True)


GLOO_MAX_SEGMENT_BYTES = 1 << 20
"""The largest segment gloo's ring all-reduce sends at once, as torch's gloo backend runs it
(found by matching its results bit for bit on 3 and 4 ranks, float32 and bfloat16, 7 to 4M
elements: only 1 MiB fits every size; :func:`gloo_chunk`)."""


def gloo_chunk(length: int, itemsize: int, size: int) -> int:
    """How many elements of an all-reduce of ``length`` elements (``itemsize`` bytes each) over
    ``size`` ranks gloo's ring reduces in each rank's chunk: the ring cuts the buffer into
    segments of at most :data:`GLOO_MAX_SEGMENT_BYTES` (at least ``2 * size`` of them, a
    multiple of ``size``, each a whole number of elements) and gives each rank as many in a row;
    chunk ``c`` is elements ``[c * chunk, (c + 1) * chunk)``, the last ones cut short or empty.

    Worked example: 16,387 float32 on 4 ranks are 65,548 bytes: 8 segments (twice the ranks),
    of ``ceil(65,548 / 8) = 8,194`` bytes rounded up to 8,196 (whole elements): 2,049 elements;
    two a rank: a chunk of 4,098 elements (not ``ceil(16,387 / 4) = 4,097``)."""
    total = length * itemsize
    cap = itemsize * max(1, GLOO_MAX_SEGMENT_BYTES // itemsize)
    segments = max(-(-total // cap), 2 * size)
    segments = -(-segments // size) * size
    segment_bytes = -(-(-(-total // segments)) // itemsize) * itemsize
    return segments // size * segment_bytes // itemsize


def _ring_reduce(op: str, rows: jax.Array, owner: jax.Array) -> jax.Array:
    """Reduce ``rows`` ([size, n]: row ``i`` from rank ``i``) in the order gloo's ring reduces
    the chunk that rank ``owner`` ends with: the partial sum starts at rank ``owner - 1`` and
    travels down the ring, each rank adding its own, ``owner`` last (``rows[owner - 1] +
    rows[owner - 2] + ... + rows[owner]``, indices mod size). Floating-point sums and products
    then have gloo's bits; other ops do not depend on the order."""
    if op not in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT"):
        return _axis_reduce(op, rows)
    size = rows.shape[0]
    combine = jnp.multiply if op == "PRODUCT" else jnp.add
    acc = lax.dynamic_index_in_dim(rows, (owner - 1) % size, keepdims=False)
    for k in range(2, size + 1):
        acc = combine(acc, lax.dynamic_index_in_dim(rows, (owner - k) % size, keepdims=False))
    return acc


def _allreduce_direct(size: int, op: str, factor: float | None = None):
    # Two all-to-alls: every rank sends chunk j of its block to rank j, which reduces the
    # chunks it got and sends the reduced chunk to every rank. The chunks and the order of
    # each reduction are gloo's ring's (gloo_chunk, _ring_reduce), so a sum has gloo's bits
    # (the same on every rank). The block is padded to ``size`` chunks; the padding is
    # reduced only with padding and cut off.
    def body(*blocks):
        outs = []
        for x in blocks:
            length = x.shape[0]
            chunk = gloo_chunk(length, x.dtype.itemsize, size)
            x = jnp.pad(_premul(op, factor, x), (0, size * chunk - length))
            rows = _exchange(size, x.reshape(size, chunk))
            mine = _finish(op, size, _ring_reduce(op, rows, lax.axis_index(AXIS)))
            everyone = _exchange(size, jnp.broadcast_to(mine, (size, mine.shape[0])))
            outs.append(everyone.reshape(-1)[:length])
        return tuple(outs)

    return body


def _allgather_direct(size: int):
    # Every rank sends its whole block to every rank; row i of the result is rank i's block.
    def body(*blocks):
        return tuple(
            _exchange(size, jnp.broadcast_to(x, (size, x.shape[0]))).reshape(-1) for x in blocks
        )

    return body


def _reduce_scatter(size: int, op: str, factor: float | None = None):
    if op not in ("SUM", "AVG", "PREMUL_SUM"):  # XLA's reduce-scatter only sums
        return _reduce_scatter_direct(size, op, factor)

    def body(*blocks):
        outs = []
        for x in blocks:
            y = lax.psum_scatter(_premul(op, factor, x), AXIS, scatter_dimension=0, tiled=True)
            outs.append(_finish(op, size, y))
        return tuple(outs)

    return body


def _reduce_scatter_direct(size: int, op: str, factor: float | None = None):
    # An all-to-all and a local reduction for every op: XLA:CPU's reduce-scatter copies its
    # input to a temporary and runs gloo's halving-doubling on it, while its all-to-all sends
    # each chunk straight to its owner (the same bytes on the wire). torch's gloo backend
    # reduce-scatters by a ring all-reduce of the whole input, then keeps the rank's part:
    # each element is reduced in the order of the ring chunk it falls in (gloo_chunk,
    # _ring_reduce), so sums have gloo's bits. A ring chunk is at least as long as a rank's
    # part, so a part spans one ring chunk, or the end of one and the start of the next.
    def body(*blocks):
        outs = []
        for x in blocks:
            part = x.shape[0] // size
            rows = _exchange(size, _premul(op, factor, x).reshape(size, part))
            chunk = gloo_chunk(x.shape[0], x.dtype.itemsize, size)
            rank = lax.axis_index(AXIS)
            if chunk == part:
                reduced = _ring_reduce(op, rows, rank)
            else:
                first = rank * part // chunk
                index = rank * part + jnp.arange(part)
                reduced = jnp.where(index // chunk == first, _ring_reduce(op, rows, first),
                                    _ring_reduce(op, rows, first + 1))
            outs.append(_finish(op, size, reduced))
        return tuple(outs)

    return body


def _allgather(size: int):
    def body(*blocks):
        return tuple(lax.all_gather(x, AXIS, axis=0, tiled=True) for x in blocks)

    return body


def _alltoall(size: int):
    def body(x):
        return (_exchange(size, x.reshape(size, -1)).reshape(-1),)

    return body


def _alltoall_permute(size: int):
    # Block k - 1 is this rank's chunk for rank (i + k) mod size; the k-th collective-permute
    # sends it there, so result k - 1 is what rank (i - k) mod size sent this rank
    # (_plan_blocks.permute_blocks). Blocks are separate arguments, so XLA copies nothing around the
    # sends (its all-to-all slices one block into chunks and joins the received ones).
    def body(*blocks):
        return tuple(
            lax.ppermute(x, AXIS, perm=[(i, (i + k) % size) for i in range(size)])
            for k, x in enumerate(blocks, 1)
        )

    return body


def _broadcast(size: int, root: int, checked: bool = False):
    # Integer words: only the root contributes non-zeros, so the sum is its exact bits. With
    # ``checked`` the last block is a header every rank contributes to (the backend's check
    # that all ranks agree on the root).
    def body(*blocks):
        mine = lax.axis_index(AXIS) == root
        data = blocks[:-1] if checked else blocks
        outs = [lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), AXIS) for x in data]
        if checked:
            outs.append(lax.psum(blocks[-1], AXIS))
        return tuple(outs)

    return body


def _scatter(size: int, root: int, checked: bool = False):
    # Every rank sends its row j to rank j (an all-to-all, as reduce_scatter); each keeps the
    # row that came from the root. Only the root's input matters, the others pass zeros. With
    # ``checked`` the last block holds the ranks' verdicts (a word per rank, each rank's own
    # set when it rejected its part of the call), summed over the group.
    def body(*blocks):
        data = blocks[:-1] if checked else blocks
        outs = [_exchange(size, x.reshape(size, -1))[root] for x in data]
        if checked:
            outs.append(lax.psum(blocks[-1], AXIS))
        return tuple(outs)

    return body


def _permute(size: int, *pairs: tuple[int, int]):
    def body(x):
        return (lax.ppermute(x, AXIS, perm=list(pairs)),)

    return body


def _barrier(size: int):
    def body(x):
        return (lax.psum(x, AXIS),)

    return body


_DIRECT_BODIES: dict[Kind, Callable] = {
    Kind.ALLREDUCE: _allreduce_direct,
    Kind.ALLGATHER: _allgather_direct,
    Kind.REDUCE_SCATTER: _reduce_scatter_direct,
}

_PERMUTE_BODIES: dict[Kind, Callable] = {
    Kind.ALLTOALL: _alltoall_permute,
}

_GATHER_REDUCE_BODIES: dict[Kind, Callable] = {
    Kind.ALLREDUCE: functools.partial(_allreduce, gather_min_max=True),
}

_BODIES: dict[Kind, Callable] = {
    Kind.ALLREDUCE: _allreduce,
    Kind.REDUCE_SCATTER: _reduce_scatter,
    Kind.ALLGATHER: _allgather,
    Kind.ALLTOALL: _alltoall,
    Kind.BROADCAST: _broadcast,
    Kind.SCATTER: _scatter,
    Kind.PERMUTE: _permute,
    Kind.BARRIER: _barrier,
}

#: ProgramKey.algorithm -> the body factory of each kind it has a program for.
_ALGORITHMS: dict[str | None, dict[Kind, Callable]] = {
    "xla": _BODIES,
    "exchange": _DIRECT_BODIES,
    "gather_reduce": _GATHER_REDUCE_BODIES,
    "permute": _PERMUTE_BODIES,
}
