"""FSDP2, HSDP, TP, FSDP2 + TP, DDP and DCP, unchanged, on "tpu" vs "gloo" vs one process.

Every body trains the Llama-style decoder of ``examples/train_fsdp.py`` (a tiny config) for
a few AdamW steps on 4 ranks and returns the global loss of each step and the final full
parameters. The same body runs in a "tpu" world and in a "gloo" world, and the test process
computes the single-process reference: the same initial weights (seeded), the same global
batches, and the data-parallel gradient written out (the mean of the per-rank losses).

Meshes (4 ranks):
    FSDP2, DDP           1-D over ranks 0..3
    HSDP                 (replicate=2, shard=2): shard groups {0, 1} {2, 3}, replicate {0, 2} {1, 3}
    TP                   1-D tp over ranks 0..3, every rank sees the whole batch
    FSDP2 + TP           tpu_dist.mesh.init_device_mesh((2, 2), ("dp", "tp")): on the default
                         4-rank topology (v5p 2x2x1) tp groups {0, 1} {2, 3}, dp {0, 2} {1, 3}

Distributed checkpointing (the last test, which restarts the "tpu" world): an uninterrupted
FSDP2 run of steps 1..4; a run of steps 1..2 that saves model and optimizer with
``torch.distributed.checkpoint`` (DCP); new worker processes (a new JAX runtime and process
group) that build the model from another seed, load, and train steps 3..4. The continued run
must match the uninterrupted one bit for bit: the same collective programs add the same
numbers in the same order, so anything short of equality means state was lost or changed
(optimizer moments, step counts, a shard on the wrong rank). The checkpoint is also read back
in the test process, without a process group, and compared with the weights at step 2.

Tolerances. A data-parallel gradient is a sum over ranks; "tpu" (XLA's CPU collectives) and
gloo may add the 4 terms in a different order, and the single process adds them in a third
(and computes the full-batch matmuls as one). In fp32 that moves a gradient by a few ulps
(~1e-7 relative); AdamW's first steps move each weight by about ``lr * sign(grad)``, so such
differences stay at the ulp level of the weights unless a gradient is within rounding noise
of zero. Measured (3 steps; the tests run 2: the second step already uses the optimizer state
and the resharded weights of the first, and each step costs ~0.3 CPU-s a rank, ~25% of the
module): the losses on "tpu" and gloo are identical, the weights differ by
at most 7.5e-7 (TP); against one process, losses by 1.2e-7 relative and weights by 1.6e-6
(TP, where the sharded matmuls split the contractions differently). Losses are compared with
rtol 1e-6 and weights with atol 1e-5 (lr is 1e-3): a margin of 6-9x over what was seen, and
far below the effect of a real error (a wrong or missing reduction moves a loss in the third
digit and a weight by ~lr). bf16 mixed precision computes the same bf16 operations in every
run (FSDP2 all-gathers bf16 copies of the same fp32 weights and reduces in fp32), so the same
tolerances hold (measured: weights equal bit for bit).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import World

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


train_fsdp = _load("train_fsdp")

CONFIG = train_fsdp.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16)
BATCH, SEQ, STEPS, LR = 8, 16, 2, 1e-3
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return train_fsdp.Decoder(CONFIG)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- the single-process reference ------------------------------------------------------------


def _reference(dp: int, *, accumulate: int = 1, bf16: bool = False) -> dict:
    """Data parallelism over ``dp`` ranks written out in one process."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(1, STEPS + 1):
        inputs, targets = _batch(step)
        compute = copy.deepcopy(model).to(torch.bfloat16) if bf16 else model
        grads = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
        total = 0.0
        for x, y in zip(inputs.chunk(dp), targets.chunk(dp)):
            compute.zero_grad()
            for mx, my in zip(x.chunk(accumulate), y.chunk(accumulate)):
                loss = _loss(compute(mx), my) / accumulate
                loss.backward()
                total += loss.item()
            for g, p in zip(grads, compute.parameters()):
                g += p.grad.float()
        for g, p in zip(grads, model.parameters()):
            p.grad = g / dp
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / dp)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- bodies ----------------------------------------------------------------------------------


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("module.", "")] = full.detach().float().clone()
    return out


def _global_loss(loss: torch.Tensor, group=None) -> float:
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    value = loss.detach().float().reshape(1).clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def _train(model, rank_rows, dp_rank, dp_size, group=None, *, accumulate=1, loss_context=None,
           no_sync=None) -> list[float]:
    import contextlib

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(1, STEPS + 1):
        inputs, targets = _batch(step)
        if rank_rows:
            inputs, targets = inputs.chunk(dp_size)[dp_rank], targets.chunk(dp_size)[dp_rank]
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.chunk(accumulate), targets.chunk(accumulate))):
            last = i == accumulate - 1
            sync = no_sync(last) if no_sync else contextlib.nullcontext()
            with sync, (loss_context() if loss_context else contextlib.nullcontext()):
                loss = _loss(model(x), y) / accumulate
                loss.backward()
            total = total + (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_loss(total, group))
    return losses


