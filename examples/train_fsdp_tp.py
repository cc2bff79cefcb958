"""Train the decoder of ``train_fsdp.py`` with tensor parallelism inside FSDP2, on a 2-D mesh.

The mesh comes from :func:`tpu_dist.mesh.init_device_mesh`: a (dp, tp) layout of the TPU
topology in which each tp group sits on neighbouring chips (ICI), because tensor parallelism
communicates in every layer, and dp crosses the slower links. On 4 CPU-emulated ranks with
``--tp 2`` that is a (2, 2) mesh.

Tensor parallelism (``parallelize_module``), as in Megatron-LM and torchtitan:

* attention: ``wq``/``wk``/``wv`` ColwiseParallel (each tp rank computes n_heads / tp heads),
  ``wo`` RowwiseParallel; MLP: ``w1``/``w3`` ColwiseParallel, ``w2`` RowwiseParallel;
* RMSNorms SequenceParallel: between blocks the activations are sharded along the sequence;
* embedding RowwiseParallel (vocab-sharded), output ColwiseParallel with the logits left
  vocab-sharded for ``loss_parallel`` (cross-entropy without gathering the logits).

Then FSDP2 shards every block and the root over dp. Run it::

    tpu-launch --nproc-per-node 4 examples/train_fsdp_tp.py --steps 20
    torchrun --nproc-per-node 4 examples/train_fsdp_tp.py --steps 20 --tp 2
    tpu-launch --emulate tpu7x:16x16x16 --compile-only examples/train_fsdp_tp.py  # 8,192 ranks

The global batch defaults to one sequence per data-parallel rank, at least 8 (``--batch-size``),
so it runs at any world size that ``--tp`` divides. Rank 0 prints the mesh (a summary beyond 64
ranks), one line per step and, last, ``final loss X after N steps``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fsdp import (  # noqa: E402
    Decoder,
    describe_mesh,
    global_batch_size,
    leave,
    model_config,
    parse_args,
    report_final,
    train,
)

import tpu_dist  # noqa: E402,F401  (registers the "tpu" backend)
from tpu_dist.mesh import init_device_mesh  # noqa: E402


def apply_tensor_parallel(model: Decoder, tp_mesh, *, parallel_loss: bool = True) -> None:
    """Shard ``model`` over ``tp_mesh`` (in place), torchtitan's plan for a Llama decoder.

    With ``parallel_loss`` the model returns vocab-sharded logits (a DTensor, Shard(-1)) to be
    used under ``loss_parallel()``; otherwise replicated plain-tensor logits.
    """
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if parallel_loss else Replicate(),
                use_local_output=not parallel_loss,
            ),
        },
    )
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)


def main(argv: list[str] | None = None) -> str:
    """Train; return the backend the group ran on (the group is destroyed by then)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    args = parse_args(argv, __doc__, extra=lambda p: p.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel degree (default: 2)"))
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    batch_size = global_batch_size(args.batch_size, world // args.tp)  # a bad flag fails before any work
    mesh = init_device_mesh((world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(args.seed)
    model = Decoder(model_config(args))
    apply_tensor_parallel(model, mesh["tp"])
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16" else None,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    if rank == 0:
        print(f"FSDP2 x TP on mesh {describe_mesh(mesh)} ({dist.get_backend()}), "
              f"global batch {batch_size}x{args.seq_len}", flush=True)
    dp_rank = mesh.get_local_rank("dp")
    final, step = train(args, model, dp_rank, mesh.size(0), mesh.get_group("dp"), loss_context=loss_parallel)
    if rank == 0:
        report_final(final, step)
    backend = dist.get_backend()
    dist.destroy_process_group()
    return backend


if __name__ == "__main__":
    leave(main())  # on gloo, not Python's teardown: see train_fsdp.leave()
