"""Train a small Qwen3-style mixture of experts with FSDP2 x expert parallelism on a 2-D mesh.

The model is ``train_fsdp.py``'s decoder with every feed-forward block replaced by a mixture of
experts, as in Qwen3's MoE models: a router (a linear layer, softmax over the experts, the top
``k`` kept and renormalised) sends each token to ``k`` of ``--experts`` SwiGLU experts and adds
their outputs, weighted by the router's scores.

Parallelism, as TorchTitan lays it out, on a (dp, ep) mesh from
:func:`tpu_dist.mesh.init_device_mesh` (ep inner: its groups sit on neighbouring chips, because
every MoE layer exchanges tokens over them twice a step, forward and backward):

* **expert parallelism** over ``ep``: each ep rank holds ``experts / ep`` of each layer's
  experts. A layer routes this rank's tokens, tells each ep peer how many tokens it will get
  for each of the peer's experts (an ``all_to_all_single`` of counts), sends the tokens (an
  ``all_to_all_single`` whose split sizes are the router's decisions: they change every step
  and every layer), runs its own experts on what it received, and sends the results back (the
  reverse all-to-all); the backward pass runs the two exchanges the other way;
* **FSDP2** over every rank (the flattened ``("dp", "ep")`` dimension) for everything but the
  experts, and over ``dp`` for the experts (each ep rank's experts are sharded over the ranks
  that hold the same ones); every rank trains on its own share of the batch, and the experts'
  gradients, which sum over the tokens of a whole ep group, are scaled by ``1 / ep`` in the
  backward pass (FSDP averages them over dp only), so every gradient is the global batch's
  mean, as on one rank.

Run it on 4 CPU-emulated ranks (a (2, 2) mesh), on "tpu" or on torch's gloo for comparison::

    tpu-launch --nproc-per-node 4 examples/train_moe.py --steps 20
    torchrun --nproc-per-node 4 examples/train_moe.py --steps 20 --backend gloo
    torchrun --nproc-per-node 2 examples/train_moe.py --ep 2 --model debug --seq-len 128

``--model debug`` is TorchTitan's Qwen3 MoE debug model (dim 256, 8 layers, 16 heads of 128 /
8 kv, 64 experts of width 768, top 8, vocabulary 2048: 310 M parameters, 1.2 GB in fp32);
``--model qwen3-30b-a3b`` is Qwen3-30B-A3B (dim 2048, 48 layers, 32 heads of 128 / 4 kv, 128
experts of width 768, top 8, vocabulary 151936), for ``--compile-only``::

    tpu-launch --emulate v5p:2x2x2 --compile-only examples/train_moe.py --ep 4 --steps 2
    tpu-launch --emulate v5p:4x4x4 --compile-only examples/train_moe.py --model qwen3-30b-a3b \\
        --ep 8 --seq-len 4096 --seqs-per-rank 1 --mixed-precision bf16 --steps 2

**Routing under --compile-only.** There the script's large tensors are fakes without values,
and the collectives move nothing, so no router decides anything: every rank sends the same
number of tokens to each expert (token ``t``'s ``j``-th choice is expert ``(t * k + j) mod
experts``: perfectly balanced routing, ``tokens * k / experts`` a expert). The recorded
all-to-alls have those sizes; on the real job the sizes follow the router, and the backend
rounds the widest chunk up to a size bucket (``tpu_dist.collectives``: four sizes per doubling),
so the compiled program is the balanced size's bucket or one of the next few.

Rank 0 prints the mesh, the model, one line per step (step, loss of the global batch, tokens/s)
and, last, ``final loss X after N steps``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fsdp import (  # noqa: E402
    Attention,
    Decoder,
    ModelConfig,
    RMSNorm,
    describe_mesh,
    end,
    global_batch_size,
    leave,
    parse_args,
    train,
)
from train_fsdp_tp import token_stream  # noqa: E402

import tpu_dist  # noqa: E402,F401  (registers the "tpu" backend)
from tpu_dist.mesh import init_device_mesh, register_mesh  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(ModelConfig):
    """The decoder's sizes, and its experts'."""

    n_experts: int = 8
    top_k: int = 2
    """Experts each token is sent to."""
    expert_hidden: int = 64
    """Hidden width of each SwiGLU expert."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")


