"""The bare XLA program of each op: what a tpu-backend call costs without the c10d layers.

For the tpu backend the benchmark also times, alternating with the c10d calls, the same data
movement as one jitted ``shard_map`` program over the group's JAX devices, called on global
arrays built once (so no DLPack hand-off, no ``make_array_from_single_device_arrays``, no torch
and no Work per call). ``host overhead = time(c10d call) - time(bare program)``: everything the
backend adds on the host.

Only public JAX API is used (``jax.jit``, ``jax.shard_map``, ``jax.lax`` collectives,
``jax.make_array_from_single_device_arrays``). The bodies mirror tpu_dist's own lowering:
``psum`` for all_reduce, tiled ``all_gather`` / ``psum_scatter`` / ``all_to_all``, broadcast as
a ``psum`` of the root's block and zeros elsewhere. For send_recv the bare program is one
``ppermute`` over the whole ring, which is the ideal; the backend runs one two-device program
per (sender, receiver) pair, so the overhead column also shows what that split costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["XlaCase", "make_xla_case"]

_AXIS = "x"

_JNP = {
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int32: jnp.int32,
    torch.int8: jnp.int8,
}


@dataclasses.dataclass
class XlaCase:
    """A compiled bare program and its prebuilt global inputs."""

    call: Callable[[], None]
    """Run the program once and block until its outputs are ready."""
    compile_s: float
    """Seconds spent lowering and compiling it."""


def _body(op: str, n: int) -> Callable[[jax.Array], jax.Array]:
    if op == "all_reduce":
        return lambda x: lax.psum(x, _AXIS)
    if op == "all_gather_into_tensor":
        return lambda x: lax.all_gather(x, _AXIS, axis=0, tiled=True)
    if op == "reduce_scatter_tensor":
        return lambda x: lax.psum_scatter(x, _AXIS, scatter_dimension=0, tiled=True)
    if op == "all_to_all_single":
        return lambda x: lax.all_to_all(x.reshape(n, -1), _AXIS, 0, 0, tiled=True).reshape(-1)
    if op == "broadcast":
        return lambda x: lax.psum(
            jnp.where(lax.axis_index(_AXIS) == 0, x, jnp.zeros_like(x)), _AXIS
        )
    if op == "send_recv":
        return lambda x: lax.ppermute(x, _AXIS, perm=[(i, (i + 1) % n) for i in range(n)])
    raise ValueError(f"unknown op {op!r}")


def _local_count(op: str, count: int, n: int) -> int:
    """Elements of this rank's input block for a message of ``count`` elements."""
    return count // n if op == "all_gather_into_tensor" else count


def make_xla_case(
    op: str, devices: list[jax.Device], rank: int, count: int, dtype: torch.dtype
) -> XlaCase:
    """Compile ``op``'s bare program over ``devices`` (group-rank order) for this rank.

    Every rank of the group must call it (compilation of a multi-process program is SPMD).
    """
    import time

    n = len(devices)
    mesh = Mesh(np.array(devices, dtype=object), (_AXIS,))
    sharding = NamedSharding(mesh, P(_AXIS))
    local = _local_count(op, count, n)
    jdtype = _JNP[dtype]
    block = jax.device_put(jnp.zeros((local,), jdtype), devices[rank])
    x = jax.make_array_from_single_device_arrays((n * local,), sharding, [block])
    mapped = jax.shard_map(
        _body(op, n), mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS), check_vma=False
    )
    start = time.perf_counter()
    compiled = jax.jit(mapped).lower(x).compile()
    compile_s = time.perf_counter() - start

    def call() -> None:
        compiled(x).block_until_ready()

    return XlaCase(call=call, compile_s=compile_s)
