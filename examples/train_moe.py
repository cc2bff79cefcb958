"""Train a small Qwen3-style mixture of experts with FSDP2 x expert parallelism on a 2-D mesh.

The model is ``train_fsdp.py``'s decoder with every feed-forward block a mixture of experts
(``train_fsdp.MoE``, as in Qwen3's MoE models): a router (a linear layer, softmax over the
experts, the top ``k`` kept and renormalised) sends each token to ``k`` of ``--experts`` SwiGLU
experts and adds their outputs, weighted by the router's scores.

Parallelism, as TorchTitan lays it out, on a (dp, ep) mesh from
:func:`tpu_dist.mesh.init_device_mesh` (ep inner: its groups sit on neighbouring chips, because
every MoE layer exchanges tokens over them twice a step, forward and backward):

* **expert parallelism** over ``ep`` (``MoE.parallelize_experts``): each ep rank holds
  ``experts / ep`` of each layer's experts. A layer routes this rank's tokens, tells each ep
  peer how many tokens it will get for each of the peer's experts (an ``all_to_all_single`` of
  counts), sends the tokens (an ``all_to_all_single`` whose split sizes are the router's
  decisions: they change every step and every layer), runs its own experts on what it
  received, and sends the results back (the reverse all-to-all); the backward pass runs the
  two exchanges the other way;
* **FSDP2** over every rank (the flattened ``("dp", "ep")`` dimension) for everything but the
  experts, and over ``dp`` for the experts (each ep rank's experts are sharded over the ranks
  that hold the same ones); every rank trains on its own share of the batch, and the experts'
  gradients, which sum over the tokens of a whole ep group, are divided by ``dp x ep`` where
  FSDP would divide by ``dp`` (its gradient divide factor, as TorchTitan sets it), so every
  gradient is the global batch's mean, as on one rank.

Every rank builds the whole model from the same seed and keeps its experts: the model is the
same whatever the mesh (and on either backend). Run it on 4 CPU-emulated ranks (a (2, 2)
mesh), on "tpu" or on torch's gloo for comparison::

    tpu-launch --nproc-per-node 4 examples/train_moe.py --steps 20
    torchrun --nproc-per-node 4 examples/train_moe.py --steps 20 --backend gloo
    torchrun --nproc-per-node 2 examples/train_moe.py --ep 2 --model debug --seq-len 128

``--model debug`` is TorchTitan's Qwen3 MoE debug model (dim 256, 8 layers, 16 heads of 128 /
8 kv, 64 experts of width 768, top 8, vocabulary 2048: 310 M parameters, 1.2 GB in fp32);
``--model qwen3-30b-a3b`` is Qwen3-30B-A3B (``train_fsdp_tp.py``'s preset: dim 2048, 48
layers, 32 heads of 128 / 4 kv, 128 experts of width 768, top 8, vocabulary 151936), for
``--compile-only``::

    tpu-launch --emulate v5p:2x2x2 --compile-only examples/train_moe.py --ep 4 --steps 2
    tpu-launch --emulate v5p:4x4x4 --compile-only examples/train_moe.py --model qwen3-30b-a3b \\
        --ep 8 --seq-len 4096 --seqs-per-rank 1 --mixed-precision bf16 --steps 2

**What the dry run assumes: balanced routing.** Under ``--compile-only`` the script trains on
random tokens, a fake tensor there (``train_fsdp_tp.token_stream``), so the router's scores are
fakes without values and no router decides anything: ``tpu_dist.compile_job`` makes a top-k
over unknown values pick balanced experts (token ``t``'s ``j``-th choice is expert
``(t * k + j) mod experts``), so every expert gets ``tokens * k / experts`` of a rank's tokens
and every rank sends and receives the same. The recorded all-to-alls have those sizes (the
report says how many top-k calls it balanced); on the real job the sizes follow the router,
and the backend rounds the widest chunk up to a size bucket (``tpu_dist.collectives``: four
sizes per doubling), so the compiled program is the balanced size's bucket or one of the next
few.

Rank 0 prints the mesh, the model, one line per step (step, loss of the global batch, tokens/s)
and, last, ``final loss X after N steps``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fsdp import (  # noqa: E402
    Decoder,
    ModelConfig,
    describe_mesh,
    end,
    global_batch_size,
    leave,
    parse_args,
    train,
)
from train_fsdp_tp import PRESETS as _TP_PRESETS  # noqa: E402
from train_fsdp_tp import token_stream  # noqa: E402

import tpu_dist  # noqa: E402,F401  (registers the "tpu" backend)
from tpu_dist.mesh import init_device_mesh, register_mesh  # noqa: E402

PRESETS: dict[str, dict] = {
    "debug": dict(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128, n_experts=64,
                  top_k=8, expert_hidden=768, vocab_size=2048, rope_theta=1000000.0,
                  norm_eps=1e-6),
    "qwen3-30b-a3b": _TP_PRESETS["qwen3-30b-a3b"],
}
"""``--model``: the module docstring's shapes."""


