"""Train a small Llama-style decoder with FSDP2 (``fully_shard``) on the "tpu" backend.

The model is written here: token embedding, N blocks of (RMSNorm, rotary causal attention,
RMSNorm, SwiGLU MLP) with residuals, a final RMSNorm and an output projection. It learns to
continue a tiny bundled text (The Zen of Python, from the standard library's ``this``
module), byte by byte; every step draws its batch from a generator seeded with the step
number, so a resumed run sees the same batches as an uninterrupted one.

Nothing in the training code is specific to TPUs: ``--backend gloo`` runs the same program
on torch's CPU backend. Run it on 4 CPU-emulated ranks::

    tpu-launch --nproc-per-node 4 examples/train_fsdp.py --steps 20
    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 20
    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 20 --backend gloo

Checkpoint and resume (``torch.distributed.checkpoint``: every rank writes its own shards of
the model and the optimizer to ``DIR/step-N``, after the last step and every ``--save-every``
steps; ``--resume`` loads the newest ``DIR/step-N`` and continues from step N + 1, with exactly
the numbers an uninterrupted run has)::

    tpu-launch --nproc-per-node 4 examples/train_fsdp.py --steps 10 --checkpoint-dir /tmp/ckpt
    tpu-launch --nproc-per-node 4 examples/train_fsdp.py --steps 20 --checkpoint-dir /tmp/ckpt --resume

A resume that finds the checkpoint already at ``--steps`` trains nothing, says so, and reports
the checkpoint's loss as the final one. Saving into a directory that already holds a later step
(an earlier run's) warns on stderr, because ``--resume`` would load that later step.

Rank 0 prints one line per step (step, loss of the global batch, tokens/s of the whole job)
and, last, ``final loss X after N steps``.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import io
import math
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tpu_dist  # noqa: F401  (registers the "tpu" backend)


# -- the model ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the decoder (the defaults train in seconds on CPU)."""

    vocab_size: int = 256
    """Byte-level tokens."""
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention: each serves n_heads / n_kv_heads query heads);
    None: n_heads (multi-head attention)."""
    head_dim: int | None = None
    """Size of each head; None: dim / n_heads (Qwen3 sets it apart: 64 heads of 128 on 5120)."""
    ffn_hidden: int = 128
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_experts: int = 0
    """Experts of each block's MLP (a mixture of experts: :class:`MoE`); 0: a dense MLP."""
    top_k: int = 2
    """Experts each token goes to (with ``n_experts``)."""
    expert_hidden: int | None = None
    """Each expert's SwiGLU width (with ``n_experts``); None: ``ffn_hidden``."""

    def __post_init__(self) -> None:
        if self.head_dim is None and (self.dim % self.n_heads or (self.dim // self.n_heads) % 2):
            raise ValueError(
                f"dim must split into n_heads heads of even size, got dim={self.dim}, "
                f"n_heads={self.n_heads}"
            )
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (each key/value "
                "head serves the same number of query heads)"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the compute dtype (bf16 under mixed precision).
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of each position's rotation angles, stacked: (2, max_seq_len, head_dim/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rotary(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position: pairs (i, i + head_dim/2)."""
    seq = x.shape[1]
    cos = tables[0, :seq, None, :].to(x.dtype)
    sin = tables[1, :seq, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_size
        self.group = config.n_heads // config.kv_heads  # query heads per key/value head
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.register_buffer(
            "rotary",
            rotary_tables(self.head_dim, config.max_seq_len, config.rope_theta),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary(q, self.rotary), apply_rotary(k, self.rotary)
        if self.group > 1:  # grouped-query attention: each key/value head serves `group` queries
            k, v = k.repeat_interleave(self.group, dim=2), v.repeat_interleave(self.group, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Token-choice top-k mixture of experts (Qwen3-MoE's): a router scores every expert for each
    token (softmax), the token goes to its ``top_k`` best, their outputs weighted by the scores
    renormalised over the ``top_k``. The experts are :class:`Experts`, run over the tokens sorted
    by expert.

    Expert parallelism (:meth:`parallelize_experts`): each rank of an ep group holds
    ``n_experts / ep`` of the experts and the tokens travel: an all-to-all of token counts, then
    of the routed tokens (split by the counts: they depend on the routing), the experts, and an
    all-to-all back. Every rank routes its own tokens; the all-to-alls' backward sends the
    gradients back the way the tokens came, so an expert's gradient sums over the tokens of the
    whole ep group (``train_moe.py`` divides it by the group's size).

    Under ``tpu-launch --compile-only`` the router's scores are fakes without values, and the
    top-k picks balanced experts (``tpu_dist.compile_job``): the recorded all-to-alls are those
    of balanced routing.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config)
        self.expert_group: dist.ProcessGroup | None = None

    def parallelize_experts(self, ep_mesh) -> None:
        """Expert parallelism over the 1-D DeviceMesh ``ep_mesh`` (in place): the experts'
        weights become DTensors sharded on the expert dimension (each rank keeps its
        ``n_experts / ep`` of the weights every rank built alike, from one seed: nothing is
        sent; a checkpoint holds them all), and the tokens travel over its group."""
        from torch.distributed.tensor import Shard, distribute_tensor

        for name in ("w1", "w2", "w3"):
            weight = getattr(self.experts, name).detach()
            setattr(self.experts, name, nn.Parameter(
                distribute_tensor(weight, ep_mesh, [Shard(0)], src_data_rank=None)))
        self.expert_group = ep_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        x = x.reshape(-1, dim)
        scores = F.linear(x, _local(self.router.weight)).float().softmax(dim=-1)
        weights, experts = scores.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        order = experts.reshape(-1).argsort(stable=True)  # the routed copies, by expert
        source = order // self.top_k
        flat = experts.reshape(-1)
        counts = torch.zeros(self.n_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # (a bincount of a shape known without the values)
        out = self._experts(x[source], counts)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, source, out).view(batch, seq, dim)

    def _experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.expert_group is None:
            return self.experts(tokens, counts)
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group = self.expert_group
        ep = dist.get_world_size(group)
        local = self.n_experts // ep
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=group)  # [rank, my expert] counts
        arriving = arriving.view(ep, local)
        send = counts.view(ep, local).sum(dim=1).tolist()
        receive = arriving.sum(dim=1).tolist()
        received = all_to_all_single_autograd(tokens, receive, send, group)
        # Rank-major (each sender's tokens by expert) to expert-major, and back after.
        expert_of_row = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(
            arriving.reshape(-1), output_size=sum(receive))
        to_experts = expert_of_row.argsort(stable=True)
        done = self.experts(received[to_experts], arriving.sum(dim=0))
        done = done[to_experts.argsort()]
        return all_to_all_single_autograd(done, send, receive, group)


class Experts(nn.Module):
    """The experts of a :class:`MoE`: SwiGLUs whose weights are stacked ``(experts, ...)`` and
    run as one grouped matmul (``torch._grouped_mm``). A module of its own, so a parallelism can
    shard the experts apart from the router (``train_moe.py``: FSDP over fewer ranks)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.expert_hidden or config.ffn_hidden
        self.w1 = nn.Parameter(torch.empty(config.n_experts, config.dim, hidden))
        self.w3 = nn.Parameter(torch.empty(config.n_experts, config.dim, hidden))
        self.w2 = nn.Parameter(torch.empty(config.n_experts, hidden, config.dim))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each of this rank's experts on its rows of ``tokens`` (sorted by expert, ``counts``
        each)."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        ends = counts.cumsum(0).to(torch.int32)
        hidden = F.silu(torch._grouped_mm(tokens, w1, offs=ends)) * torch._grouped_mm(
            tokens, w3, offs=ends)
        return torch._grouped_mm(hidden, w2, offs=ends)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight (a DTensor's local tensor; a plain tensor as it is): the
    MoE runs on this rank's tokens as plain tensors."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = MoE(config) if config.n_experts else FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # (3: the experts' stacked weights)
                # Small init, scaled down on the projections that feed the residual stream.
                std = 0.02 / math.sqrt(2 * config.n_layers) if name.endswith(("wo.weight", "w2.weight", ".w2")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# -- data -----------------------------------------------------------------------------------


def corpus() -> torch.Tensor:
    """The bundled text as bytes: The Zen of Python (``this`` stores it rot13-encoded)."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing ``this`` prints the text
        import this
    return torch.tensor(list(codecs.decode(this.s, "rot13").encode()), dtype=torch.long)


def batch(
    data: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (inputs, targets), each (batch_size, seq_len).

    Every rank computes the same global batch (cheap) and takes its rows, so the batches do
    not depend on the number of ranks, and a resumed run sees what an uninterrupted one does.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    # One gather, not a slice per sequence: 4,096 sequences at a pod's default batch were
    # 4,096 ops a step, each through --compile-only's step meters.
    rows = data[starts[:, None] + torch.arange(seq_len + 1)]
    return rows[:, :-1], rows[:, 1:]


DEFAULT_BATCH_SIZE = 8
"""The global batch, in sequences, when ``--batch-size`` is not given and there are at most 8
data-parallel ranks."""


def global_batch_size(requested: int | None, dp_size: int) -> int:
    """The global batch, in sequences, for ``dp_size`` data-parallel ranks.

    ``requested`` is ``--batch-size``. Unset (None): :data:`DEFAULT_BATCH_SIZE` rounded up to a
    multiple of ``dp_size``, so the example runs at any world size: 8 on 1, 2, 4 or 8
    data-parallel ranks, 9 on 3, one sequence per rank from 8 ranks on (4,096 on a (4096, 2)
    mesh). Set: that number, which must split evenly over the data-parallel ranks.

    Raises:
        SystemExit: ``--batch-size`` does not split over ``dp_size`` ranks (the message says
            what to pass).
    """
    if requested is None:
        return -(-DEFAULT_BATCH_SIZE // dp_size) * dp_size
    if requested < 1 or requested % dp_size:
        fit = max(1, -(-requested // dp_size)) * dp_size
        raise SystemExit(
            f"--batch-size {requested} does not split over {dp_size} data-parallel ranks: pass a "
            f"multiple of {dp_size} (e.g. --batch-size {fit}), or leave --batch-size out for one "
            f"sequence per data-parallel rank ({global_batch_size(None, dp_size)} here)"
        )
    return requested


def local_rows(x: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """This data-parallel rank's contiguous share of the global batch's rows."""
    if x.shape[0] % ranks:
        raise ValueError(f"global batch {x.shape[0]} does not split over {ranks} data-parallel ranks")
    return x.chunk(ranks)[rank]


# -- output that scales ----------------------------------------------------------------------

FULL_MESH_MAX_RANKS = 64
"""Meshes up to this many ranks are printed whole; larger ones as a summary (:func:`describe_mesh`)."""


def abbreviated(values: list, keep: int = 8) -> str:
    """``values`` as a list, or its first and last few and its length when longer than ``keep``."""
    if len(values) <= keep:
        return str(values)
    head, tail = ", ".join(map(str, values[:3])), ", ".join(map(str, values[-2:]))
    return f"[{head}, ..., {tail}] ({len(values)} ranks)"


def describe_mesh(mesh) -> str:
    """A DeviceMesh for one log line, whatever its size.

    Up to :data:`FULL_MESH_MAX_RANKS` ranks, every rank (``[[0, 1], [2, 3]] (dp, tp)``); above,
    the shape, the axis names and this rank's group along each axis (``(4096, 2) (dp, tp), 8192
    ranks; rank 0's groups: dp [0, 2, 4, ..., 8188, 8190] (4096 ranks), tp [0, 1]``): the whole
    mesh of 16,384 ranks is about 100 KB on one line.
    """
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    axes = f"({', '.join(names)})"
    ranks = mesh.mesh
    if ranks.numel() <= FULL_MESH_MAX_RANKS:
        return f"{ranks.tolist()} {axes}"
    coordinate = mesh.get_coordinate()
    groups = []
    for dim, name in enumerate(names):
        index = list(coordinate)
        index[dim] = slice(None)
        groups.append(f"{name} {abbreviated(ranks[tuple(index)].tolist())}")
    return (f"{tuple(ranks.shape)} {axes}, {ranks.numel()} ranks; rank {dist.get_rank()}'s groups: "
            + ", ".join(groups))


# -- training -------------------------------------------------------------------------------


def parse_args(
    argv: list[str] | None = None,
    description: str = __doc__,
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=description.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="tpu", help="c10d backend (default: tpu; gloo works too)")
    parser.add_argument("--steps", type=int, default=20, help="train until this step (default: 20)")
    parser.add_argument(
        "--batch-size", type=int, default=None,
        help=f"global batch, in sequences, a multiple of the data-parallel size (default: "
             f"{DEFAULT_BATCH_SIZE}, rounded up to a multiple of the data-parallel size: one "
             f"sequence per data-parallel rank from {DEFAULT_BATCH_SIZE} ranks on, so any world "
             f"size runs)",
    )
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mixed-precision", choices=("none", "bf16"), default="none",
        help="bf16: bf16 parameters and compute, fp32 gradient reduction (MixedPrecisionPolicy)",
    )
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save model and optimizer to DIR/step-N after the last step (DCP)")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    parser.add_argument("--resume", action="store_true",
                        help="load the newest DIR/step-N first and continue from step N + 1")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       ffn_hidden=2 * args.dim, max_seq_len=max(64, args.seq_len))


def save_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
    loss: float | None = None,
) -> None:
    """Save the sharded model and optimizer, the step and (if given) its loss with DCP: every
    rank writes its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}
    if loss is not None:
        state["loss"] = torch.tensor(loss)
    if os.path.exists(os.path.join(path, ".metadata")) and dist.get_rank() == 0:
        print(f"replacing {path} (an earlier run's)", flush=True)
    with warnings.catch_warnings():  # DCP warns on every rank when it overwrites; said once above
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save(state, checkpoint_id=path)


def saved_steps(directory: str) -> list[int]:
    """The N of every ``directory/step-N``, ascending (none if the directory does not exist)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name[5:]) for name in os.listdir(directory) if name.startswith("step-") and name[5:].isdigit())


def latest_checkpoint(directory: str) -> str:
    """The newest ``directory/step-N`` (highest N)."""
    steps = saved_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no step-N checkpoint in {directory!r} to resume from")
    return os.path.join(directory, f"step-{steps[-1]}")


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, float | None]:
    """Load what :func:`save_checkpoint` saved, resharded onto this run's model; the step and
    its loss (None for a checkpoint saved without one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    nan = float("nan")
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0), "loss": torch.tensor(nan)}
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loss = float(state["loss"])
    return int(state["step"]), None if loss != loss else loss


def global_mean(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """The mean of a scalar over a group (SUM then divide: gloo has no AVG)."""
    value = value.detach().float().reshape(1).clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(
    args: argparse.Namespace,
    model: nn.Module,
    dp_rank: int,
    dp_size: int,
    dp_group: dist.ProcessGroup | None,
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    data: torch.Tensor | None = None,
) -> tuple[float | None, int]:
    """The training loop shared by the examples; returns the final loss and the step it is of.

    When a resumed checkpoint is already at ``--steps`` or past it, nothing is trained and the
    checkpoint's own loss and step are returned (the loss is None if it holds none).

    ``loss_context`` wraps the loss and its backward (``loss_parallel`` for vocab-sharded
    logits). ``data``: the token stream batches are cut from (default: :func:`corpus`).
    """
    rank = dist.get_rank()
    batch_size = global_batch_size(args.batch_size, dp_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, final = 0, None
    if args.resume:
        path = latest_checkpoint(args.checkpoint_dir)
        start, final = load_checkpoint(path, model, optimizer)
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)
            if start >= args.steps:
                print(f"nothing left to train: the checkpoint is at step {start} and --steps is {args.steps} "
                      f"(raise --steps to train further); its loss is the final loss", flush=True)
    data = corpus() if data is None else data
    for step in range(start + 1, args.steps + 1):
        began = time.perf_counter()
        inputs, targets = batch(data, step, batch_size, args.seq_len, args.seed)
        inputs, targets = local_rows(inputs, dp_rank, dp_size), local_rows(targets, dp_rank, dp_size)
        with loss_context():
            loss = cross_entropy(model(inputs), targets)
            loss.backward()
        if hasattr(loss, "full_tensor"):  # a DTensor under loss_parallel
            loss = loss.full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        final = global_mean(loss, dp_group)
        elapsed = time.perf_counter() - began
        if rank == 0:
            tokens = batch_size * args.seq_len
            print(f"step {step:4d} | loss {final:.6f} | {tokens / elapsed:8.0f} tokens/s", flush=True)
        if args.checkpoint_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            path = os.path.join(args.checkpoint_dir, f"step-{step}")
            later = [n for n in saved_steps(args.checkpoint_dir) if n > step]
            save_checkpoint(path, model, optimizer, step, final)
            if rank == 0:
                print(f"saved step {step} to {path}", flush=True)
                if later:
                    print(f"warning: {args.checkpoint_dir} also holds step-{later[-1]} from an earlier run; "
                          f"--resume loads the newest, step-{later[-1]}, not this step {step}. "
                          "Use a new --checkpoint-dir per run, or delete the later steps.", file=sys.stderr, flush=True)
    return final, max(start, args.steps)


def report_final(final: float | None, step: int) -> None:
    """Rank 0's last line: ``final loss X after N steps`` (``none`` for a checkpoint without a loss)."""
    print(f"final loss {'none' if final is None else f'{final:.6f}'} after {step} steps", flush=True)


def end(final: float | None, step: int) -> str:
    """After training: rank 0 prints :func:`report_final`'s line, the group is destroyed, and
    the backend it ran on is returned (for :func:`leave`)."""
    if dist.get_rank() == 0:
        report_final(final, step)
    backend = dist.get_backend()
    dist.destroy_process_group()
    return backend


def leave(backend: str) -> None:
    """End a finished rank that ran on another backend than tpu_dist's (gloo) without Python's
    interpreter teardown: threads joined, ``atexit`` handlers run, streams flushed, then
    ``os._exit(0)``. On "tpu" it returns (tpu_dist orders its own exit).

    Why: FSDP2 keeps the gloo group alive past ``destroy_process_group``, and a gloo worker
    thread frees its last collective's tensors a moment after ``wait`` returned; that takes the
    GIL, and if Python 3.11's teardown has begun, the thread is ended inside a ``noexcept``
    destructor: ``terminate called without an active exception`` (SIGABRT) after a run that
    finished, 4-6 of 25-40 launches on a loaded host (torch 2.13;
    docs/decisions/0019-examples-leave-without-finalization-on-gloo.md).
    A failing run never gets here: its exception ends it the ordinary way.
    """
    if backend == tpu_dist.BACKEND:
        return
    import atexit
    import threading

    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> str:
    """Train; return the backend the group ran on (the group is destroyed by then)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    args = parse_args(argv)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch_size = global_batch_size(args.batch_size, world)  # before any work: a bad flag fails fast
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(args.seed)  # the same initial weights on every rank; FSDP2 keeps a shard
    model = Decoder(model_config(args))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16" else None,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"FSDP2 on {world} ranks ({dist.get_backend()}): {params} parameters, "
              f"global batch {batch_size}x{args.seq_len}, mixed precision {args.mixed_precision}", flush=True)
    return end(*train(args, model, rank, world, None))


if __name__ == "__main__":
    leave(main())  # on gloo, not Python's teardown: see leave()
