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

The global batch defaults to one sequence per data-parallel rank, at least 8 (``--batch-size``,
or ``--seqs-per-dp-rank``), so it runs at any world size that ``--tp`` divides. Rank 0 prints the
mesh (a summary beyond 64 ranks), the model, one line per step and, last, ``final loss X after N
steps``.

Real shapes (``--model``, the published dimensions; grouped-query attention with ``n_kv_heads``
key/value heads; Qwen3's QK-norm is left out, its weights are 0.0004 % of the model)::

    llama3-8b    dim 4096, 32 layers, 32 heads / 8 kv, FFN 14336, vocab 128256  (Llama 3 paper,
    llama3-70b   dim 8192, 80 layers, 64 heads / 8 kv, FFN 28672, vocab 128256   table 3; vocab
    llama3-405b  dim 16384, 126 layers, 128 heads / 8 kv, FFN 53248, vocab 128256 and RoPE 5e5
                                                                                  from the configs)
    qwen3-8b     dim 4096, 36 layers, 32 heads of 128 / 8 kv, FFN 12288, vocab 151936 (its config)
    qwen3-32b    dim 5120, 64 layers, 64 heads of 128 / 8 kv, FFN 25600, vocab 151936 (its config)
    qwen3-30b-a3b  dim 2048, 48 layers, 32 heads of 128 / 4 kv, 128 experts of SwiGLU width 768,
                 8 a token, vocab 151936 (its config): a mixture of experts, the experts over
                 the tp ranks (expert parallelism: all-to-alls of tokens), attention in TP;
                 FSDP shards the experts over as many dp ranks as split them evenly and
                 replicates them over the rest (``expert_shards``, ``--expert-shards``)
    debug-moe    debug's, with 8 experts of width 128, 2 a token
    debug        dim 256, 2 layers, 8 heads / 2 kv, FFN 512, vocab 2048 (runs on 4 CPU ranks)

They are for ``--compile-only`` (fake tensors: no memory, no compute), e.g. TorchTitan's Llama 3
8B layout on 8,192 TPU7x chips::

    tpu-launch --emulate tpu7x:16x16x32 --compile-only --compile-report plan.json \
        examples/train_fsdp_tp.py --model llama3-8b --tp 8 --seq-len 8192 --seqs-per-dp-rank 1 \
        --mixed-precision bf16 --activation-checkpointing --steps 2

Tokens: the bundled text while a sequence fits in it (byte tokens), else random tokens of the
model's vocabulary (``--synthetic`` forces them, and so does ``--compile-only``, where they are
fake: an MoE's routing is then the dry run's balanced assumption, ``token_stream``).
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fsdp import (  # noqa: E402
    Decoder,
    Experts,
    ModelConfig,
    MoE,
    corpus,
    describe_mesh,
    end,
    global_batch_size,
    leave,
    model_config,
    parse_args,
    train,
)

import tpu_dist  # noqa: E402,F401  (registers the "tpu" backend)
from tpu_dist.mesh import init_device_mesh, register_mesh  # noqa: E402


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
    moe_plan = {  # the experts over the tp ranks (expert parallelism), on their own tokens
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
            use_local_input=True, output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),),
        ),
    }
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
        moe = block.feed_forward if isinstance(block.feed_forward, MoE) else None
        if moe is None:
            parallelize_module(block, tp_mesh, block_plan)
            continue
        plan = {k: v for k, v in block_plan.items() if not k.startswith("feed_forward")}
        parallelize_module(block, tp_mesh, plan | moe_plan)
        # Expert parallelism over the tp ranks: each holds n_experts / tp of the experts; the
        # router is the same everywhere. (All of a block's parameters are then DTensors on the
        # tp mesh, as FSDP2 wants them.)
        moe.parallelize_experts(tp_mesh)
        moe.router.weight = nn.Parameter(
            distribute_tensor(moe.router.weight.detach(), tp_mesh, [Replicate()]))


