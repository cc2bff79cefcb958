"""Each collective as an XLA program, and the cache of compiled programs.

A program runs SPMD over the group's devices: a one-axis ``jax.sharding.Mesh``
whose axis ``"x"`` lists the group's JAX devices in group-rank order. Every
argument and result is a 1-D array sharded along ``"x"``: the block a rank
owns is the flat tensor it passes in or gets back, so a group rank only ever
touches its own block. Example, all_reduce of 3 floats on 2 ranks::

    global input  (6,) = [a0 a1 a2 | b0 b1 b2]      rank 0 owns a, rank 1 owns b
    body (per block)   psum(x, "x")
    global output (6,) = [s0 s1 s2 | s0 s1 s2]      s = a + b, each rank reads its block

Programs are compiled once per :class:`ProgramKey` (op, reduce op, group
devices, block sizes, dtypes) and kept; :func:`compile_count` tells how many
compilations this process has done, so tests can check that a steady loop
compiles nothing new.

Data-movement programs (gather, scatter, broadcast, all-to-all, permute) move
raw words (int8/16/32 views of any dtype), so they are exact for every dtype
and share programs across dtypes of one width.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_dist.collectives import _runtime

AXIS = "x"
"""The name of the single mesh axis every program runs over."""


@dataclass(frozen=True)
class ProgramKey:
    """Everything that decides a program's XLA code."""

    kind: str
    """Which body: "allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast",
    "scatter", "permute", "barrier"."""
    devices: tuple[int, ...]
    """JAX device ids of the group, in group-rank order."""
    blocks: tuple[tuple[int, str], ...]
    """(length, dtype name) of each argument's block."""
    params: tuple = ()
    """Op-specific constants: reduce op name, root, factor, permutation."""


@dataclass(frozen=True)
class _Program:
    """A compiled program and the fastest way this process has to start it."""

    compiled: jax.stages.Compiled
    execute: Callable[[list[jax.Array]], list[jax.Array]] | None
    """The loaded executable's own ``execute`` on this rank's single-device blocks, when the
    program has exactly one device in this process (always, with one device per rank); None
    otherwise, or when jaxlib does not offer it."""


_lock = threading.Lock()
_programs: dict[ProgramKey, _Program] = {}
_meshes: dict[tuple[int, ...], tuple[Mesh, NamedSharding]] = {}
_compilations = 0


def compile_count() -> int:
    """How many XLA programs this process has compiled for collectives."""
    return _compilations


def mesh_for(devices: Sequence[jax.Device]) -> tuple[Mesh, NamedSharding]:
    """The one-axis mesh over ``devices`` and the 1-D sharding along it (cached)."""
    ids = tuple(d.id for d in devices)
    found = _meshes.get(ids)
    if found is None:
        mesh = Mesh(np.array(list(devices), dtype=object), (AXIS,))
        found = (mesh, NamedSharding(mesh, P(AXIS)))
        _meshes[ids] = found
    return found


def program(key: ProgramKey, devices: Sequence[jax.Device]) -> _Program:
    """The compiled program for ``key`` over ``devices``, compiling it on first use."""
    found = _programs.get(key)
    if found is not None:
        return found
    with _lock:
        found = _programs.get(key)
        if found is None:
            compiled = _compile(key, devices)
            found = _Program(compiled, _direct_execute(compiled))
            _programs[key] = found
    return found


def _direct_execute(compiled: jax.stages.Compiled) -> Callable | None:
    """The loaded executable's ``execute``, if this process owns exactly one of its devices.

    ``Compiled.__call__`` wants global arrays: building one from this rank's block
    (``make_array_from_single_device_arrays``) and taking the block back out of each result
    (``addressable_data``) cost ~120 us of a ~450 us small all_reduce on CPU (benchmarks/,
    E14). The executable itself takes and returns the local single-device arrays. It is
    reached through JAX internals (``_executable.xla_executable``), so anything unexpected
    falls back to the public call.
    """
    try:
        executable = compiled._executable.xla_executable
        if len(executable.local_devices()) != 1:
            return None
        return executable.execute
    except AttributeError:
        return None


