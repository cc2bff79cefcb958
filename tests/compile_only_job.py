"""A small job for tests/test_compile_only.py: FSDP2 x TP, DDP, p2p and object collectives.

Run under ``tpu-launch --compile-only`` (backend "tpu": recorded, compiled for TPU) and under
``tpu-launch --nproc-per-node 4 ... --backend countgloo`` (real gloo, every process-group call
counted by a Python wrapper and written to ``--counts-dir``), so the test can check that the
recording sees exactly the calls gloo sees.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_fsdp import Decoder, ModelConfig  # noqa: E402
from train_fsdp_tp import apply_tensor_parallel  # noqa: E402

import tpu_dist  # noqa: E402,F401
from tpu_dist.mesh import init_device_mesh  # noqa: E402

# ProcessGroup method (what torch's Python trampoline calls) -> gloo's method of the same call.
_GLOO_METHODS = {
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "allgather": "allgather",
    "all_gather_single": "_allgather_base",
    "all_gather_single_coalesced": "_allgather_base",  # one call per pair (below)
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_single_coalesced": "_reduce_scatter_base",  # one call per pair
    "all_to_all_single": "alltoall_base",
    "alltoall": "alltoall",
    "broadcast": "broadcast",
    "scatter": "scatter",
    "gather": "gather",
    "reduce": "reduce",
    "send": "send",
    "recv": "recv",
    "barrier": "barrier",
}
_calls: list[dict] = []


def _input_bytes(method: str, args: tuple) -> int:
    """Bytes this rank passes into the call (its input tensors)."""
    if method in ("all_gather_single", "reduce_scatter_single"):
        tensors = [args[1]]
    elif method in ("all_gather_single_coalesced", "reduce_scatter_single_coalesced"):
        tensors = list(args[1])
    elif method in ("allgather", "reduce_scatter", "gather", "scatter"):
        tensors = args[1]
        tensors = [t for sub in tensors for t in sub] if tensors and isinstance(
            tensors[0], list) else list(tensors)
    elif method == "all_to_all_single":
        tensors = [args[1]]
    elif method == "alltoall":
        tensors = list(args[1])
    elif method == "barrier":
        tensors = []
    else:
        tensors = list(args[0])
    return sum(t.numel() * t.element_size() for t in tensors)


class CountingGloo(dist.ProcessGroup):
    """A real gloo group behind a Python ProcessGroup that logs every call it forwards."""

    def __init__(self, store, rank, size, timeout, global_ranks):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._ranks = global_ranks
        self._name = ""

    def getBackendName(self):  # noqa: N802
        return "countgloo"

    def setGroupName(self, name):  # noqa: N802
        self._name = name

    def getGroupName(self):  # noqa: N802
        return self._name


def _forwarder(method: str, target: str):
    def call(self, *args, **kwargs):
        _calls.append({"method": method, "ranks": self._ranks,
                       "bytes": _input_bytes(method, args)})
        forward = getattr(self._gloo, target)
        if method.endswith("_coalesced") and target.startswith("_"):
            # gloo's Python binding has no coalesced tensor ops: the pairs one by one.
            outputs, inputs, opts = args
            works = [forward(o, i, opts) for o, i in zip(outputs, inputs)]
            for work in works[:-1]:
                work.wait()
            return works[-1]
        return forward(*args, **kwargs)

    call.__name__ = method
    return call


for _method, _target in _GLOO_METHODS.items():
    setattr(CountingGloo, _method, _forwarder(_method, _target))


def _create_counting_gloo(opts, backend_opts):
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    return CountingGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout, ranks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="tpu")
    parser.add_argument("--counts-dir", default=None)
    parser.add_argument("--dcn", action="store_true", help="dp crosses slices (2 slices)")
    parser.add_argument("--too-big", action="store_true",
                        help="also an all_reduce of 9 GiB per rank (input and output do not fit "
                        "a v5e's 16 GiB of HBM)")
    parser.add_argument("--partial-slices", action="store_true",
                        help="also an all_reduce over the first two of the topology's slices "
                        "(libtpu 0.0.52's compiler crashes on it)")
    args = parser.parse_args()
    if args.backend == "countgloo":
        dist.Backend.register_backend("countgloo", _create_counting_gloo, extended_api=True,
                                      devices=["cpu"])
    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.dcn:  # per slice (world / 4, 2), and the two slices stacked along dp
        mesh = init_device_mesh((world // 4, 2), ("dp", "tp"), dcn_mesh_shape=(2, 1))
    else:
        mesh = init_device_mesh((world // 2, 2), ("dp", "tp"))

    # FSDP2 over dp x TP over tp, one step (examples/train_fsdp_tp.py's plan).
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # ffn 256 x 512: the weights are over the 65,536 elements compile-only makes fake.
    model = Decoder(ModelConfig(vocab_size=64, dim=256, n_layers=1, n_heads=2, ffn_hidden=512,
                                max_seq_len=16))
    apply_tensor_parallel(model, mesh["tp"], parallel_loss=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens).float().pow(2).mean().backward()

    # DDP over the dp group.
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 8), process_group=mesh.get_group("dp"))
    ddp(torch.ones(4, 8)).sum().backward()

    # Object collectives, broadcast, p2p between rank pairs, all-to-all, barrier.
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank})
    dist.broadcast(torch.arange(6, dtype=torch.float32), src=0)
    dist.all_reduce(torch.ones(3, dtype=torch.complex128))  # no complex128 on TPU: sent as pairs
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(torch.ones(5), dst=peer, tag=3)
    else:
        dist.recv(torch.empty(5), src=peer, tag=3)
    out = torch.empty(8)
    dist.all_to_all_single(out, torch.arange(8, dtype=torch.float32), group=mesh.get_group("tp"))
    if args.partial_slices:
        half = dist.new_group(list(range(world // 2)))  # slices 0 and 1 of 4
        if rank < world // 2:
            dist.all_reduce(torch.ones(4), group=half)
    dist.barrier()
    if args.too_big:
        big = torch.empty((9 << 30) // 4)  # never written under --compile-only: address space
        dist.all_reduce(big, group=mesh.get_group("tp"))
    if args.counts_dir:
        with open(os.path.join(args.counts_dir, f"rank{rank}.json"), "w") as f:
            json.dump(_calls, f)
        # A normal run: no "tpu" device (compile-only mode's emulation stays there).
        with open(os.path.join(args.counts_dir, f"rank{rank}.device.json"), "w") as f:
            json.dump({
                "torch_tpu": hasattr(torch, "tpu"),
                "privateuse1": torch._C._get_privateuse1_backend_name(),
                "accelerator": str(torch._C._get_accelerator()),
                "tpu_in_device_map": "tpu" in dist.Backend.default_device_backend_map,
            }, f)
    dist.destroy_process_group()
    # Which process ran the job (tpu-launch --compile-only forks it from the launcher when it
    # can: the launcher's interpreter, not a new one) and with how many torch threads.
    fresh = "tpu_dist.launch._compile_only" in sys.orig_argv
    print(f"JOB pid={os.getpid()} ppid={os.getppid()} fresh={fresh} "
          f"torch_threads={torch.get_num_threads()} omp={os.environ.get('OMP_NUM_THREADS')}",
          flush=True)


if __name__ == "__main__":
    main()
