"""Time a training step of ``examples/train_fsdp.py`` (or ``train_moe.py``) on "tpu" and on
"gloo" in ONE run.

Every rank builds the example's decoder twice from the same seed, wraps one copy with FSDP2
(``--wrap fsdp``, default) or DDP (``--wrap ddp``) over a "tpu" group and the other over a
"gloo" group (the same ranks), and trains both on the same batches, alternating blocks of steps
so that both backends see the same machine load. With ``--wrap moe`` the model is
``examples/train_moe.py``'s mixture of experts under FSDP2 x expert parallelism, on a (dp, ep)
mesh of each backend's groups (ranks in row-major order; the example's flags ``--ep``,
``--experts``, ``--top-k``, ``--expert-hidden``, ``--model`` apply). A step is the example's: forward, backward,
AdamW step, and the all-reduce of the loss, timed from a barrier (on a third, gloo, group) to
its end on each rank, then averaged over ranks. The two copies must produce the same losses up
to the order in which the backends add a gradient's terms (relative difference <= 1e-6, as the
test suite holds them); the script says so at the end and exits 1 otherwise.

    tpu-launch --nproc-per-node 4 benchmarks/train_step.py                  # the example's model
    tpu-launch --nproc-per-node 4 benchmarks/train_step.py --wrap ddp
    tpu-launch --nproc-per-node 4 benchmarks/train_step.py --dim 256 --layers 4 --seq-len 128
    tpu-launch --nproc-per-node 2 benchmarks/train_step.py --wrap moe --model debug --seq-len 128
    torchrun --nproc-per-node 2 benchmarks/train_step.py --rounds 10 --steps-per-round 5

Rank 0 prints one line per round and a summary: median step time per backend, the spread
(half the p10..p90 range) and the ratio tpu/gloo (above 1: tpu is slower). Model flags are the
example's (``--dim``, ``--layers``, ``--heads``, ``--batch-size``, ``--seq-len``, and
``--mixed-precision``, which only FSDP2 uses).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import tpu_dist  # noqa: F401  (registers "tpu")

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    sys.path.insert(0, str(_EXAMPLES))  # train_moe imports train_fsdp
    spec = importlib.util.spec_from_file_location(name, _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _extra_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds (default: 8)")
    parser.add_argument("--steps-per-round", type=int, default=4,
                        help="steps per backend per round (default: 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per backend first")
    parser.add_argument("--wrap", choices=("fsdp", "ddp", "moe"), default="fsdp",
                        help="FSDP2 fully_shard (default), DistributedDataParallel, or the "
                             "mixture of experts of train_moe.py (FSDP2 x EP)")


def _spread(times: list[float]) -> float:
    ordered = sorted(times)
    p10 = ordered[int(0.1 * (len(ordered) - 1))]
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return (p90 - p10) / 2 / statistics.median(ordered)


def _moe_model(moe, args, group: dist.ProcessGroup, backend: str, policy):
    """train_moe.py's model over a (dp, ep) mesh of ``backend`` groups (ranks row-major)."""
    world = dist.get_world_size()
    ep = args.ep
    dp = world // ep
    layout = torch.arange(world).view(dp, ep)
    ep_group, _ = dist.new_subgroups_by_enumeration(layout.tolist(), backend=backend)
    dp_group, _ = dist.new_subgroups_by_enumeration(layout.t().tolist(), backend=backend)
    mesh = DeviceMesh.from_group([dp_group, ep_group], "cpu", mesh=layout,
                                 mesh_dim_names=("dp", "ep"))
    everyone = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp_ep",))
    torch.manual_seed(args.seed)
    model = moe.Decoder(moe.build_config(args))
    moe.parallelize(model, mesh, everyone, policy)
    return model


