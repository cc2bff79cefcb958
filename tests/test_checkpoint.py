"""Distributed checkpointing of an FSDP2 model and its optimizer on the "tpu" backend.

4 ranks, FSDP2 over all of them (each parameter Shard(0) over ranks 0..3). The run:

1. an uninterrupted run: steps 1..4;
2. a run that trains steps 1..2 and saves model and optimizer state with
   ``torch.distributed.checkpoint`` (DCP) at step 2;
3. the worker processes are restarted (a new JAX runtime, a new process group);
4. a run that builds the model from another seed, loads the checkpoint and trains steps 3..4.

The continued run must match the uninterrupted one exactly (bit for bit): the same
collective programs add the same numbers in the same order, so anything short of equality
means state was lost or changed (optimizer moments, step counts, a shard on the wrong rank).
The checkpoint's content is also read back in the test process, without any process group,
and compared with the full parameters at step 2.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.harness import World

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _train_fsdp():
    if "train_fsdp" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_fsdp", _EXAMPLES / "train_fsdp.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_fsdp"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_fsdp"]


BATCH, SEQ, LR = 8, 16, 1e-3


def _setup(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ex = _train_fsdp()
    config = ex.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16)
    torch.manual_seed(seed)
    model = ex.Decoder(config)
    mesh = init_device_mesh("cpu", (4,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, optimizer


def _steps(rank: int, model, optimizer, first: int, last: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        rows = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g).chunk(4)[rank]
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / 4)
    return losses


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _uninterrupted(rank: int, world_size: int) -> dict:
    model, optimizer = _setup(seed=0)
    losses = _steps(rank, model, optimizer, 1, 4)
    return {"losses": losses, "params": _full(model)}


def _train_and_save(rank: int, world_size: int, path: str) -> dict:
    ex = _train_fsdp()
    model, optimizer = _setup(seed=0)
    losses = _steps(rank, model, optimizer, 1, 2)
    ex.save_checkpoint(path, model, optimizer, step=2)
    return {"losses": losses, "params": _full(model)}


def _load_and_continue(rank: int, world_size: int, path: str) -> dict:
    import tpu_dist.collectives

    ex = _train_fsdp()
    model, optimizer = _setup(seed=1)  # other initial weights: the checkpoint must replace them
    step = ex.load_checkpoint(path, model, optimizer)
    adam_steps = {float(s["step"]) for s in optimizer.state.values()}
    losses = _steps(rank, model, optimizer, step + 1, 4)
    return {
        "step": step,
        "adam_steps": sorted(adam_steps),
        "losses": losses,
        "params": _full(model),
        "backend": type(torch.distributed.distributed_c10d._get_default_group()).__name__,
        "is_tpu": isinstance(
            torch.distributed.distributed_c10d._get_default_group(), tpu_dist.collectives.ProcessGroupTPU
        ),
    }


@pytest.fixture(scope="module")
def world() -> World:
    with World(4, backend="tpu", timeout=240.0) as w:
        yield w


def test_save_restart_load_continue_matches_uninterrupted(world: World, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "step2")
    whole = world.run(_uninterrupted)
    first = world.run(_train_and_save, path)
    pids = world.pids
    world.restart()
    assert not set(pids) & set(world.pids)  # new processes
    second = world.run(_load_and_continue, path)

    for r in range(4):
        assert second[r]["step"] == 2 and second[r]["adam_steps"] == [2.0]
        assert second[r]["is_tpu"], second[r]["backend"]
    assert first[0]["losses"] == whole[0]["losses"][:2]
    assert first[0]["losses"] + second[0]["losses"] == whole[0]["losses"]
    for name, value in whole[0]["params"].items():
        assert torch.equal(second[0]["params"][name], value), name
    assert whole[0]["losses"][-1] < whole[0]["losses"][0]

    # The checkpoint read back in this process, without a process group: the step-2 weights.
    dcp_to_torch_save(path, str(tmp_path / "step2.pt"))
    saved = torch.load(tmp_path / "step2.pt", weights_only=False)
    assert int(saved["step"]) == 2
    for name, value in first[0]["params"].items():
        assert torch.equal(saved["model"][name], value), name
    assert any(k.startswith("optim") for k in saved)