def _options(parser) -> None:
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree (default: 2)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default: 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2)")
    parser.add_argument("--expert-hidden", type=int, default=None,
                        help="hidden width of each expert (default: --dim)")
    parser.add_argument("--model", choices=sorted(PRESETS), default=None,
                        help="a model of published dimensions (module docstring)")
    parser.add_argument("--seqs-per-rank", type=int, default=None,
                        help="sequences per rank per step (instead of --batch-size)")
    parser.add_argument("--synthetic", action="store_true",
                        help="random tokens instead of the bundled text")


def build_config(args) -> ModelConfig:
    """The model ``--model`` names (at ``--seq-len``), or the small one of the other flags."""
    if args.model is not None:
        return ModelConfig(**PRESETS[args.model], max_seq_len=max(64, args.seq_len))
    return ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       max_seq_len=max(64, args.seq_len), n_experts=args.experts,
                       top_k=args.top_k, expert_hidden=args.expert_hidden or args.dim)


def parallelize(model: Decoder, mesh, everyone, policy) -> None:
    """Expert parallelism over ``mesh["ep"]``, then FSDP2 over ``everyone`` (every rank of the
    (dp, ep) ``mesh``) for all but the experts, which are sharded over ``mesh["dp"]`` (the ranks
    that hold the same experts), their gradients divided by every rank's count, not dp's
    (module docstring). In place."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        moe = layer.feed_forward
        moe.parallelize_experts(mesh["ep"])
        fully_shard(moe.experts, mesh=mesh["dp"], mp_policy=policy)
        moe.experts.set_gradient_divide_factor(everyone.size())
        moe.experts.set_force_sum_reduction_for_comms(True)  # SUM, then divide (gloo, "tpu")
        fully_shard(layer, mesh=everyone, mp_policy=policy)
    fully_shard(model, mesh=everyone, mp_policy=policy)


def main(argv: list[str] | None = None) -> str:
    """Train; return the backend the group ran on (the group is destroyed by then)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    args = parse_args(argv, __doc__, extra=_options)
    config = build_config(args)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep
    if world % ep or config.n_experts % ep:
        raise SystemExit(f"--ep {ep} must divide the world size {world} and the number of "
                         f"experts {config.n_experts}")
    if args.seqs_per_rank is not None:
        if args.batch_size is not None:
            raise SystemExit("pass --batch-size or --seqs-per-rank, not both")
        args.batch_size = args.seqs_per_rank * world
    batch_size = global_batch_size(args.batch_size, world)  # every rank has its own share
    mesh = init_device_mesh((world // ep, ep), mesh_dim_names=("dp", "ep"))
    everyone = mesh["dp", "ep"]._flatten("dp_ep")  # FSDP over every rank (TorchTitan's dp_shard)
    register_mesh(mesh)
    torch.manual_seed(args.seed)  # the same model on every rank; each keeps its experts
    model = Decoder(config)
    params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16" else None,
    )
    parallelize(model, mesh, everyone, policy)
    if rank == 0:
        print(f"FSDP2 x EP on mesh {describe_mesh(mesh)} ({dist.get_backend()}), "
              f"model {args.model or 'small'} ({params / 1e6:.4g} M parameters, "
              f"{config.n_layers} layers, {config.n_experts} experts of "
              f"{config.expert_hidden or config.ffn_hidden}, top {config.top_k}), "
              f"mixed precision {args.mixed_precision}, "
              f"global batch {batch_size}x{args.seq_len}", flush=True)
    return end(*train(args, model, everyone.get_local_rank(), world, everyone.get_group(),
                      data=token_stream(args, config)))


if __name__ == "__main__":
    leave(main())  # on gloo, not Python's teardown: see train_fsdp.leave()
