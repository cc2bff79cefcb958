"""``examples/train_moe.py``'s model, sharded as the example shards it (expert parallelism over
``ep``, FSDP2 over dp x ep and over dp for the experts), against the same model in one process
on the global batch: one forward and backward, then every gradient gathered whole and compared.
Rank 0 prints ``worst relative gradient error X`` (the largest ``max |g - ref| / max |ref|`` over
the parameters). Arguments are the example's (``--backend``, ``--ep``, sizes)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import train_fsdp as ex  # noqa: E402
import train_moe  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

from tpu_dist.mesh import init_device_mesh  # noqa: E402


def main() -> None:
    args = ex.parse_args(sys.argv[1:], train_moe.__doc__, train_moe._options)
    config = train_moe.build_config(args)
    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    mesh = init_device_mesh((world // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
    everyone = mesh["dp", "ep"]._flatten("dp_ep")
    torch.manual_seed(args.seed)
    model = ex.Decoder(config)
    torch.manual_seed(args.seed)
    reference = ex.Decoder(config)
    train_moe.parallelize(model, mesh, everyone, MixedPrecisionPolicy())
    x, y = ex.batch(ex.corpus(), 1, ex.global_batch_size(args.batch_size, world), args.seq_len,
                    args.seed)
    rank = everyone.get_local_rank()
    logits = model(ex.local_rows(x, rank, world))
    F.cross_entropy(logits.flatten(0, 1), ex.local_rows(y, rank, world).flatten()).backward()
    # One process on the global batch: the mean over the ranks' equal shares of it.
    loss = sum(F.cross_entropy(reference(a).flatten(0, 1), b.flatten())
               for a, b in zip(x.chunk(world), y.chunk(world))) / world
    loss.backward()
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        whole = p.grad.full_tensor()
        worst = max(worst, ((whole - q.grad).abs().max() / q.grad.abs().max()).item())
    if dist.get_rank() == 0:
        print(f"worst relative gradient error {worst:.3e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