PRESETS: dict[str, dict] = {
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                      vocab_size=128256, rope_theta=500000.0),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                       vocab_size=128256, rope_theta=500000.0),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                        vocab_size=128256, rope_theta=500000.0),
    "qwen3-8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     ffn_hidden=12288, vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6),
    "qwen3-32b": dict(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                      ffn_hidden=25600, vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6),
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          ffn_hidden=6144, vocab_size=151936, n_experts=128, top_k=8,
                          expert_hidden=768, rope_theta=1000000.0, norm_eps=1e-6),
    "debug": dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=512, vocab_size=2048),
    "debug-moe": dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=512,
                      vocab_size=2048, n_experts=8, top_k=2, expert_hidden=128),
}
"""``--model``: the published dimensions (module docstring)."""


def _options(parser) -> None:
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: 2)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel (FSDP) degree; dp x tp must be the world size "
                             "(default: world size / tp)")
    parser.add_argument("--model", choices=sorted(PRESETS), default=None,
                        help="a model of published dimensions (module docstring); default: the "
                             "small model of --dim/--layers/--heads")
    parser.add_argument("--seqs-per-dp-rank", type=int, default=None,
                        help="sequences per data-parallel rank per step (instead of --batch-size)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in the backward")
    parser.add_argument("--expert-shards", type=int, default=None,
                        help="a mixture of experts: FSDP shards each rank's experts over this "
                             "many dp ranks and replicates them over the rest (HSDP); default: "
                             "expert_shards()")
    parser.add_argument("--synthetic", action="store_true",
                        help="random tokens instead of the bundled text")


def build_config(args) -> ModelConfig:
    """The model ``--model`` names (at ``--seq-len``), or the small one of the other flags."""
    if args.model is None:
        return model_config(args)
    return ModelConfig(**PRESETS[args.model], max_seq_len=args.seq_len)


def check_layout(config: ModelConfig, dp: int, tp: int, world: int) -> None:
    """Raise SystemExit (saying what to pass) for a (dp, tp) layout the model cannot take."""
    if dp * tp != world:
        raise SystemExit(f"--dp {dp} x --tp {tp} = {dp * tp} is not the world size {world}; "
                         f"pass --dp {world // tp} or leave --dp out")
    for name, heads in (("query", config.n_heads), ("key/value", config.kv_heads)):
        if heads % tp:
            raise SystemExit(
                f"--tp {tp} does not divide the model's {heads} {name} heads (each tp rank "
                f"computes whole heads); use a --tp that divides {heads}"
            )
    sizes = [("vocab", config.vocab_size)]
    sizes.append(("experts", config.n_experts) if config.n_experts
                 else ("FFN width", config.ffn_hidden))
    for name, size in sizes:
        if size % tp:
            raise SystemExit(f"--tp {tp} does not divide the model's {name} {size}")


def _expert_dim(dp: int):
    """FSDP's dimension for each parameter over ``dp`` ranks: the experts' stacked weights
    ``(experts, a, b)`` over ``a`` or ``b`` when it splits evenly (FSDP2 shards other dims
    than 0 only evenly): a rank's few experts over hundreds of dp ranks would leave most ranks
    empty and pad every all-gather to a whole expert a rank. Else, and for every other
    parameter, dim 0."""

    def choose(param: nn.Parameter) -> Shard | None:
        if param.dim() != 3 or param.shape[0] % dp == 0:
            return None
        for dim in (1, 2):
            if param.shape[dim] % dp == 0:
                return Shard(dim)
        return None

    return choose


def expert_shards(config: ModelConfig, dp: int, tp: int) -> int:
    """Over how many dp ranks FSDP shards a rank's experts by default: all ``dp`` when their
    stacked weights split evenly over them (:func:`_expert_dim`), else the largest number that
    divides both ``dp`` and the rank's ``n_experts / tp`` experts (one whole expert or more a
    rank), the experts then replicated over the ``dp / shards`` groups (HSDP: a reduce-scatter
    over the shards and an all-reduce over the replicas). Qwen3-30B-A3B with tp 4 on 16,384
    devices: 32 experts a rank over 32 of the 4,096 dp ranks, where FSDP over all 4,096 would
    pad each rank's share to a whole expert (a 72 GiB gradient reduce-scatter a rank)."""
    local = config.n_experts // tp
    hidden = config.expert_hidden or config.ffn_hidden
    if any(size % dp == 0 for size in (local, config.dim, hidden)):
        return dp
    return math.gcd(local, dp)


