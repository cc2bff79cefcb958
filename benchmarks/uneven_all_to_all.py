"""A mixture of experts' token exchange, "tpu" beside gloo: programs built, padding, time (issue 51).

Every call is an ``all_to_all_single`` of token rows with the split sizes a router would give:
each rank routes ``--tokens`` tokens to ``--top-k`` of ``--experts`` experts (the experts spread
evenly over the ranks), drawn from a generator seeded with the call number, the same on every
rank. ``--skew`` makes some experts hotter (expert ``e`` is chosen with weight
``(e + 1) ** -skew``: 0 is uniform routing; 1 is Zipf-like, the first expert about 3x the mean
with 8 experts). Every rank runs the same calls on a "tpu" group and on a gloo group of the
same ranks, alternating call by call, checks that the outputs are the same bits, and rank 0
prints:

* the median time of a call on each backend (the slower rank's, after ``--warmup`` calls of
  every size the run will see, so that no call builds a program) and the ratio;
* the programs the "tpu" calls built (the uneven all-to-all agrees on the widest chunk in one
  program, then exchanges every chunk padded to that width's size bucket in a second);
* the padding: what the padded exchange moves against the rows themselves, with the bucketed
  width and with the exact widest chunk (what the bucket adds to the padding), over every call.

With ``--exact`` the width is not bucketed (the backend's ``_plan_all_to_all.size_bucket`` is replaced by
the identity in this process, for the comparison only): every new width is a program, and the
time shows what the bucket's padding costs.

    tpu-launch --nproc-per-node 2 benchmarks/uneven_all_to_all.py
    tpu-launch --nproc-per-node 4 benchmarks/uneven_all_to_all.py --tokens 512 --dim 256 --skew 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import tpu_dist  # noqa: F401  (registers "tpu")
from tpu_dist.collectives import compile_count, _plan_all_to_all


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--warmup", type=int, default=1, help="untimed passes over the calls first")
    p.add_argument("--tokens", type=int, default=256, help="tokens a rank routes per call")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dim", type=int, default=256, help="floats per token row")
    p.add_argument("--skew", type=float, default=0.0)
    p.add_argument("--exact", action="store_true", help="no size buckets (for comparison)")
    return p.parse_args()


def _splits(call: int, args, world: int) -> torch.Tensor:
    """The (world, world) matrix of rows rank i sends rank j in call ``call``."""
    g = torch.Generator().manual_seed(10_000 + call)
    weights = (torch.arange(args.experts, dtype=torch.float64) + 1) ** -args.skew
    owner = torch.arange(args.experts) * world // args.experts
    rows = torch.zeros(world, world, dtype=torch.int64)
    for i in range(world):
        chosen = torch.multinomial(weights.expand(args.tokens, -1), args.top_k, generator=g)
        rows[i] = torch.bincount(owner[chosen.reshape(-1)], minlength=world)
    return rows


def main() -> None:
    args = _parse()
    if args.exact:
        _plan_all_to_all.size_bucket = lambda n: n  # this process only: the comparison without buckets
    dist.init_process_group("tpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    control = dist.new_group(backend="gloo")
    matrices = [_splits(c, args, world) for c in range(args.calls)]

    def call(c: int, group) -> tuple[float, torch.Tensor]:
        splits = matrices[c]
        send, recv = splits[rank].tolist(), splits[:, rank].tolist()
        x = torch.randn(sum(send), args.dim, generator=torch.Generator().manual_seed(c * 97 + rank))
        out = torch.empty(sum(recv), args.dim)
        dist.barrier(group=control)
        began = time.perf_counter()
        dist.all_to_all_single(out, x, recv, send, group=group)
        return time.perf_counter() - began, out

    built = compile_count()
    for _ in range(args.warmup):
        for c in range(args.calls):
            call(c, None)
            call(c, gloo)
    programs = compile_count() - built
    times = {"tpu": [], "gloo": []}
    for c in range(args.calls):
        order = ("tpu", "gloo") if c % 2 == 0 else ("gloo", "tpu")
        outs = {}
        for name in order:
            seconds, outs[name] = call(c, None if name == "tpu" else gloo)
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
            times[name].append(slowest.item())
        if not torch.equal(outs["tpu"], outs["gloo"]):
            raise AssertionError(f"rank {rank}: call {c}: tpu's output differs from gloo's")
    if rank == 0:
        data = padded = exact = 0
        for splits in matrices:
            rows = int(splits.sum())
            widest = int(splits.max()) * args.dim  # words (float32)
            data += rows * args.dim
            padded += world * world * _plan_all_to_all.size_bucket(widest)
            exact += world * world * widest
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        print(f"# {args.calls} all_to_all_singles on {world} ranks: {args.tokens} tokens x top "
              f"{args.top_k} of {args.experts} experts, {args.dim} floats a row, skew "
              f"{args.skew:g}{', exact widths' if args.exact else ''}")
        print(f"# programs built by the tpu calls: {programs} (the agreement and "
              f"{programs - 1} widths)")
        print(f"# padded exchange / rows moved: {padded / data:.3f} (exact widest chunk: "
              f"{exact / data:.3f}; the bucket adds {padded / exact - 1:.1%})")
        print(f"# median call, slower rank: tpu {med['tpu']:.3f} ms, gloo {med['gloo']:.3f} ms, "
              f"tpu/gloo {med['tpu'] / med['gloo']:.3f}")
        print("# outputs: tpu's equal gloo's bit for bit in every call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