def _compile(key: ProgramKey, devices: Sequence[jax.Device]) -> jax.stages.Compiled:
    global _compilations
    mesh, sharding = mesh_for(devices)
    size = len(devices)
    body = _BODIES[key.kind](size, *key.params)
    n_args = len(key.blocks)
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(AXIS),) * n_args,
        out_specs=(P(AXIS),) * n_args,
        check_vma=False,
    )
    abstract = [
        jax.ShapeDtypeStruct((size * length,), jnp.dtype(dtype), sharding=sharding)
        for length, dtype in key.blocks
    ]
    with _runtime.x64_scope():
        compiled = jax.jit(mapped).lower(*abstract).compile()
    _compilations += 1
    return compiled


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


def _allreduce(size: int, op: str, factor: float | None = None):
    def body(*blocks):
        outs = []
        for x in blocks:
            x = _premul(op, factor, x)
            if op in ("SUM", "AVG", "PREMUL_SUM"):
                y = lax.psum(x, AXIS)
            elif op == "MAX":
                y = lax.pmax(x, AXIS)
            elif op == "MIN":
                y = lax.pmin(x, AXIS)
            else:  # PRODUCT and bitwise ops: XLA all-reduce only sums, mins and maxes.
                y = _axis_reduce(op, lax.all_gather(x, AXIS, axis=0))
            outs.append(_finish(op, size, y))
        return tuple(outs)

    return body


def _reduce_scatter(size: int, op: str, factor: float | None = None):
    def body(*blocks):
        outs = []
        for x in blocks:
            x = _premul(op, factor, x)
            if op in ("SUM", "AVG", "PREMUL_SUM"):
                y = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
            else:
                # Row j of the all-to-all result is rank j's copy of my chunk.
                rows = lax.all_to_all(x.reshape(size, -1), AXIS, 0, 0, tiled=True)
                y = _axis_reduce(op, rows)
            outs.append(_finish(op, size, y))
        return tuple(outs)

    return body


def _allgather(size: int):
    def body(*blocks):
        return tuple(lax.all_gather(x, AXIS, axis=0, tiled=True) for x in blocks)

    return body


def _alltoall(size: int):
    def body(x):
        return (lax.all_to_all(x.reshape(size, -1), AXIS, 0, 0, tiled=True).reshape(-1),)

    return body


def _broadcast(size: int, root: int):
    # Integer words: only the root contributes non-zeros, so the sum is its exact bits.
    def body(*blocks):
        mine = lax.axis_index(AXIS) == root
        return tuple(lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), AXIS) for x in blocks)

    return body


def _scatter(size: int, root: int):
    def body(x):
        mine = lax.axis_index(AXIS) == root
        masked = jnp.where(mine, x, jnp.zeros_like(x))
        return (lax.psum_scatter(masked, AXIS, scatter_dimension=0, tiled=True),)

    return body


def _permute(size: int, *pairs: tuple[int, int]):
    def body(x):
        return (lax.ppermute(x, AXIS, perm=list(pairs)),)

    return body


def _barrier(size: int):
    def body(x):
        return (lax.psum(x, AXIS),)

    return body


_BODIES: dict[str, Callable] = {
    "allreduce": _allreduce,
    "reduce_scatter": _reduce_scatter,
    "allgather": _allgather,
    "alltoall": _alltoall,
    "broadcast": _broadcast,
    "scatter": _scatter,
    "permute": _permute,
    "barrier": _barrier,
}


def run(
    key: ProgramKey,
    devices: Sequence[jax.Device],
    local_blocks: Sequence[jax.Array],
) -> list[jax.Array]:
    """Dispatch ``key``'s program on this rank's blocks; returns this rank's result blocks.

    Asynchronous: the returned arrays are futures of JAX's dispatch; the data
    has moved once they are ready.
    """
    found = program(key, devices)
    if found.execute is not None:
        # The executable runs on the blocks' own dtypes: no JAX dtype rules apply, so no
        # x64 scope either (~1-2 us a call saved).
        try:
            return found.execute(list(local_blocks))
        except TypeError:  # jaxlib changed the private call: the public one from now on
            found = _programs[key] = _Program(found.compiled, None)
    with _runtime.x64_scope():
        _, sharding = mesh_for(devices)
        size = len(devices)
        global_args = [
            jax.make_array_from_single_device_arrays((size * block.shape[0],), sharding, [block])
            for block in local_blocks
        ]
        outs = found.compiled(*global_args)
        return [out.addressable_data(0) for out in outs]
