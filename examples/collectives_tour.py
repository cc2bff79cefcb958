"""A tour of the "tpu" backend: the collectives a training step uses, checked as it goes.

Run it on 4 CPU-emulated ranks (each rank owns one XLA CPU device)::

    tpu-launch --nproc-per-node 4 examples/collectives_tour.py
    torchrun --nproc-per-node 4 examples/collectives_tour.py      # works the same

Every rank prints what it did; the script raises if any result is wrong, and
rank 0's last line says so.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import tpu_dist  # noqa: F401  (registers the "tpu" backend)
from tpu_dist.collectives import compile_count


def main() -> None:
    dist.init_process_group("tpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(f"[tour] rank {rank}/{world}:", *a, flush=True))

    # DDP: average gradients.
    grad = torch.full((1024,), float(rank))
    dist.all_reduce(grad, op=dist.ReduceOp.AVG)
    expected = sum(range(world)) / world
    assert torch.allclose(grad, torch.full_like(grad, expected)), grad[:4]
    log(f"all_reduce AVG -> {grad[0].item():.2f} (expected {expected:.2f})")

    # FSDP2: gather parameter shards, reduce-scatter gradients.
    shard = torch.arange(4, dtype=torch.bfloat16) + 4 * rank
    full = torch.empty(4 * world, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(full, shard)
    assert torch.equal(full, torch.arange(4 * world, dtype=torch.bfloat16)), full
    grad_shard = torch.empty(4)
    dist.reduce_scatter_tensor(grad_shard, torch.ones(4 * world))
    assert torch.all(grad_shard == world), grad_shard
    log(f"all_gather_into_tensor -> {full.tolist()}; reduce_scatter_tensor -> {grad_shard.tolist()}")

    # int64 stays exact beyond 32 bits.
    big = torch.tensor([2**40 + rank], dtype=torch.int64)
    dist.all_reduce(big)
    assert big.item() == world * 2**40 + sum(range(world)), big
    log(f"all_reduce int64 -> {big.item()}")

    # Expert parallelism: uneven all_to_all.
    send_splits = [(rank + peer) % 2 + 1 for peer in range(world)]
    recv_splits = [(peer + rank) % 2 + 1 for peer in range(world)]
    received = torch.empty(sum(recv_splits))
    dist.all_to_all_single(received, torch.full((sum(send_splits),), float(rank)), recv_splits, send_splits)
    want = torch.cat([torch.full((n,), float(peer)) for peer, n in enumerate(recv_splits)])
    assert torch.equal(received, want), received
    log(f"all_to_all_single uneven -> {received.tolist()}")

    # Pipeline parallelism: a ring of sends and receives.
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert got[0].item() == (rank - 1) % world, got
    log(f"batch_isend_irecv ring -> received {got.tolist()} from rank {(rank - 1) % world}")

    # Steady state: a repeated step compiles nothing new.
    before = compile_count()
    start = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
    per_call_ms = (time.perf_counter() - start) / 20 * 1e3
    assert compile_count() == before, (before, compile_count())
    log(f"20 more all_reduces: {per_call_ms:.2f} ms each, {compile_count()} programs compiled in all")

    dist.barrier()
    if rank == 0:
        print(f"[tour] all collectives correct on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