def _fsdp(rank: int, world_size: int, variant: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if variant == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    kwargs = {"mesh": mesh, "reshard_after_forward": variant != "no_reshard"}
    if variant == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model()
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    accumulate, no_sync = 1, None
    if variant == "accumulate":
        # two micro-batches; the first accumulates unsharded gradients without communicating
        accumulate = 2

        def no_sync(last: bool):
            import contextlib

            model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()

    losses = _train(model, True, rank, world_size, accumulate=accumulate, no_sync=no_sync)
    placements = {str(p.placements) for p in model.parameters()}
    params = _full_params(model)
    return {"losses": losses, "params": params if rank == 0 else None, "placements": sorted(placements)}


def _tp(rank: int, world_size: int, with_fsdp: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from tpu_dist.mesh import init_device_mesh

    train_fsdp_tp = _load("train_fsdp_tp")
    model = _model()
    if with_fsdp:
        mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        train_fsdp_tp.apply_tensor_parallel(model, mesh["tp"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp_size, group = mesh.get_local_rank("dp"), 2, mesh.get_group("dp")
    else:
        mesh = torch_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        train_fsdp_tp.apply_tensor_parallel(model, mesh)
        dp_rank, dp_size, group = 0, 1, None
    # TP alone: every rank trains on the whole batch
    losses = _train(model, with_fsdp, dp_rank, dp_size, group, loss_context=loss_parallel)
    placements = sorted({str(p.placements) for p in model.parameters()})
    params = _full_params(model)
    return {"losses": losses, "params": params if rank == 0 else None, "placements": placements}


def _ddp(rank: int, world_size: int, variant: str) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    # ~3 KB buckets: the 2-layer model's gradients travel in many buckets
    ddp = DDP(model, bucket_cap_mb=0.003)
    calls = []  # gradients per bucket, one entry per hook call
    if variant == "hook":
        def hook(state, bucket):
            calls.append(len(bucket.gradients()))
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, hook)
    elif variant == "fp16_hook":
        # (bf16_compress_hook is refused off CUDA/XPU by DDP itself, on every backend)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    accumulate = 2 if variant == "no_sync" else 1

    def no_sync(last: bool):
        import contextlib

        return contextlib.nullcontext() if last else ddp.no_sync()

    losses = _train(ddp, True, rank, world_size, accumulate=accumulate, no_sync=no_sync)
    return {
        "losses": losses,
        "params": _full_params(model) if rank == 0 else None,
        "hook_calls": len(calls),
        "hooked_gradients": sum(calls),
        "parameters": len(list(model.parameters())),
    }


# -- worlds and tests ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tpu() -> World:
    with World(4, backend="tpu", timeout=240.0) as w:
        yield w


@pytest.fixture(scope="module")
def gloo() -> World:
    with World(4, backend="gloo", timeout=240.0) as w:
        yield w


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_RTOL), f"{what}: losses"
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        err = (got["params"][name] - value).abs().max().item()
        assert err <= PARAM_ATOL, f"{what}: {name} differs by {err}"


def _run_both(tpu: World, gloo: World, body, *args) -> tuple[dict, dict]:
    on_tpu = tpu.run(body, *args)
    on_gloo = gloo.run(body, *args)
    for results in (on_tpu, on_gloo):
        assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"
    return on_tpu[0], on_gloo[0]


@pytest.mark.parametrize(
    ("variant", "reference"),
    [
        ("fp32", {"dp": 4}),
        ("no_reshard", {"dp": 4}),
        ("bf16", {"dp": 4, "bf16": True}),
        ("accumulate", {"dp": 4, "accumulate": 2}),
        ("hsdp", {"dp": 4}),
    ],
)
def test_fsdp2(tpu: World, gloo: World, variant: str, reference: dict) -> None:
    on_tpu, on_gloo = _run_both(tpu, gloo, _fsdp, variant)
    want = _reference(**reference)
    _assert_close(on_tpu, on_gloo, f"{variant}: tpu vs gloo")
    _assert_close(on_tpu, want, f"{variant}: tpu vs one process")
    # It trains: AdamW's first step moves every weight by about lr (each step draws a new
    # batch, so two steps' losses need not fall).
    initial = dict(_model().named_parameters())
    for name, value in want["params"].items():
        assert (value - initial[name]).abs().max().item() > LR / 2, name
    if variant == "hsdp":
        assert on_tpu["placements"] == ["(Replicate(), Shard(dim=0))"]
    else:
        assert on_tpu["placements"] == ["(Shard(dim=0),)"]


@pytest.mark.parametrize("with_fsdp", [False, True], ids=["tp", "fsdp_tp"])
def test_tensor_parallel(tpu: World, gloo: World, with_fsdp: bool) -> None:
    on_tpu, on_gloo = _run_both(tpu, gloo, _tp, with_fsdp)
    want = _reference(dp=2 if with_fsdp else 1)
    _assert_close(on_tpu, on_gloo, "tpu vs gloo")
    _assert_close(on_tpu, want, "tpu vs one process")
    if with_fsdp:  # FSDP2 over TP: dim 0 split by tp, then by dp
        assert any("_StridedShard" in p or "_S(" in p for p in on_tpu["placements"]), on_tpu["placements"]
    else:
        assert "(Shard(dim=0),)" in on_tpu["placements"] and "(Shard(dim=1),)" in on_tpu["placements"]


@pytest.mark.parametrize("variant", ["plain", "no_sync", "hook", "fp16_hook"])
def test_ddp(tpu: World, gloo: World, variant: str) -> None:
    on_tpu, on_gloo = _run_both(tpu, gloo, _ddp, variant)
    if variant == "fp16_hook":
        # gradients travel as fp16 and are summed in fp16 by the collective, whose order of
        # summation is the backend's: agree with gloo to fp16 resolution (2^-11 relative) of
        # the gradients, which AdamW turns into at most ~lr changes of a weight whose
        # gradient is near zero; the losses of the first steps agree closely
        assert on_tpu["losses"] == pytest.approx(on_gloo["losses"], rel=1e-4)
        for name, value in on_gloo["params"].items():
            assert (on_tpu["params"][name] - value).abs().max().item() <= 2 * LR, name
        return
    want = _reference(dp=4, accumulate=2 if variant == "no_sync" else 1)
    _assert_close(on_tpu, on_gloo, f"{variant}: tpu vs gloo")
    _assert_close(on_tpu, want, f"{variant}: tpu vs one process")
    if variant == "hook":
        # every gradient went through the hook once per step, in several buckets
        assert on_tpu["hooked_gradients"] == on_tpu["parameters"] * STEPS
        assert on_tpu["hook_calls"] >= 2 * STEPS


# -- distributed checkpointing ---------------------------------------------------------------


def _fsdp_model_and_optimizer(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = train_fsdp.Decoder(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _dcp_steps(model, optimizer, first: int, last: int) -> list[float]:
    rank, size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, last + 1):
        inputs, targets = _batch(step)
        loss = _loss(model(inputs.chunk(size)[rank]), targets.chunk(size)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_loss(loss))
    return losses


def _dcp_uninterrupted(rank: int, world_size: int) -> dict:
    model, optimizer = _fsdp_model_and_optimizer(seed=0)
    losses = _dcp_steps(model, optimizer, 1, 4)
    return {"losses": losses, "params": _full_params(model)}


def _dcp_train_and_save(rank: int, world_size: int, path: str) -> dict:
    model, optimizer = _fsdp_model_and_optimizer(seed=0)
    losses = _dcp_steps(model, optimizer, 1, 2)
    train_fsdp.save_checkpoint(path, model, optimizer, step=2)  # dcp.save of get_state_dict
    return {"losses": losses, "params": _full_params(model)}


def _dcp_load_and_continue(rank: int, world_size: int, path: str) -> dict:
    from tpu_dist.collectives import ProcessGroupTPU

    model, optimizer = _fsdp_model_and_optimizer(seed=1)  # other weights: the load must replace them
    step, _ = train_fsdp.load_checkpoint(path, model, optimizer)  # dcp.load + set_state_dict
    adam_steps = sorted({float(s["step"]) for s in optimizer.state.values()})
    losses = _dcp_steps(model, optimizer, step + 1, 4)
    group = dist.distributed_c10d._get_default_group()
    return {"step": step, "adam_steps": adam_steps, "losses": losses, "params": _full_params(model),
            "on_tpu": isinstance(group, ProcessGroupTPU)}


def test_checkpoint_save_restart_load_continue(tpu: World, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "step-2")
    whole = tpu.run(_dcp_uninterrupted)[0]
    first = tpu.run(_dcp_train_and_save, path)[0]
    pids = tpu.pids
    tpu.restart()
    assert not set(pids) & set(tpu.pids)  # new processes
    second = tpu.run(_dcp_load_and_continue, path)
    assert all(r["step"] == 2 and r["adam_steps"] == [2.0] and r["on_tpu"] for r in second)
    second = second[0]
    assert first["losses"] == whole["losses"][:2]
    assert first["losses"] + second["losses"] == whole["losses"]
    for name, value in whole["params"].items():
        assert torch.equal(second["params"][name], value), name
    assert whole["losses"][-1] < whole["losses"][0]
    # the checkpoint read back here, without any process group: the weights of step 2
    dcp_to_torch_save(path, str(tmp_path / "step-2.pt"))
    saved = torch.load(tmp_path / "step-2.pt", weights_only=False)
    assert int(saved["step"]) == 2 and saved["optim"]["state"]
    for name, value in first["params"].items():
        assert torch.equal(saved["model"][name], value), name
