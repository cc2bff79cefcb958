"""A tour of the "tpu" backend: every collective of its support table, each checked.

(The support table is in docs/reference/backend.md.)

Every rank computes, from its own rank and the world size alone, what each collective must
give it, and raises if the result differs; rank 0 prints one line per collective (what it
got) and, last, ``every check passed on all W ranks (BACKEND): ...``. The program
is plain ``torch.distributed``: ``--backend gloo`` runs the very same calls on torch's CPU
backend. Run it on 4 CPU-emulated ranks (each rank owns one XLA CPU device)::

    tpu-launch --nproc-per-node 4 examples/collectives_tour.py
    torchrun --nproc-per-node 4 examples/collectives_tour.py
    torchrun --nproc-per-node 4 examples/collectives_tour.py --backend gloo

It uses torch 2.13's names: ``all_gather_single`` and ``reduce_scatter_single`` (the old
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` still work, with a FutureWarning).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import tpu_dist  # noqa: F401  (registers the "tpu" backend)


SHOWN_MAX = 16
"""Lists longer than this (results at a world of hundreds of ranks) are printed abridged."""


def abridged(value: object) -> object:
    """``value``, or for a list longer than :data:`SHOWN_MAX` its first and last items and length."""
    if isinstance(value, list) and len(value) > SHOWN_MAX:
        head, tail = ", ".join(map(str, value[:4])), ", ".join(map(str, value[-2:]))
        return f"[{head}, ..., {tail}] ({len(value)} values)"
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="tpu", help="c10d backend (default: tpu; gloo works too)")
    args = parser.parse_args(argv)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    checked: list[str] = []

    def check(name: str, got: object, want: object, shown: object = None) -> None:
        """Raise on this rank if ``got != want``; rank 0 prints what it got."""
        same = torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
        if not same:
            raise RuntimeError(f"rank {rank}: {name} gave {got!r}, expected {want!r}")
        checked.append(name)
        if rank == 0:
            value = got.tolist() if isinstance(got, torch.Tensor) else got
            print(f"[tour] {name:<28} -> {abridged(value) if shown is None else shown}", flush=True)

    ranks = torch.arange(world, dtype=torch.float32)

    # DDP: sum gradients (all_reduce), and a max (e.g. a loss scaler's overflow check).
    grad = torch.full((4,), float(rank))
    dist.all_reduce(grad)
    check("all_reduce SUM", grad, torch.full((4,), ranks.sum().item()))
    top = torch.tensor([rank], dtype=torch.int32)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    check("all_reduce MAX int32", top, torch.tensor([world - 1], dtype=torch.int32))
    big = torch.tensor([2**40 + rank], dtype=torch.int64)  # int64 stays exact beyond 32 bits
    dist.all_reduce(big)
    check("all_reduce int64", big, torch.tensor([world * 2**40 + sum(range(world))]))

    # FSDP2: gather parameter shards, reduce-scatter gradients.
    shard = torch.arange(2, dtype=torch.bfloat16) + 2 * rank
    full = torch.empty(2 * world, dtype=torch.bfloat16)
    dist.all_gather_single(full, shard)
    check("all_gather_single bf16", full, torch.arange(2 * world, dtype=torch.bfloat16))
    pieces = [torch.empty(1) for _ in range(world)]
    dist.all_gather(pieces, torch.tensor([10.0 * rank]))
    check("all_gather (list)", torch.cat(pieces), 10 * ranks)
    grad_shard = torch.empty(2)
    dist.reduce_scatter_single(grad_shard, torch.arange(2 * world, dtype=torch.float32))
    check("reduce_scatter_single", grad_shard, world * torch.tensor([2.0 * rank, 2.0 * rank + 1]))
    out = torch.empty(1)
    dist.reduce_scatter(out, [torch.tensor([float(rank * peer)]) for peer in range(world)])
    check("reduce_scatter (list)", out, torch.tensor([rank * ranks.sum().item()]))

    # Rooted collectives: broadcast, scatter, gather, reduce (root: the last rank or rank 0).
    root = world - 1
    weights = torch.full((3,), float(rank))
    dist.broadcast(weights, src=root)
    check(f"broadcast from {root}", weights, torch.full((3,), float(root)))
    part = torch.empty(2)
    dist.scatter(part, [torch.full((2,), 100.0 + peer) for peer in range(world)] if rank == 0 else None, src=0)
    check("scatter from 0", part, torch.full((2,), 100.0 + rank))
    gathered = [torch.empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([rank * rank], dtype=torch.float32), gathered, dst=0)
    if rank == 0:
        check("gather to 0", torch.cat(gathered), ranks * ranks)
    total = torch.tensor([float(rank + 1)])
    dist.reduce(total, dst=0, op=dist.ReduceOp.PRODUCT)
    if rank == 0:  # other ranks' tensors are unspecified after a reduce
        check("reduce PRODUCT to 0", total, torch.tensor([float(torch.arange(1, world + 1).prod())]))

    # Expert parallelism: uneven all_to_all, single tensor and list of tensors.
    send_splits = [(rank + peer) % 2 + 1 for peer in range(world)]  # symmetric: recv = send
    received = torch.empty(sum(send_splits))
    dist.all_to_all_single(received, torch.full((sum(send_splits),), float(rank)), send_splits, send_splits)
    want = torch.cat([torch.full((n,), float(peer)) for peer, n in enumerate(send_splits)])
    check("all_to_all_single uneven", received, want)
    # The list form with equal chunks: gloo refuses uneven ones here ("tpu" takes them too).
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * rank + peer)) for peer in range(world)])
    check("all_to_all (list)", torch.cat(outs),
          torch.cat([torch.full((2,), float(10 * peer + rank)) for peer in range(world)]))

    # Pipeline parallelism: a ring of sends and receives; then blocking pairs (0->1, 2->3, ...).
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    check("batch_isend_irecv ring", got, torch.full((2,), float((rank - 1) % world)))
    if world % 2 == 0:
        if rank % 2 == 0:
            dist.send(torch.tensor([rank * 7.0]), dst=rank + 1)
        else:
            msg = torch.empty(1)
            dist.recv(msg, src=rank - 1)
            check("send/recv pairs", msg, torch.tensor([(rank - 1) * 7.0]))
        if rank == 0:  # a sender: the receiving odd ranks check
            print(f"[tour] {'send/recv pairs':<28} -> sent [0.0] to rank 1 (each odd rank checks)", flush=True)

    # Object collectives (pickled Python objects).
    objects: list[object] = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    check("all_gather_object", objects, [{"rank": peer} for peer in range(world)])
    box = [f"config from {root}" if rank == root else None]
    dist.broadcast_object_list(box, src=root)
    check("broadcast_object_list", box, [f"config from {root}"])
    inbox = [None] * world if rank == 0 else None
    dist.gather_object(("done", rank), inbox, dst=0)
    if rank == 0:
        check("gather_object to 0", inbox, [("done", peer) for peer in range(world)])
    mine: list[object] = [None]
    dist.scatter_object_list(mine, [f"task {peer}" for peer in range(world)] if rank == 0 else None, src=0)
    check("scatter_object_list", mine, [f"task {rank}"])

    # Subgroups: every rank creates both groups (new_group is collective), then uses its own.
    evens, odds = list(range(0, world, 2)), list(range(1, world, 2))
    groups = {0: dist.new_group(evens), 1: dist.new_group(odds) if odds else None}
    members = evens if rank % 2 == 0 else odds
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=groups[rank % 2])
    check("all_reduce in subgroup", value, torch.tensor([float(sum(members))]), shown=f"{value.tolist()} (ranks {abridged(members)})")

    # Async: the call returns at once, wait() finishes it.
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    handle = torch.full((2,), float(rank))
    dist.all_reduce(handle, async_op=True).wait()
    check("all_reduce async_op=True", handle, torch.full((2,), ranks.sum().item()))

    dist.barrier()

    if dist.get_backend() == "tpu":  # a repeated step compiles nothing new
        from tpu_dist.collectives import compile_count

        before = compile_count()
        start = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(grad)
        per_call_ms = (time.perf_counter() - start) / 20 * 1e3
        if compile_count() != before:
            raise RuntimeError(f"rank {rank}: 20 repeated all_reduces compiled {compile_count() - before} programs")
        if rank == 0:
            print(f"[tour] 20 repeated all_reduces: {per_call_ms:.2f} ms each, no new program "
                  f"({compile_count()} compiled in all)", flush=True)

    # Every rank reports how many checks it passed (a rank that failed one raised instead).
    counts = [None] * world
    dist.all_gather_object(counts, len(checked))
    if rank == 0:
        print(f"[tour] every check passed on all {world} ranks ({dist.get_backend()}): "
              f"checks per rank {abridged(counts)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