def token_stream(args, config: ModelConfig) -> torch.Tensor:
    """The bundled text when a sequence fits in it, else (or with ``--synthetic``, or under
    ``--compile-only``) seeded random tokens of the model's vocabulary, at least 65,536.

    Under --compile-only those are a fake tensor (free), and so is everything computed from
    them: the dry run then assumes what it must of values it cannot know (an MoE's routing is
    balanced: ``tpu_dist.compile_job``), where the text, real, would be routed through weights
    whose values the recorded collectives left meaningless (arbitrary all-to-all sizes)."""
    text = corpus()
    if (not args.synthetic and not _compile_only() and args.seq_len + 2 <= len(text)
            and config.vocab_size >= 256):
        return text
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, config.vocab_size, (max(4 * (args.seq_len + 1), 1 << 16),), generator=g)


def _compile_only() -> bool:
    """Whether this runs under ``tpu-launch --compile-only`` (asked of ``tpu_dist.compile_job``,
    which imports JAX, only when its variable is set: a gloo run does not import JAX)."""
    if not os.environ.get("TPU_DIST_COMPILE_ONLY"):
        return False
    from tpu_dist import compile_job

    return compile_job.enabled()


def main(argv: list[str] | None = None) -> str:
    """Train; return the backend the group ran on (the group is destroyed by then)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    args = parse_args(argv, __doc__, extra=_options)
    config = build_config(args)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    dp = args.dp if args.dp is not None else world // args.tp
    check_layout(config, dp, args.tp, world)
    if args.seqs_per_dp_rank is not None:
        if args.batch_size is not None:
            raise SystemExit("pass --batch-size or --seqs-per-dp-rank, not both")
        args.batch_size = args.seqs_per_dp_rank * dp
    batch_size = global_batch_size(args.batch_size, dp)  # a bad flag fails before any work
    shards = dp
    if args.expert_shards is not None and not config.n_experts:
        raise SystemExit("--expert-shards applies to a mixture of experts (--model "
                         "qwen3-30b-a3b or debug-moe); this model has none")
    if config.n_experts:
        shards = (expert_shards(config, dp, args.tp) if args.expert_shards is None
                  else args.expert_shards)
        local = config.n_experts // args.tp
        if shards != dp and (shards < 1 or dp % shards or local % shards):
            raise SystemExit(f"--expert-shards {shards} must be the dp degree {dp}, or divide "
                             f"both it and the {local} experts a tp rank holds")
    if shards == dp:
        mesh = init_device_mesh((dp, args.tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = expert_mesh = mesh["dp"]
    else:  # the experts' HSDP mesh, sliced from the same mesh as tp's (as FSDP2 requires)
        mesh = init_device_mesh((dp // shards, shards, args.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        expert_mesh = mesh["dp_replicate", "dp_shard"]
        dp_mesh = expert_mesh._flatten("dp")
        register_mesh(mesh)
    torch.manual_seed(args.seed)
    model = Decoder(config)
    params = sum(p.numel() for p in model.parameters())
    apply_tensor_parallel(model, mesh["tp"])
    if args.activation_checkpointing:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16" else None,
    )
    if expert_mesh is not dp_mesh:
        for module in model.modules():
            if isinstance(module, Experts):
                fully_shard(module, mesh=expert_mesh, mp_policy=policy)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, shard_placement_fn=_expert_dim(dp))
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    if rank == 0:
        print(f"FSDP2 x TP on mesh {describe_mesh(mesh)} ({dist.get_backend()}), "
              f"model {args.model or 'small'} ({params / 1e9:.3g} B parameters, "
              f"{config.n_layers} layers, {config.n_heads} heads / {config.kv_heads} kv), "
              f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}, "
              f"mixed precision {args.mixed_precision}, "
              f"global batch {batch_size}x{args.seq_len}", flush=True)
    return end(*train(args, model, dp_mesh.get_local_rank(), dp, dp_mesh.get_group(),
                      loss_context=loss_parallel, data=token_stream(args, config)))


if __name__ == "__main__":
    leave(main())  # on gloo, not Python's teardown: see train_fsdp.leave()
