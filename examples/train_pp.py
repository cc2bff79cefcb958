"""Train ``train_fsdp.py``'s decoder with pipeline parallelism (``torch.distributed.pipelining``).

The decoder's blocks are split into stages, one block a stage by default: stage 0 also holds
the token embedding, the last stage the final norm and the output projection, whose logits the
schedule's loss function (cross-entropy) turns into the loss. Each step's batch is split into
``--microbatches`` microbatches (default: twice the number of stages) that flow through the
stages in the order the schedule (``--schedule``, any of torch 2.13's seven) gives, each stage
sending its activations forward and its gradients back to the ranks of its neighbours with
``isend``/``irecv``/``batch_isend_irecv``. Where the stages sit on the P pp ranks:

* ``GPipe``, ``1F1B``: one stage a rank, stage s on rank s;
* ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``: ``--stages-per-rank`` (default
  2), stage s on rank s % P (rank 0 holds stages 0, P, 2P, ...);
* ``ZBVZeroBubble``, ``DualPipeV``: two stages a rank in a V, rank r holds r and 2P - 1 - r.

With ``--dp D`` the world is a 2-D (pp, dp) mesh (``tpu_dist.mesh.init_device_mesh``, pp outer):
each of the D pipelines trains its share of the batch, and FSDP2 (``fully_shard``) shards every
stage over its dp group, as TorchTitan combines them. Nothing here is specific to TPUs:
``--backend gloo`` runs the same program on torch's CPU backend, with the same losses::

    tpu-launch --nproc-per-node 2 examples/train_pp.py --schedule Interleaved1F1B
    torchrun --nproc-per-node 2 examples/train_pp.py --schedule Interleaved1F1B --backend gloo
    tpu-launch --nproc-per-node 4 examples/train_pp.py --schedule DualPipeV --dp 2
    tpu-launch --emulate v5p:2x2x1 --compile-only examples/train_pp.py \
        --schedule Interleaved1F1B --dp 2

Each stage is told the shapes it takes and returns; ``--infer-shapes`` lets torch infer them in
the first step instead (each stage sends its output's shape to the next, as TorchTitan leaves
it), which a ``--compile-only`` run cannot do (one rank runs, with no peer to receive from).

Rank 0 prints the layout, one line per step (step, loss of the global batch: the mean over
microbatches and pipelines) and, last, ``final loss X after N steps``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fsdp import (  # noqa: E402
    Decoder,
    ModelConfig,
    batch,
    corpus,
    cross_entropy,
    leave,
    local_rows,
    parse_args,
    report_final,
)

import tpu_dist  # noqa: E402,F401  (registers the "tpu" backend)
from tpu_dist.mesh import init_device_mesh  # noqa: E402

SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV",
)
"""Every schedule of ``torch.distributed.pipelining`` in torch 2.13 (``get_schedule_class``)."""

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules that place a rank's two stages as a V (module docstring)."""


