"""torch.compile over the "tpu" backend: compiled programs that communicate give gloo's numbers.

Two 2-rank worlds (one "tpu", one gloo), shared by the module's tests; each test runs the same
body in both and compares. Compilation (dynamo + inductor, C++ kernels) takes seconds per
graph, so the bodies are small and each compiles once.

1. funcol ``all_reduce`` + ``all_gather_tensor`` inside ``torch.compile(fullgraph=True)``:
   dynamo traces the functional collectives into the graph (no graph break), inductor lowers
   them to c10d calls on the group; the result must equal what every rank computes itself.
2. FSDP2 (``fully_shard``) of a small MLP under ``torch.compile``: three SGD steps on one
   batch per rank; the loss falls, and the losses and final parameters match gloo's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness import World

BACKENDS = ("tpu", "gloo")


def _world(worlds: Callable[..., World], backend: str) -> World:
    env = {"TPU_DIST_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"} if backend == "tpu" else {"OMP_NUM_THREADS": "1"}
    return worlds(2, backend, env=env, timeout=240.0)


def _funcol_compiled(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = funcol.all_reduce(x * 2, "sum", group)
        gathered = funcol.all_gather_tensor(summed + rank, 0, group)
        return gathered * 3, summed.sum()

    compiled = torch.compile(step, fullgraph=True)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    gathered, total = compiled(x)
    return {"gathered": gathered.tolist(), "total": total.item()}


def _expected_funcol(world_size: int) -> list[dict]:
    import torch

    xs = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(world_size)]
    summed = sum(2 * x for x in xs)
    gathered = torch.cat([summed + r for r in range(world_size)]) * 3
    return [{"gathered": gathered.tolist(), "total": summed.sum().item()} for _ in range(world_size)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_funcol_collectives_under_torch_compile_fullgraph(worlds: Callable[..., World], backend: str) -> None:
    assert _world(worlds, backend).run(_funcol_compiled) == _expected_funcol(2)


def _fsdp2_compiled(rank: int, world_size: int) -> dict:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    g = torch.Generator().manual_seed(100 + rank)  # one batch per rank, fitted three times
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    for _ in range(3):
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {name: p.full_tensor().flatten().tolist() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def test_fsdp2_under_torch_compile_matches_gloo(worlds: Callable[..., World]) -> None:
    tpu, gloo = (_world(worlds, b).run(_fsdp2_compiled) for b in BACKENDS)
    assert gloo[0]["losses"][2] < gloo[0]["losses"][0]  # it trains
    for rank in range(2):
        assert tpu[rank]["losses"] == pytest.approx(gloo[rank]["losses"], rel=1e-5)
        for name, value in gloo[rank]["params"].items():
            assert tpu[rank]["params"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