PRESETS: dict[str, dict] = {
    "debug": dict(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128, n_experts=64,
                  top_k=8, expert_hidden=768, vocab_size=2048, rope_theta=1000000.0,
                  norm_eps=1e-6),
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          n_experts=128, top_k=8, expert_hidden=768, vocab_size=151936,
                          rope_theta=1000000.0, norm_eps=1e-6),
}
"""``--model``: the module docstring's shapes."""


# -- expert parallelism ------------------------------------------------------------------------


@functools.cache
def compile_only() -> bool:
    """Whether the script runs under ``tpu-launch --compile-only``
    (``tpu_dist.compile_job.enabled()``, asked only when its variable is set: a gloo run then
    does not import JAX, which ``tpu_dist.compile_job`` does)."""
    if not os.environ.get("TPU_DIST_COMPILE_ONLY"):
        return False
    from tpu_dist import compile_job

    return compile_job.enabled()



class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows as an autograd op: the backward sends the gradients back
    the way the rows came (the same exchange with the split sizes swapped)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class Experts(nn.Module):
    """This ep rank's experts of one layer: ``local`` SwiGLU experts, global ids ``first`` to
    ``first + local - 1``. Expert ``e`` is initialised from a generator seeded with
    ``(seed, layer, e)``, so the model is the same whatever the mesh (and on either backend).

    ``grad_scale`` multiplies the weights' gradients: ``1 / ep``, because the rows an expert
    sees come from every rank of its ep group (module docstring)."""

    def __init__(self, config: MoEConfig, first: int, local: int, layer: int, seed: int,
                 grad_scale: float = 1.0) -> None:
        super().__init__()
        self.grad_scale = grad_scale
        dim, hidden = config.dim, config.expert_hidden
        self.w1 = nn.Parameter(torch.empty(local, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(local, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, dim))
        std_in, std_out = 0.02, 0.02 / math.sqrt(2 * config.n_layers)
        with torch.no_grad():
            for i in range(local):
                g = torch.Generator().manual_seed((seed * 1_000 + layer) * 100_003 + first + i)
                self.w1[i].normal_(0.0, std_in, generator=g)
                self.w3[i].normal_(0.0, std_in, generator=g)
                self.w2[i].normal_(0.0, std_out, generator=g)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` grouped by local expert, ``counts[i]`` rows for expert ``i``."""
        w1, w3, w2 = (_ScaleGrad.apply(w, self.grad_scale) for w in (self.w1, self.w3, self.w2))
        outs = []
        for i, x in enumerate(rows.split(counts)):
            outs.append((F.silu(x @ w1[i]) * (x @ w3[i])) @ w2[i])
        return torch.cat(outs)


class MoE(nn.Module):
    """Router, top-k, and the experts spread over the ep group (module docstring)."""

    def __init__(self, config: MoEConfig, ep_group: dist.ProcessGroup | None, ep_rank: int,
                 ep: int, layer: int, seed: int) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.ep = config.n_experts, config.top_k, ep
        self.local = config.n_experts // ep
        self.ep_group = ep_group
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config, ep_rank * self.local, self.local, layer, seed, 1.0 / ep)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``k`` experts and their weights (softmax over all experts, the top k
        renormalised, as Qwen3's ``norm_topk_prob``); balanced under --compile-only (module
        docstring)."""
        scores = F.softmax(self.router(tokens).float(), dim=-1)
        if compile_only():
            count = tokens.shape[0]
            choice = torch.arange(count * self.top_k, device=tokens.device) % self.n_experts
            chosen = choice.view(count, self.top_k)
            weights = scores.gather(1, chosen)
        else:
            weights, chosen = scores.topk(self.top_k, dim=-1)
        return chosen, weights / weights.sum(-1, keepdim=True)

    def counts(self, chosen: torch.Tensor) -> torch.Tensor:
        """Tokens this rank sends to each expert (int64, one per expert)."""
        if compile_only():  # balanced: the rows of route()'s round robin
            total = chosen.numel()
            return torch.tensor([total // self.n_experts + (e < total % self.n_experts)
                                 for e in range(self.n_experts)])
        return torch.bincount(chosen.reshape(-1), minlength=self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        chosen, weights = self.route(tokens)
        flat = chosen.reshape(-1)  # token t's j-th choice at t * k + j
        order = flat.argsort(stable=True)  # the copies grouped by expert, so by owning ep rank
        rows = tokens[order // self.top_k]
        counts = self.counts(chosen)
        # How many rows each ep peer sends this rank for each of its experts: row i of
        # `incoming` is ep rank i's counts for this rank's experts.
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.ep_group)
        if compile_only():
            incoming = counts.clone()  # every rank routes alike (module docstring)
        local = self.local
        incoming = incoming.view(self.ep, local).tolist()
        send = counts.view(self.ep, local).sum(1).tolist()
        recv = [sum(row) for row in incoming]
        received = _AllToAll.apply(rows, recv, send, self.ep_group)
        # Received: per source rank, per local expert; the experts want per expert, per source.
        blocks = received.split([n for row in incoming for n in row])
        by_expert = [blocks[s * local + e] for e in range(local) for s in range(self.ep)]
        out = self.experts(torch.cat(by_expert), [sum(row[e] for row in incoming)
                                                 for e in range(local)])
        blocks = out.split([incoming[s][e] for e in range(local) for s in range(self.ep)])
        by_source = [blocks[e * self.ep + s] for s in range(self.ep) for e in range(local)]
        returned = _AllToAll.apply(torch.cat(by_source), send, recv, self.ep_group)
        copies = returned[order.argsort()].view(-1, self.top_k, shape[-1])
        mixed = (copies * weights.unsqueeze(-1).to(copies.dtype)).sum(1)
        return mixed.view(shape)


class Block(nn.Module):
    def __init__(self, config: MoEConfig, moe: MoE) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))


def moe_decoder(config: MoEConfig, ep_group: dist.ProcessGroup | None, ep_rank: int, ep: int,
                seed: int) -> Decoder:
    """``train_fsdp.py``'s decoder with a :class:`MoE` in every block, this ep rank's experts."""
    blocks = [Block(config, MoE(config, ep_group, ep_rank, ep, i, seed))
              for i in range(config.n_layers)]
    return Decoder(config, blocks)


# -- training -------------------------------------------------------------------------------


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


def build_config(args) -> MoEConfig:
    """The model ``--model`` names (at ``--seq-len``), or the small one of the other flags."""
    if args.model is not None:
        return MoEConfig(**PRESETS[args.model], max_seq_len=max(64, args.seq_len))
    return MoEConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                     max_seq_len=max(64, args.seq_len), n_experts=args.experts,
                     top_k=args.top_k, expert_hidden=args.expert_hidden or args.dim)


def apply_fsdp(model: Decoder, experts_mesh, mesh, policy) -> None:
    """FSDP2 over ``mesh`` (every rank) for all but the experts, which are sharded over
    ``experts_mesh`` (the ranks that hold the same experts: dp)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer.moe.experts, mesh=experts_mesh, mp_policy=policy)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


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
    dp = world // ep
    if args.seqs_per_rank is not None:
        if args.batch_size is not None:
            raise SystemExit("pass --batch-size or --seqs-per-rank, not both")
        args.batch_size = args.seqs_per_rank * world
    batch_size = global_batch_size(args.batch_size, world)  # every rank has its own share
    mesh = init_device_mesh((dp, ep), mesh_dim_names=("dp", "ep"))
    everyone = mesh["dp", "ep"]._flatten("dp_ep")  # FSDP over every rank (TorchTitan's dp_shard)
    register_mesh(mesh)
    torch.manual_seed(args.seed)
    model = moe_decoder(config, mesh.get_group("ep"), mesh.get_local_rank("ep"), ep, args.seed)
    local_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for layer in model.layers for p in layer.moe.experts.parameters())
    params = local_params + expert_params * (ep - 1)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16" else None,
    )
    apply_fsdp(model, mesh["dp"], everyone, policy)
    if rank == 0:
        print(f"FSDP2 x EP on mesh {describe_mesh(mesh)} ({dist.get_backend()}), "
              f"model {args.model or 'small'} ({params / 1e6:.4g} M parameters, "
              f"{config.n_layers} layers, {config.n_experts} experts of {config.expert_hidden}, "
              f"top {config.top_k}), mixed precision {args.mixed_precision}, "
              f"global batch {batch_size}x{args.seq_len}", flush=True)
    return end(*train(args, model, everyone.get_local_rank(), world, everyone.get_group(),
                      data=token_stream(args, config)))


if __name__ == "__main__":
    leave(main())  # on gloo, not Python's teardown: see train_fsdp.leave()
