"""Hand a DTensor to a jitted JAX function and take the result back, shard for shard.

A (dp, tp) mesh from :func:`tpu_dist.mesh.init_device_mesh`; data ``x`` sharded by rows over
dp, a weight ``w`` sharded by columns over tp. Each step fits ``w`` to ``y = x @ w_true`` by
gradient descent, with the loss and gradient computed by ``jax.value_and_grad`` under
``jax.jit`` on the very same shards (``tpu_dist.dtensor_ext.to_jax``: a ``jax.Array`` whose
``NamedSharding`` matches the DTensor's placements; on CPU no data is copied), and the update
done by torch on the DTensor the gradient comes back as (``from_jax``). Alongside, torch's own
autograd on DTensors computes the same gradient, as a check.

    tpu-launch --nproc-per-node 4 examples/dtensor_jax.py
    torchrun --nproc-per-node 4 examples/dtensor_jax.py --steps 30

Unlike the other examples it runs only on the "tpu" backend (``--backend gloo`` is refused
with the reason): the JAX side needs the JAX devices of "tpu" groups.

Rank 0 prints the layouts, one line per step, and, last, ``final loss X after N steps``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import tpu_dist  # noqa: F401  (registers the "tpu" backend)
from tpu_dist.dtensor_ext import from_jax, to_jax
from tpu_dist.mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fsdp import describe_mesh  # noqa: E402  (the mesh whole when small, else a summary)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--backend", default="tpu", help="c10d backend: only tpu (see below)")
    args = parser.parse_args(argv)
    if args.backend != "tpu":
        parser.error(f"--backend {args.backend}: this example needs the 'tpu' backend, because to_jax "
                     "and from_jax hand a DTensor's shards to the JAX devices that backend owns (a "
                     f"{args.backend} group has none); the other examples run on gloo too")

    dist.init_process_group("tpu")  # to_jax needs the "tpu" backend's JAX devices
    import jax  # after init_process_group: tpu_dist starts JAX's distributed runtime
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tpu_dist.mesh import mesh_to_jax

    rank, world = dist.get_rank(), dist.get_world_size()
    tp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh((world // tp, tp), mesh_dim_names=("dp", "tp"))
    log = print if rank == 0 else (lambda *a, **k: None)

    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(64, 16, generator=g)
    y_full = x_full @ torch.randn(16, 8, generator=g)
    x = distribute_tensor(x_full, mesh, [Shard(0), Replicate()])  # rows over dp
    y = distribute_tensor(y_full, mesh, [Shard(0), Replicate()])
    w = distribute_tensor(torch.zeros(16, 8), mesh, [Replicate(), Shard(1)])  # columns over tp

    x_jax, y_jax = to_jax(x), to_jax(y)
    log(f"mesh {describe_mesh(mesh)}; x {tuple(x.shape)} {x.placements} -> {x_jax.sharding.spec}; "
        f"w {tuple(w.shape)} {w.placements} -> {to_jax(w).sharding.spec}")
    shard = x_jax.addressable_shards[0]
    log(f"rank 0's shard of x is the DTensor's local tensor (zero-copy): "
        f"{shard.data.unsafe_buffer_pointer() == x.to_local().data_ptr()}, rows {shard.index[0]}", flush=True)

    jmesh = mesh_to_jax(mesh)
    step_fn = jax.jit(
        jax.value_and_grad(lambda w, x, y: jnp.mean((x @ w - y) ** 2)),
        out_shardings=(NamedSharding(jmesh, P()), NamedSharding(jmesh, P(None, "tp"))),
    )
    loss = float("nan")
    for step in range(1, args.steps + 1):
        loss_jax, grad_jax = step_fn(to_jax(w), x_jax, y_jax)
        grad = from_jax(grad_jax, mesh)  # a DTensor: (Replicate(), Shard(1)), like w
        # The same gradient from torch's autograd on the DTensors, as a check.
        w_torch = w.detach().requires_grad_()
        ((x @ w_torch - y) ** 2).mean().backward()
        err = (grad - w_torch.grad).full_tensor().abs().max().item()
        if err > 1e-4:
            raise RuntimeError(f"step {step}: the JAX gradient differs from torch's by {err}")
        w = w - args.lr * grad  # out of place: JAX's view of the old w stays valid
        loss = float(loss_jax)
        log(f"step {step:3d} | loss {loss:.5f} | grad {grad.placements} | |jax - torch| {err:.1e}", flush=True)
    log(f"final loss {loss:.5f} after {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