class Stage(nn.Module):
    """Blocks ``layers`` of a :class:`Decoder`, with its embedding if it holds the first block and
    its final norm and output projection if it holds the last (the modules are the decoder's
    own: a stage trains the decoder's parameters)."""

    def __init__(self, model: Decoder, layers: range) -> None:
        super().__init__()
        first, last = layers.start == 0, layers.stop == len(model.layers)
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The blocks of ``stage``: ``n_layers`` split as evenly as possible, earlier stages first."""
    if n_layers < n_stages:
        raise SystemExit(f"--layers {n_layers} cannot fill {n_stages} stages: pass --layers "
                         f"{n_stages} or more (one block a stage at least)")
    per, extra = divmod(n_layers, n_stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


def stages_of(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stage indices pp rank ``pp_rank`` holds (module docstring)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """``--stages-per-rank``, or the schedule's default (1 for single-stage schedules, else 2)."""
    single = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
    default = 1 if single else 2
    if requested is None:
        return default
    if single and requested != 1:
        raise SystemExit(f"--schedule {schedule} runs one stage a rank; drop --stages-per-rank "
                         "or pick a multi-stage schedule (Interleaved1F1B, LoopedBFS, ...)")
    if schedule in V_SCHEDULES and requested != 2:
        raise SystemExit(f"--schedule {schedule} runs exactly two stages a rank (a V)")
    if requested < 1:
        raise SystemExit(f"--stages-per-rank must be at least 1, got {requested}")
    return requested


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the job is split: stages, microbatches and batch (from the flags and the world)."""

    pp: int
    dp: int
    per_rank: int
    """Stages each pp rank holds."""
    microbatches: int
    batch_size: int
    """Sequences a step, over all pipelines."""

    @property
    def n_stages(self) -> int:
        return self.pp * self.per_rank

    @property
    def rows(self) -> int:
        """Sequences a microbatch."""
        return self.batch_size // self.dp // self.microbatches


def layout(args, world: int) -> Layout:
    """The :class:`Layout` the flags ask for on ``world`` ranks (SystemExit saying what to pass
    when they do not fit)."""
    if args.dp < 1 or world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
    pp, dp = world // args.dp, args.dp
    per_rank = stages_per_rank(args.schedule, args.stages_per_rank)
    microbatches = args.microbatches if args.microbatches is not None else 2 * pp * per_rank
    batch_size = args.batch_size if args.batch_size is not None else microbatches * dp
    if batch_size < 1 or batch_size % (microbatches * dp):
        raise SystemExit(f"--batch-size {batch_size} does not split into {microbatches} "
                         f"microbatches on each of {dp} pipelines: pass a multiple of "
                         f"{microbatches * dp}")
    return Layout(pp, dp, per_rank, microbatches, batch_size)


def build(args, plan: Layout, pp_group: dist.ProcessGroup, pp_rank: int, dp_mesh=None):
    """This rank's stage modules, its ``PipelineStage``s and the schedule that runs them.

    Each stage is told the shapes it takes and returns (``input_args``/``output_args``), unless
    ``--infer-shapes``: then torch infers them in the first step, each stage sending its
    output's shape to the next (as TorchTitan leaves it). A ``--compile-only`` run needs them
    told: one rank's dry run has no peers to receive shapes from.
    """
    n_layers = args.layers if args.layers is not None else plan.n_stages
    config = ModelConfig(dim=args.dim, n_layers=n_layers, n_heads=args.heads,
                         ffn_hidden=2 * args.dim, max_seq_len=max(64, args.seq_len))
    torch.manual_seed(args.seed)  # the same decoder on every rank; each keeps its stages
    model = Decoder(config)
    tokens = torch.empty(plan.rows, args.seq_len, dtype=torch.long, device="meta")
    # Activations (and the logits) carry gradients back: their shapes say so.
    hidden = torch.empty(plan.rows, args.seq_len, args.dim, device="meta", requires_grad=True)
    logits = torch.empty(plan.rows, args.seq_len, config.vocab_size, device="meta",
                         requires_grad=True)
    modules, stages = [], []
    for index in stages_of(args.schedule, pp_rank, plan.pp, plan.per_rank):
        module = Stage(model, stage_layers(n_layers, plan.n_stages, index))
        if dp_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for layer in module.layers:
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        shapes = {} if args.infer_shapes else {
            "input_args": tokens if index == 0 else hidden,
            "output_args": logits if index == plan.n_stages - 1 else hidden,
        }
        modules.append(module)
        stages.append(PipelineStage(module, index, plan.n_stages, torch.device("cpu"),
                                    group=pp_group, **shapes))
    schedule = get_schedule_class(args.schedule)(
        stages[0] if plan.per_rank == 1 else stages, n_microbatches=plan.microbatches,
        loss_fn=cross_entropy,
    )
    return modules, stages, schedule


def _options(parser) -> None:
    parser.add_argument("--schedule", choices=SCHEDULES, default="1F1B",
                        help="the pipelining schedule (default: 1F1B)")
    parser.add_argument("--dp", type=int, default=1,
                        help="pipelines side by side, FSDP2 over them (default: 1, pure pipeline)")
    parser.add_argument("--stages-per-rank", type=int, default=None,
                        help="stages each pp rank holds (multi-stage schedules; default: 2)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches a step (default: twice the number of stages)")
    parser.add_argument("--infer-shapes", action="store_true",
                        help="let torch infer each stage's shapes in the first step (not under "
                             "--compile-only)")
    parser.set_defaults(layers=None)  # train_fsdp's --layers: here one block a stage by default


def parse(argv: list[str] | None = None):
    """The command line (``train_fsdp.py``'s flags and this example's)."""
    args = parse_args(argv, __doc__, extra=_options)
    if args.checkpoint_dir or args.mixed_precision != "none":
        raise SystemExit("train_pp.py does not take --checkpoint-dir or --mixed-precision "
                         "(train_fsdp.py shows both)")
    return args


def train(args, plan: Layout, modules: list[nn.Module], stages: list[PipelineStage], schedule,
          dp_rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Run ``--steps`` steps; return each step's loss (the mean over microbatches and pipelines,
    on every rank) and this rank's gradients of the last step (by parameter name, local shards
    for FSDP2's), taken before the optimizer step."""
    rank = dist.get_rank()
    params = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    data, step_losses, grads = corpus(), [], {}
    for step in range(1, args.steps + 1):
        began = time.perf_counter()
        inputs, targets = batch(data, step, plan.batch_size, args.seq_len, args.seed)
        inputs = local_rows(inputs, dp_rank, plan.dp)
        targets = local_rows(targets, dp_rank, plan.dp)
        losses: list[torch.Tensor] = []
        schedule.step(*((inputs,) if has_first else ()),
                      **({"target": targets, "losses": losses} if has_last else {}))
        if step == args.steps:
            grads = {
                f"{stage.stage_index}.{name}": _local(p.grad).clone()
                for stage, module in zip(stages, modules)
                for name, p in module.named_parameters() if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad()
        # The last stage's ranks hold the microbatches' losses: their mean over the whole job.
        total = torch.stack(losses).sum().detach().reshape(1) if has_last else torch.zeros(1)
        dist.all_reduce(total)
        step_losses.append(total.item() / (plan.microbatches * plan.dp))
        if rank == 0:
            elapsed = time.perf_counter() - began
            tokens = plan.batch_size * args.seq_len
            print(f"step {step:4d} | loss {step_losses[-1]:.6f} | {tokens / elapsed:8.0f} "
                  "tokens/s", flush=True)
    return step_losses, grads


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def main(argv: list[str] | None = None) -> str:
    """Train; return the backend the group ran on (the group is destroyed by then)."""
    args = parse(argv)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = layout(args, world)  # a bad flag fails before any work
    mesh = init_device_mesh((plan.pp, plan.dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    modules, stages, schedule = build(
        args, plan, mesh.get_group("pp"), pp_rank, mesh["dp"] if plan.dp > 1 else None
    )
    if rank == 0:
        print(f"{args.schedule} on {plan.pp} pp ranks x {plan.dp} dp ({dist.get_backend()}): "
              f"{plan.n_stages} stages, {plan.microbatches} microbatches of {plan.rows} "
              f"sequences of {args.seq_len}", flush=True)
    losses, _ = train(args, plan, modules, stages, schedule, dp_rank)
    if rank == 0:
        report_final(losses[-1] if losses else None, args.steps)
    backend = dist.get_backend()
    dist.destroy_process_group()
    return backend


if __name__ == "__main__":
    leave(main())  # on gloo, not Python's teardown: see train_fsdp.leave()