def main() -> None:
    wrap = sys.argv[sys.argv.index("--wrap") + 1] if "--wrap" in sys.argv else "fsdp"
    base = _example("train_fsdp")  # the training loop's pieces (batches, loss)
    ex = _example("train_moe") if wrap == "moe" else base

    def flags(parser: argparse.ArgumentParser) -> None:
        _extra_flags(parser)
        if wrap == "moe":
            ex._options(parser)

    args = ex.parse_args(None, __doc__, flags)
    dist.init_process_group("tpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if wrap == "moe" and args.seqs_per_rank is not None:
        args.batch_size = args.seqs_per_rank * world
    args.batch_size = ex.global_batch_size(args.batch_size, world)  # the example's default rule
    groups = {"tpu": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    control = dist.new_group(backend="gloo")
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16" else None,
    )
    data = ex.corpus() if wrap != "moe" else ex.token_stream(args, ex.build_config(args))
    models, optimizers = {}, {}
    for name, group in groups.items():
        if wrap == "moe":
            models[name] = _moe_model(ex, args, group, name, policy)
            optimizers[name] = torch.optim.AdamW(models[name].parameters(), lr=args.lr,
                                                 weight_decay=0.0)
            continue
        torch.manual_seed(args.seed)
        model = ex.Decoder(ex.model_config(args))
        if args.wrap == "ddp":
            model = DistributedDataParallel(model, process_group=group)
        else:
            mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
        models[name] = model
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    next_step = {name: 1 for name in groups}
    losses: dict[str, list[float]] = {name: [] for name in groups}

    def step(name: str) -> float:
        """One training step of ``name``'s copy; returns its time on this rank."""
        n = next_step[name]
        next_step[name] += 1
        dist.barrier(group=control)
        began = time.perf_counter()
        inputs, targets = base.batch(data, n, args.batch_size, args.seq_len, args.seed)
        inputs = base.local_rows(inputs, rank, world)
        targets = base.local_rows(targets, rank, world)
        loss = base.cross_entropy(models[name](inputs), targets)
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad()
        losses[name].append(base.global_mean(loss, groups[name]))
        return time.perf_counter() - began

    if rank == 0:
        params = sum(p.numel() for p in models["tpu"].parameters())
        wrapper = {"ddp": "DDP", "fsdp": "FSDP2"}.get(wrap) or f"FSDP2 x EP {args.ep}"
        print(f"# {wrapper} step of examples/{ex.__name__}.py: {world} ranks, {params} parameters, "
              f"batch {args.batch_size}x{args.seq_len}, mixed precision {args.mixed_precision}; "
              f"{args.rounds} rounds x {args.steps_per_round} steps per backend, alternating; "
              f"torch {torch.__version__}", flush=True)
    for name in groups:
        for _ in range(args.warmup):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in groups}
    order = list(groups)
    for r in range(args.rounds):
        for name in order:
            for _ in range(args.steps_per_round):
                mine = torch.tensor([step(name)], dtype=torch.float64)
                dist.all_reduce(mine, group=control)
                times[name].append(mine.item() / world)
        order.reverse()
        if rank == 0:
            last = {n: statistics.median(t[-args.steps_per_round:]) * 1e3 for n, t in times.items()}
            cells = " | ".join(f"{n} {ms:8.2f} ms" for n, ms in last.items())
            print(f"round {r + 1:3d} | {cells}", flush=True)
    # The backends may add a gradient's terms in different orders: ulps, not more (the tests
    # hold tpu and gloo to rtol 1e-6 for the same reason).
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["tpu"], losses["gloo"]))
    same = worst <= 1e-6
    if rank == 0:
        med = {n: statistics.median(t) for n, t in times.items()}
        tokens = args.batch_size * args.seq_len
        for n, t in times.items():
            print(f"# {n:5s} median step {med[n] * 1e3:8.2f} ms  +-{_spread(t):4.0%}  "
                  f"{tokens / med[n]:8.0f} tokens/s", flush=True)
        print(f"# step time tpu/gloo: {med['tpu'] / med['gloo']:.3f}", flush=True)
        print(f"# losses on tpu and gloo {'agree' if same else 'DIFFER'}: largest relative "
              f"difference {worst:.1e} over {len(losses['tpu'])} steps (last loss "
              f"{losses['tpu'][-1]:.6f})", flush=True)
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
