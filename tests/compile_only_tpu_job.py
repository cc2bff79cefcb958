"""A small job written for TorchTPU, for tests/test_compile_only.py: tensors on ``"tpu"``.

As a TorchTPU script is written: the device ``"tpu:LOCAL_RANK"``, ``torch.tpu.set_device``,
``init_process_group()`` with no backend (torch's device map picks the one for the accelerator),
a torch ``DeviceMesh`` on ``"tpu"``, FSDP2 x TP, two optimizer steps, a few c10d collectives,
then the group again from ``"cpu:gloo,tpu:tpu"`` and from ``"tpu"``. With ``--device cpu`` it is
the same job on CPU tensors (the "tpu" backend named, as tpu_dist's CPU scripts do): under
``tpu-launch --compile-only`` both must record the same collectives, sizes, memory and step.

With ``--facts FILE`` (the "tpu" run) it writes what the job saw of ``torch.tpu`` and of torch
as JSON, for the test to check against TorchTPU 0.2.0's behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_fsdp import Decoder, ModelConfig  # noqa: E402
from train_fsdp_tp import apply_tensor_parallel  # noqa: E402


def _error(call) -> str | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 (the message is the fact)
        return f"{type(err).__name__}: {err}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("tpu", "cpu"), default="tpu")
    parser.add_argument("--facts", default=None)
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    facts: dict = {}
    if args.device == "tpu":
        device = torch.device("tpu", local)
        torch.tpu.set_device(device)
        facts["available_device_type"] = torch._utils._get_available_device_type()
        facts["accelerator"] = str(torch.accelerator.current_accelerator())
        dist.init_process_group()  # no backend: torch's map for its accelerator
    else:
        device = torch.device("cpu")
        dist.init_process_group("tpu")
    facts["backend_config"] = str(dist.get_backend_config())
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)
    # ffn 256 x 512: the weights are over the 65,536 elements compile-only makes fake on CPU.
    model = Decoder(ModelConfig(vocab_size=64, dim=256, n_layers=1, n_heads=4, ffn_hidden=512,
                                max_seq_len=16)).to(device)
    apply_tensor_parallel(model, mesh["tp"], parallel_loss=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (2, 16), device=device)
    for _ in range(2):
        model(tokens).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    # c10d collectives on the device's tensors; object collectives on the CPU.
    loss = torch.ones(1, device=device)
    dist.all_reduce(loss)
    gathered = torch.empty(world, 8, device=device)
    dist.all_gather_into_tensor(gathered, torch.arange(8.0, device=device))
    dist.broadcast(torch.zeros(6, device=device), src=0)
    dist.all_to_all_single(torch.empty(world * 2, device=device),
                           torch.arange(world * 2.0, device=device), group=mesh.get_group("tp"))
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": dist.get_rank()})
    dist.barrier()
    dist.destroy_process_group()

    # The group again, from the per-device configs frameworks build (TorchTitan: "tpu:<its
    # backend>,cpu:gloo"), and from the name.
    for backend in ("cpu:gloo,tpu:tpu", "tpu:tpu,cpu:gloo", "tpu"):
        dist.init_process_group(backend if args.device == "tpu" else "tpu")
        dist.all_reduce(torch.ones(100, device=device))
        facts.setdefault("configs", []).append(str(dist.get_backend_config()))
        dist.destroy_process_group()

    facts["optimizer_params"] = len(list(model.parameters()))
    if args.device == "cpu":
        if args.facts:
            with open(args.facts, "w") as f:
                json.dump(facts, f)
        return
    if args.facts:
        tpu = torch.tpu
        props = tpu.get_device_properties()
        facts.update(
            is_available=tpu.is_available(),
            device_count=tpu.device_count(),
            current_device=tpu.current_device(),
            device_name=tpu.get_device_name(),
            properties=[props.name, props.total_memory, props.multi_processor_count],
            set_same=_error(lambda: tpu.set_device(local)),
            set_other=_error(lambda: tpu.set_device((local + 1) % tpu.device_count())),
            set_cuda=_error(lambda: tpu.set_device(torch.device("cuda", 0))),
            synchronize=_error(tpu.synchronize),
            memory_stats=tpu.memory_stats(),
            max_memory_allocated=tpu.max_memory_allocated(),
            amp_dtypes=len(tpu.get_amp_supported_dtype()),
            rng_state=list(tpu.get_rng_state().shape),
            tensor_is_tpu=torch.ones(2, device=device).is_tpu,
            import_torch_tpu=_error(lambda: __import__("torch_tpu")),
            emulated=getattr(tpu, "emulated", False),
            not_emulated=_error(lambda: tpu.ops),
        )
        tpu.reset_peak_memory_stats()
        facts["peak_after_reset"] = tpu.max_memory_allocated()
        with open(args.facts, "w") as f:
            json.dump(facts, f)


if __name__ == "__main__":
    main()
