"""TorchTitan's mesh for FSDP2 x TP, for tests/test_compile_only.py: torch's own
``init_device_mesh`` over (dp_shard, cp, tp) with cp = 1, FSDP2 over the flattened
``dp_shard_cp`` dimension (the same ranks as dp_shard), the loss averaged over the flattened
``dp_cp``, and ``tpu_dist.mesh.register_mesh`` once the dimensions are flattened.

Under ``tpu-launch --emulate v5e:2x4 --compile-only`` every group is part of the v5e slice, so
every program compiles only as its family's (the flattened dimensions' too).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_fsdp import Decoder, ModelConfig  # noqa: E402
from train_fsdp_tp import apply_tensor_parallel  # noqa: E402

import tpu_dist  # noqa: E402,F401
from tpu_dist.mesh import register_mesh  # noqa: E402


def main() -> None:
    dist.init_process_group("tpu")
    tp = 4
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size() // tp, 1, tp), mesh_dim_names=("dp_shard", "cp", "tp")
    )
    dp_shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = mesh["dp_shard", "cp"]._flatten("dp_cp")
    register_mesh(mesh)
    torch.manual_seed(0)
    config = ModelConfig(max_seq_len=16)
    model = Decoder(config)
    apply_tensor_parallel(model, mesh["tp"], parallel_loss=False)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_shard_cp)
    fully_shard(model, mesh=dp_shard_cp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (1, config.max_seq_len + 1))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, config.vocab_size), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    optimizer.step()
    reported = loss.detach().clone()
    dist.all_reduce(reported, op=dist.ReduceOp.AVG, group=dp_cp.get_group())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
