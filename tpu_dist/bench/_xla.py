"""The bare XLA program of each op: what a tpu-backend call costs without the c10d layers.

For the tpu backend the benchmark also times, alternating with the c10d calls, the same data
movement as one jitted ``shard_map`` program over the group's JAX devices, called on global
arrays built once (so no DLPack hand-off, no ``make_array_from_single_device_arrays``, no torch
and no Work per call). ``host overhead = time(c10d call) - time(bare program)``: everything the
backend adds on the host.

The program body is the backend's own (``tpu_dist.collectives._lowering.body_for``, so the
same op lowering, including the direct all-to-all exchanges on CPU), compiled here with public
JAX API (``jax.jit``, ``jax.shard_map``, ``jax.make_array_from_single_device_arrays``) and
called the public way. For send_recv the bare program is one ``ppermute`` over the whole ring,
which is the ideal; the backend runs one two-device program per (sender, receiver) pair, so the
overhead column also shows what that split costs.
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

from tpu_dist.collectives._lowering import AXIS, body_for
from tpu_dist.collectives._plan_algorithms import program_key

__all__ = ["XlaCase", "make_xla_case"]

_AXIS = AXIS

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


#: benchmark op -> (the backend's program kind, its params)
_KINDS = {
    "all_reduce": ("allreduce", ("SUM",)),
    "all_gather_into_tensor": ("allgather", ()),
    "reduce_scatter_tensor": ("reduce_scatter", ("SUM",)),
    "all_to_all_single": ("alltoall", ()),
    "broadcast": ("broadcast", (0,)),
}


def _body(op: str, devices: list[jax.Device], local: int, dtype: str) -> Callable:
    n = len(devices)
    if op == "send_recv":
        return lambda x: lax.ppermute(x, _AXIS, perm=[(i, (i + 1) % n) for i in range(n)])
    if op not in _KINDS:
        raise ValueError(f"unknown op {op!r}")
    kind, params = _KINDS[op]
    key = program_key(kind, tuple(d.id for d in devices), ((local, dtype),), params,
                      devices[0].platform)
    body = body_for(key, devices)
    return lambda x: body(x)[0]


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
    body = _body(op, devices, local, jnp.dtype(jdtype).name)
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS), check_vma=False
    )
    start = time.perf_counter()
    compiled = jax.jit(mapped).lower(x).compile()
    compile_s = time.perf_counter() - start

    def call() -> None:
        compiled(x).block_until_ready()

    return XlaCase(call=call, compile_s=compile_s)
