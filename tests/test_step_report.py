"""The compile-only report's ``"step"`` object (issue 31, items 3 and 6).

In-process checks of :class:`tpu_dist.compile_job.StepMeter` (FLOPs, tokens and memory of each
step, against counts worked out by hand in each test's docstring), of the step arithmetic
(:func:`tpu_dist.compile_job.step_report`), and one ``tpu-launch --compile-only`` run of the
FSDP2 x TP example on 4 devices whose ``"step"`` object is checked against the model's
analytic FLOP count and the overlap rule.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tpu_dist.compile_job import (
    MATMUL_EFFICIENCY,
    CompiledCall,
    StepMeter,
    StepRecord,
    step_report,
)
from tpu_dist.compile_job._step import step_svg
from tpu_dist.mesh import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp_tp.py")


class _Tiny(nn.Module):
    """Embedding(32, 16) -> wq (16x16) -> causal attention, 2 heads of 8 -> output (16x32)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.wq = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        h = self.wq(self.emb(ids)).view(b, s, 2, 8).transpose(1, 2)
        a = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, s, 16))


def _train(model: nn.Module, steps: int, ids: torch.Tensor) -> None:
    opt = torch.optim.Adam(model.parameters())
    for _ in range(steps):
        model(ids).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_meter_counts_each_step_by_hand() -> None:
    """Batch 2 x sequence 8 = 16 tokens.

    Matmuls: wq 2 x 16 x 16 x 16 = 8,192 FLOPs forward, output 2 x 16 x 16 x 32 = 16,384; the
    backward twice each (input and weight gradients): 3 x 24,576 = 73,728. Attention: one
    matmul of (batch 2 x heads 2) x (8 x 8) x 8 is 2 x 4 x 8 x 8 x 8 = 4,096 FLOPs; the forward
    has two (scores, then values), torch's backward count five: 7 x 4,096 = 28,672. A step:
    102,400 FLOPs, both steps alike. Memory: the parameters (32 x 16 + 16 x 16 + 16 x 32) x 4 B
    = 5,120 B, live through the whole step, and Adam's two moments of them, 10,240 B, plus its
    three 4-byte step counters, from the second step on (the first step creates them).
    """
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 32, (2, 8))
    with StepMeter() as meter:
        _train(model, 2, ids)
    assert [s.index for s in meter.steps] == [0, 1]
    assert [s.flops for s in meter.steps] == [102_400, 102_400]
    assert [s.tokens for s in meter.steps] == [16, 16]
    second = meter.chosen()
    assert second is meter.steps[1]
    assert second.peak_breakdown["Parameter"] == 5_120
    assert second.peak_breakdown["Optstate"] == 10_240 + 3 * 4
    assert second.peak_bytes == sum(second.peak_breakdown.values())


class _OpCount(TorchDispatchMode):
    """A script's own dispatch mode: counts the ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("own_mode", [False, True])
def test_only_the_first_two_steps_are_measured(own_mode: bool) -> None:
    """Five steps: the first two are measured (as in test_meter_counts_each_step_by_hand), the
    other three only counted; the meter's modes stay on torch's mode stack to the end, passing
    every op through, and a mode the script pushed above them keeps seeing every op. The
    results are those of the same steps without the meter."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def run(meter: StepMeter | None) -> tuple[torch.Tensor, list, int]:
        torch.manual_seed(0)
        model = _Tiny()
        ids = torch.randint(0, 32, (2, 8))
        stacks, own = [], _OpCount()
        with meter if meter is not None else contextlib.nullcontext():
            with own if own_mode else contextlib.nullcontext():
                for _ in range(5):
                    _train(model, 1, ids)
                    stacks.append(len(_get_current_dispatch_mode_stack()))
        return model.out.weight.detach().clone(), stacks, own.ops

    meter = StepMeter()
    measured, stacks, ops = run(meter)
    plain, plain_stacks, plain_ops = run(None)
    assert torch.equal(measured, plain)
    assert [s.index for s in meter.steps] == [0, 1] and meter.steps_run == 5
    assert [s.flops for s in meter.steps] == [102_400, 102_400]
    assert meter.chosen() is meter.steps[1] and meter.error is None
    assert meter.chosen().peak_breakdown["Parameter"] == 5_120
    assert stacks == [3 + own_mode] * 5, stacks  # the meter's three stay
    assert plain_stacks == [int(own_mode)] * 5 and ops == plain_ops
    assert ops > 0 or not own_mode
    assert len(_get_current_dispatch_mode_stack()) == 0


class _LocalLookup(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = self.weight.to_local()
        return F.embedding((ids - 25).clamp(0, local.shape[0] - 1), local)


def test_dtensor_ops_count_once_on_the_local_shard() -> None:
    """A (64 x 32) @ (32 x 16) matmul with the left operand split in 4 rows blocks over a
    4-rank mesh: each rank multiplies 16 x 32 by 32 x 16, 2 x 16 x 32 x 16 = 16,384 FLOPs (the
    global op is 65,536: counting it too would give 81,920). An embedding lookup of 40 token ids
    replicated over the 4 ranks credits each rank 10 tokens, as do 40 plain ids (which DTensor
    replicates over the table's mesh) in a second step, and 40 ids looked up on plain tensors by
    an nn.Embedding whose table is sharded over the 4 ranks in a third; a fourth looks up 40
    ids in an FSDP-sharded table (gathered first: data parallelism does not share ids): 40."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])
        b = distribute_tensor(torch.randn(32, 16), mesh, [Replicate()])
        weight = distribute_tensor(torch.randn(100, 8), mesh, [Replicate()])
        ids = distribute_tensor(torch.randint(0, 100, (4, 10)), mesh, [Replicate()])
        done = torch.optim.SGD([nn.Parameter(torch.zeros(1))])
        with StepMeter(track_memory=False, measure=4) as meter:
            a @ b
            F.embedding(ids, weight)
            done.step()
            # Plain ids with a DTensor table (TorchTitan's TP): replicated over its mesh.
            from torch.distributed.tensor.experimental import implicit_replication

            with implicit_replication():
                F.embedding(torch.randint(0, 100, (4, 10)), weight)
            done.step()
            # TorchTitan's vocab-parallel embedding: an nn.Embedding whose table is sharded
            # over the mesh looks up every id on its local rows, with plain tensors.
            table = _LocalLookup(100, 8)
            table.weight = nn.Parameter(distribute_tensor(table.weight.detach(), mesh, [Shard(0)]))
            table(torch.randint(0, 100, (4, 10)))
            done.step()
            # An FSDP-sharded table is gathered before its lookup: each rank's own 40 ids.
            from torch.distributed.fsdp import fully_shard

            sharded = fully_shard(nn.Embedding(100, 8), mesh=mesh)
            sharded(torch.randint(0, 100, (4, 10)))
            done.step()
        (step, plain, local, fsdp) = meter.steps
        assert step.flops == 16_384
        assert step.tokens == plain.tokens == local.tokens == 10
        assert fsdp.tokens == 40
        assert step.peak_bytes is None
    finally:
        dist.destroy_process_group()


def _flex_step(mask_mod, *, fake_mask: bool, monkeypatch) -> tuple[StepRecord, str | None]:
    """One step of FlexAttention (forward and backward) over fake q = k = v of batch 1, 4
    heads of 64, sequence 1,024, under the meter, with a block mask built from real tensors
    (its block counts hold values) or, with ``fake_mask``, from fake ones."""
    from torch.nn.attention import flex_attention as fa

    from tpu_dist.compile_job import LargeTensorsFake

    # torch refuses FlexAttention's backward on CPU tensors; fake ones compute nothing.
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with LargeTensorsFake(fake_device_types=("cpu",) if fake_mask else ()) as fake, \
            StepMeter(track_memory=False) as meter:
        q = torch.randn(1, 4, 1024, 64, requires_grad=True)  # 262,144 elements: fake
        mask = fa.create_block_mask(mask_mod, 1, None, 1024, 1024, device="cpu")
        assert isinstance(mask.kv_num_blocks, type(q)) is fake_mask
        fa.flex_attention(q, q, q, block_mask=mask).sum().backward()
        optimizer.step()
    assert fake.faked > 0
    return meter.steps[-1], meter.error


def _causal(b, h, q, kv):
    return q >= kv


def _window_of_128(b, h, q, kv):
    return (q >= kv) & (q - kv < 128)


@pytest.mark.parametrize("mask_mod, fake_mask, blocks", [
    (_causal, False, 36),
    (_window_of_128, False, 15),
    (_window_of_128, True, 36),
])
def test_flex_attention_counts_the_blocks_its_mask_computes(mask_mod, fake_mask: bool,
                                                            blocks: int, monkeypatch) -> None:
    """FlexAttention (TorchTitan's attention: a higher-order op and its backward, which every
    mode of the meter must take) counts the (q block, kv block) pairs its block mask computes.
    Sequence 1,024 in blocks of 128: 8 x 8 pairs. Dense, torch's attention count: forward two
    matmuls of 2 x 4 heads x 1,024 x 1,024 x 64 = 536,870,912 each, 1,073,741,824; backward
    five, 2,684,354,560. A causal mask computes 8 x 9 / 2 = 36 pairs (read from the mask's
    block counts); a window of the last 128 keys 1 + 2 x 7 = 15 (the diagonal block and the
    one before). A mask built on fake tensors has no values: counted as causal, 36. Model
    FLOPs (MFU's numerator) are 3 x the dense forward whatever the mask: 3,221,225,472."""
    record, error = _flex_step(mask_mod, fake_mask=fake_mask, monkeypatch=monkeypatch)
    assert error is None
    dense = 1_073_741_824 + 2_684_354_560
    assert record.flops == 1_073_741_824 * blocks // 64 + 2_684_354_560 * blocks // 64
    assert record.flops == pytest.approx(dense * blocks / 64)
    assert record.model_flops == 3 * 1_073_741_824


def test_the_causal_block_fraction_is_the_one_flex_attention_builds() -> None:
    """The causal assumption for fake masks against the block counts FlexAttention builds for
    a causal mask on real tensors, for square and non-square lengths and block sizes."""
    from torch.nn.attention import flex_attention as fa

    from tpu_dist.compile_job._op_costs import causal_block_fraction, computed_block_fraction

    for q_len, kv_len, block in [(1024, 1024, 128), (1000, 1000, 128), (256, 1024, 128),
                                 (512, 512, 64), (384, 384, (128, 64))]:
        mask = fa.create_block_mask(_causal, 1, None, q_len, kv_len, device="cpu",
                                    BLOCK_SIZE=block)
        q_block, kv_block = (block, block) if isinstance(block, int) else block
        assert computed_block_fraction(mask.as_tuple()) == pytest.approx(
            causal_block_fraction(q_len, kv_len, q_block, kv_block)), (q_len, kv_len, block)


def test_grouped_matmuls_of_experts_are_counted() -> None:
    """``torch._grouped_mm`` (an MoE's experts): 64 tokens of width 32 in 4 groups of 16, each
    against its expert's 32 x 16: 2 x 64 x 32 x 16 = 65,536 FLOPs forward; the backward's
    weight gradient (groups along the contraction: 2-D x 2-D) as many; the tokens take none."""
    weight = nn.Parameter(torch.randn(4, 32, 16, dtype=torch.bfloat16))
    tokens = torch.randn(64, 32, dtype=torch.bfloat16)
    ends = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    with StepMeter(track_memory=False) as meter:
        torch._grouped_mm(tokens, weight, offs=ends).float().sum().backward()
        torch.optim.SGD([weight]).step()
    assert meter.steps[-1].flops == 2 * 65_536
    assert meter.steps[-1].model_flops == 3 * 65_536


def test_grouped_matmuls_of_float32_experts_run_fake() -> None:
    """torch 2.13's shape rule for ``torch._grouped_mm`` takes bf16 inputs only (CUDA's check),
    while the CPU kernel takes float32: a float32 MoE large enough to be fake under
    ``--compile-only`` (``examples/train_moe.py --model debug``) failed there. Under
    :class:`LargeTensorsFake` the forward and the backward give what the real op gives: shapes
    and float32."""
    from torch._subclasses.fake_tensor import FakeTensor

    from tpu_dist.compile_job import LargeTensorsFake

    ends = torch.tensor([100, 300, 512], dtype=torch.int32)  # 3 experts, uneven groups

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randn(512, 256, requires_grad=True)  # 131,072 elements: fake
        weight = nn.Parameter(torch.randn(3, 256, 128))  # 98,304: fake
        out = torch._grouped_mm(tokens, weight, offs=ends)
        out.backward(torch.ones_like(out))
        return out, weight.grad

    want = step()
    with LargeTensorsFake():
        got = step()
    for g, w in zip(got, want):
        assert isinstance(g, FakeTensor) and not isinstance(w, FakeTensor)
        assert (g.shape, g.dtype) == (w.shape, w.dtype) == (g.shape, torch.float32)


def _row(op: str, origin: str, est: float | None, temp: int) -> CompiledCall:
    return CompiledCall(
        op=op, reduce_op=None, group_size=4, mesh_dim="dp" if origin == "fsdp" else "tp",
        crosses_dcn=False, bytes_per_rank=1 << 20, dtype="float32", count=9, compiled=True,
        hlo_collectives=("all-gather",), compile_seconds=0.1, temp_bytes=temp, est_seconds=est,
        program="allgather", first_call="train.py:1", error=None, origin=origin,
        overlappable=origin == "fsdp",
    )


def test_step_arithmetic_by_hand() -> None:
    """TPU7x: 2,307 TFLOP/s per chip, two devices: 1,153.5e12 per device; 192 GiB HBM per chip,
    96 GiB per device. 1,153.5e12 FLOPs: compute 1 s. FSDP all-gathers 3 x 0.5 s = 1.5 s
    (overlappable: 1 s hides under compute, 0.5 s shows), TP all-reduces 2 x 0.1 s = 0.2 s
    (critical path). Exposed 0.7 s, step 1.7 s, MFU bound 1 / 1.7 = 58.8 %; 8,192 tokens per
    device: 4,819 tokens/s. Memory: 90 GiB of tensors + the largest scratch, 8 GiB: 98 GiB,
    short by 2 GiB. A row with no estimate (a group within one chip) is counted apart; a row
    the step did not issue (0 calls) is left out."""
    topology = Topology.parse("tpu7x:2x2x1")
    rows = [_row("all_gather_into_tensor", "fsdp", 0.5, 8 << 30),
            _row("all_reduce", "tensor", 0.1, 1 << 30),
            _row("all_reduce", "script", None, 0),
            _row("barrier", "script", 5.0, 16 << 30)]
    record = StepRecord(index=1, flops=int(1153.5e12), tokens=8192, peak_bytes=90 << 30,
                        peak_breakdown={"Parameter": 90 << 30})
    report = step_report(record, 2, rows, [3, 2, 1, 0], topology)
    e = report.estimate
    assert e.compute_seconds == pytest.approx(1.0)
    assert e.comm_seconds == pytest.approx(1.7)
    assert e.exposed_comm_seconds == pytest.approx(0.7)
    assert e.step_seconds == pytest.approx(1.7)
    assert e.mfu_bound == pytest.approx(1 / 1.7)
    assert e.tokens_per_second_per_device == pytest.approx(8192 / 1.7)
    assert e.hbm_capacity_bytes == 96 << 30
    assert e.hbm_peak_bytes == 98 << 30
    assert report.fits is False and report.hbm_verdict().startswith("short by 2.0 GiB")
    assert report.unestimated == 1
    # The prediction (no matmul shapes recorded: not padded; no memory-bound bytes): matmuls
    # 1 / MATMUL_EFFICIENCY s, the FSDP 1.5 s hides under them up to that, TP's 0.2 s adds.
    matmul = 1 / MATMUL_EFFICIENCY
    assert e.predicted_matmul_seconds == pytest.approx(matmul)
    assert e.predicted_memory_seconds == 0
    assert e.predicted_seconds == pytest.approx(matmul + 0.2 + max(0.0, 1.5 - matmul))
    assert e.predicted_seconds >= e.step_seconds
    assert [(c.op, c.calls) for c in report.costs] == [("all_gather_into_tensor", 3),
                                                       ("all_reduce", 2)]
    data = report.to_json()
    for field in ("flops_per_device", "compute_seconds", "comm_seconds", "exposed_comm_seconds",
                  "step_seconds", "mfu_bound", "tokens_per_second_per_device", "hbm_peak_bytes",
                  "hbm_capacity_bytes", "predicted_seconds", "predicted_mfu"):
        assert field in data
    svg = ET.fromstring(step_svg(report, "a <title> & more"))
    assert svg.tag.endswith("svg")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256, bias=False)
        self.down = nn.Linear(256, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _TinyLM(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 64)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.out = nn.Linear(64, 32, bias=False)
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            if self.checkpointed:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.out(h)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_mfu_counts_model_flops_not_the_recomputed_forward(checkpointed: bool) -> None:
    """MFU's numerator is the model's FLOPs (TorchTitan's 6N a token for a model of matmuls),
    not the FLOPs run: activation checkpointing runs part of each block's forward again in the
    backward; the counted FLOPs include that, the model FLOPs (3x the forward's) do not.

    Worked example, 16 tokens: N = the linears' weights = 2 blocks x (64 x 256 + 256 x 64) +
    64 x 32 = 67,584 (the embedding lookup computes nothing); 6 N x 16 = 6,488,064. Checkpointed,
    torch's non-reentrant recomputation stops once the tensors the backward needs are back: the
    ``up`` matmul of each block (its output feeds the ReLU, whose input is saved), not ``down``
    (whose output nobody saved): 2 blocks x 2 x 64 x 256 x 16 = 1,048,576 more FLOPs run, 7,536,640
    in all. With no collectives the bound is compute alone, so the MFU bound is model / run:
    1.0 without checkpointing, 6,488,064 / 7,536,640 = 0.861 with it."""
    torch.manual_seed(0)
    model = _TinyLM(checkpointed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 32, (1, 16))
    with StepMeter(track_memory=False) as meter:
        for _ in range(2):
            model(ids).logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert meter.error is None
    record = meter.steps[-1]
    model_flops = 6 * 67_584 * 16
    assert record.model_flops == model_flops
    assert record.flops == model_flops + (1_048_576 if checkpointed else 0)
    report = step_report(record, 2, [], [], Topology.parse("tpu7x:2x2x1"))
    assert report.estimate.model_flops_per_device == model_flops
    assert report.estimate.mfu_bound == pytest.approx(model_flops / record.flops)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict, str]:
    pytest.importorskip("libtpu", reason="compile-only mode compiles with libtpu")
    tmp = tmp_path_factory.mktemp("step")
    report = tmp / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_dist.launch", "--emulate", "v5p:2x2x1", "--compile-only",
         "--compile-report", str(report), EXAMPLE, "--steps", "2"],
        env=env, cwd=str(tmp), capture_output=True, text=True, timeout=600,
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, data, str(tmp / "report.step.svg")


def test_example_step_object(example_run: tuple[int, str, dict, str]) -> None:
    """The example's defaults: dim 64, 2 layers of 4 heads, SwiGLU width 128, 256 byte tokens,
    sequence 32; 4 devices as (dp 2, tp 2), 8 sequences: 4 per dp rank, 128 tokens, 64 per
    device. Weights whose matmuls run: per layer 4 x 64 x 64 + 3 x 64 x 128 = 40,960, two
    layers and the output's 64 x 256: 98,304 (the norms' weights multiply elementwise: not
    matmul FLOPs; the embedding is a lookup). 6 x 98,304 x 64 = 37,748,736. Attention per
    device: 2 layers x 2 heads (of 4, over tp 2) x 4 sequences x 7 matmuls of 2 x 32 x 32 x 16
    FLOPs = 3,670,016. Total 41,418,752 per device.
    """
    code, out, report, svg = example_run
    assert code == 0, out
    step = report["step"]
    assert step["flops_per_device"] == 41_418_752
    assert step["tokens_per_device"] == 64
    assert step["steps_run"] == 2 and step["step_index"] == 1
    peak = 459e12  # v5p: 459 TFLOP/s per chip, one device per chip
    assert step["compute_seconds"] == pytest.approx(41_418_752 / peak)
    assert step["step_seconds"] == pytest.approx(step["compute_seconds"]
                                                 + step["exposed_comm_seconds"])
    # The overlap rule: FSDP's collectives (dp) overlap, DTensor's (tp) do not.
    by_origin = {(c["origin"], c["mesh_dim"], c["overlappable"]) for c in step["collectives"]}
    assert ("fsdp", "dp", True) in by_origin and ("tensor", "tp", False) in by_origin
    assert all(o == (d == "dp" and o_ == "fsdp") or o_ != "fsdp"
               for o_, d, o in by_origin)
    critical = sum(c["seconds"] for c in step["collectives"] if not c["overlappable"])
    hidden = sum(c["seconds"] for c in step["collectives"] if c["overlappable"])
    assert step["comm_seconds"] == pytest.approx(critical + hidden)
    assert step["exposed_comm_seconds"] == pytest.approx(
        critical + max(0.0, hidden - step["compute_seconds"]))
    assert step["hbm_peak_bytes"] == step["tensor_peak_bytes"] + step["program_temp_bytes"]
    assert step["hbm_capacity_bytes"] == 95 * 2**30 and step["hbm_fits"] is True
    assert step["memory_bytes"]["Parameter"] > 0
    assert "step (the 2nd of 2, per device)" in out and "costliest collectives" in out
    # The prediction beside the bound: never below it, its terms adding up, the meter's bytes
    # of memory-bound ops at v5p's HBM bandwidth (2,765 GB/s a chip, one device a chip).
    assert step["predicted_seconds"] >= step["step_seconds"]
    assert step["predicted_seconds"] == pytest.approx(
        step["predicted_matmul_seconds"] + step["predicted_memory_seconds"]
        + step["predicted_exposed_comm_seconds"])
    assert step["predicted_matmul_seconds"] >= step["compute_seconds"] / MATMUL_EFFICIENCY
    assert step["memory_bound_bytes"] > 0
    assert step["predicted_memory_seconds"] == pytest.approx(
        step["memory_bound_bytes"] / 2765e9)
    assert step["predicted_mfu"] == pytest.approx(
        step["model_flops_per_device"] / (step["predicted_seconds"] * peak))
    assert step["predicted_mfu"] <= step["mfu_bound"]
    assert "predicted step:" in out
    assert ET.parse(svg).getroot().tag.endswith("svg")


def _example():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_fsdp_tp

    return train_fsdp_tp


@pytest.mark.parametrize("preset, shape_name, params", [
    ("llama3-8b", "LLAMA3_8B", 8_030_261_248),
    ("llama3-70b", "LLAMA3_1_70B", 70_553_706_496),
    ("llama3-405b", "LLAMA3_1_405B", 405_853_388_800),
])
def test_presets_have_the_published_parameter_counts(preset: str, shape_name: str,
                                                     params: int) -> None:
    """The example's model at each Llama preset (built on the meta device: no memory) has the
    parameter count of Meta's released checkpoints (8,030,261,248; 70,553,706,496;
    405,853,388,800: the safetensors index totals / 2 bytes) and of the step model's
    DecoderShape. Qwen3-32B (64 heads of 128 on width 5120, 8 key/value heads, untied
    output): 64 x (5120 x 8192 x 2 + 5120 x 1024 x 2 + 3 x 5120 x 25600 + 2 x 5120) +
    2 x 151,936 x 5120 + 5120 = 32,762,106,880 (its QK-norm weights, 64 x 2 x 128 = 16,384,
    are left out of the example)."""
    from tpu_dist.compile_job import _estimate

    ex = _example()
    args = ex.parse_args(["--model", preset, "--seq-len", "8192"], extra=ex._options)
    with torch.device("meta"):
        model = ex.Decoder(ex.build_config(args))
    count = sum(p.numel() for p in model.parameters())
    assert count == params == getattr(_estimate, shape_name).params
    args = ex.parse_args(["--model", "qwen3-32b"], extra=ex._options)
    with torch.device("meta"):
        model = ex.Decoder(ex.build_config(args))
    assert sum(p.numel() for p in model.parameters()) == 32_762_106_880 == _estimate.QWEN3_32B.params
    # Qwen3-8B: 36 x (4096 x 4096 x 2 + 4096 x 1024 x 2 + 3 x 4096 x 12288 + 2 x 4096)
    # + 2 x 151,936 x 4096 + 4096 (untied output; its QK-norm's 36 x 2 x 128 left out).
    args = ex.parse_args(["--model", "qwen3-8b"], extra=ex._options)
    with torch.device("meta"):
        model = ex.Decoder(ex.build_config(args))
    assert sum(p.numel() for p in model.parameters()) == 8_190_726_144 == _estimate.QWEN3_8B.params


def test_layouts_the_model_cannot_take_are_refused_with_what_to_pass() -> None:
    ex = _example()
    config = ex.build_config(ex.parse_args(["--model", "llama3-8b"], extra=ex._options))
    with pytest.raises(SystemExit, match="does not divide the model's 8 key/value heads"):
        ex.check_layout(config, 1024, 16, 16384)
    with pytest.raises(SystemExit, match="pass --dp 2048"):
        ex.check_layout(config, 1000, 8, 16384)
    ex.check_layout(config, 2048, 8, 16384)


def test_fake_memory_estimate_matches_a_real_four_rank_run() -> None:
    """Issue 31's memory target: the debug preset (grouped-query attention, bf16 mixed
    precision, activation checkpointing, sequence 128) on 4 real CPU ranks (gloo, real tensors,
    each rank under a StepMeter) against ``--compile-only`` of the same arguments on 4 devices
    (fake tensors): rank 0's peak tensor bytes of the second step within 10 % (measured: equal,
    to the byte), and the same FLOPs and tokens. (With the "tpu" backend on CPU the real run
    holds more: 1.29x at sequence 512, docs/decisions/0026-measured-step-in-compile-only.md.)"""
    pytest.importorskip("libtpu", reason="compile-only mode compiles with libtpu")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from step_memory_check import compare

    result = compare(["--model", "debug", "--seq-len", "128", "--tp", "2", "--mixed-precision",
                      "bf16", "--activation-checkpointing", "--steps", "2"], real_backend="gloo")
    real, fake = result["real"], result["fake"]
    assert real["index"] == fake["index"] == 1
    assert fake["peak_bytes"] == pytest.approx(real["peak_bytes"], rel=0.10)
    # The default global batch, 8 sequences, over dp 2: 4 x 128 tokens per dp rank, over tp 2.
    assert fake["flops"] == real["flops"] and fake["tokens"] == real["tokens"] == 4 * 128 / 2


def test_collectives_dtensor_issues_on_fake_tensors_reach_the_recording(monkeypatch) -> None:
    """loss_parallel's cross-entropy on vocab-sharded logits large enough to be fake: DTensor
    runs it on its local tensors and issues three all-reduces over tp (max, sum of exps, the
    target logits) from inside its dispatch. Under :class:`LargeTensorsFake` alone (no step
    meter above it) each must come back to the mode, which hands it to its group
    (``_fake._issue``; torch's fake process group here, so nothing more happens). They used to
    run with the mode set aside and were never recorded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tpu_dist.compile_job import LargeTensorsFake, _fake

    issued: list[str] = []
    real_issue = _fake._issue

    def spy(func, args, out):
        issued.append(func._schema.name.split("::")[-1])
        return real_issue(func, args, out)

    monkeypatch.setattr(_fake, "_issue", spy)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with LargeTensorsFake() as fake:
            local = torch.randn(2048, 64)  # 131,072 elements: fake
            logits = DTensor.from_local(local, mesh, [Shard(1)])
            targets = torch.randint(0, 128, (2048,))
            with loss_parallel():
                F.cross_entropy(logits, targets)
        assert fake.faked >= 1
        assert issued.count("all_reduce") == 3, issued
    finally:
        dist.destroy_process_group()


def _fsdp_layouts(world: int, rank: int, lazy: bool) -> tuple[list[tuple], int]:
    """``fully_shard`` of parameters of awkward shapes over a 1-D mesh of ``world`` ranks (torch's
    fake process group, this process as ``rank``) inside :class:`LargeTensorsFake`: every
    FSDPParam's sharding metadata and its shard's view (shape, stride, offset), and how many
    aten ops ``fully_shard`` dispatched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpu_dist.compile_job import LargeTensorsFake

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.ops += 1
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with LargeTensorsFake(lazy_fsdp_chunks=lazy):
            # rows: fewer than the ranks (empty chunks), uneven, a multiple; 1-D; large (fake)
            modules = [nn.Linear(5, 14, bias=True), nn.Linear(3, world * 7 + 3),
                       nn.Linear(8, world * 4, bias=False), nn.LayerNorm(world // 2),
                       nn.Linear(1024, world * 96, bias=False)]
            with _Count():
                for m in modules:
                    fully_shard(m, mesh=mesh)
        rows = []
        for m in modules:
            for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params:
                local = p.sharded_param.to_local()
                rows.append((p.sharded_size, p.padded_sharded_param_size,
                             p.sharded_post_forward_size, p.contiguous_sharded_stride,
                             tuple(p._sharded_param_data.shape), tuple(local.shape),
                             local.stride(), local.storage_offset(), type(local).__name__))
        return rows, _Count.ops
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 1000, 2047])
def test_lazy_fsdp_chunks_shard_as_fsdp_does(rank: int) -> None:
    """FSDP2 cuts each parameter into one chunk per data-parallel rank and keeps its own. In
    compile-only fake mode the chunks are made only when read (``_fake._LazyChunks``): over
    2,048 ranks ``fully_shard`` of five modules must give every parameter the same shard
    (sizes, padding, the view's shape, stride and offset) as FSDP's own chunking, on the
    first and last rank and a middle one (past the rows of the small parameters: empty
    chunks), with a number of ops that does not grow with the ranks (FSDP's own: a view per
    rank, twice per parameter: over 2 x 2,048 for each of the four parameters of at least
    2,048 rows)."""
    lazy, lazy_ops = _fsdp_layouts(2048, rank, lazy=True)
    eager, eager_ops = _fsdp_layouts(2048, rank, lazy=False)
    assert lazy == eager
    assert eager_ops > 2 * 4 * 2048
    assert lazy_ops < 400


def test_lazy_chunks_are_torch_chunks() -> None:
    """``_LazyChunks`` against FSDP's ``_chunk_with_empty`` (``torch.chunk`` padded with empty
    tensors) on real data, for row counts below, at and above the number of chunks, along dim
    0 and 1: the same number of chunks, each with the same values, shape, stride and offset."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from tpu_dist.compile_job._fake import _LazyChunks

    for rows, cols, n, dim in [(3, 4, 4, 0), (7, 2, 16, 0), (10, 3, 4, 0), (64, 5, 8, 0),
                               (65, 2, 8, 0), (5, 10, 3, 1), (1, 1, 5, 0), (14336, 1, 2048, 0)]:
        t = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
        want, got = _chunk_with_empty(t, n, dim), _LazyChunks(t, n, dim)
        assert len(got) == len(want) == n
        for i in [*range(min(n, 12)), n - 1, -1]:
            w, g = want[i], got[i]
            assert (g.shape, g.stride(), g.storage_offset()) == (
                w.shape, w.stride(), w.storage_offset()), (rows, cols, n, dim, i)
            assert torch.equal(g, w)


def test_a_script_the_meter_breaks_runs_on_and_the_step_is_reported_missing() -> None:
    """``nn.Embedding(sparse=True)`` gives a sparse gradient, which torch's MemTracker cannot
    track (``Cannot access storage of SparseTensorImpl``). Under the meter the script must run
    to its end with the same results as without it (SGD on the sparse gradient: the same
    weights after two steps), and the meter must say why it measured nothing."""
    def run(meter: StepMeter | None) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Embedding(100, 8, sparse=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ids = torch.randint(0, 100, (4, 5))
        with meter if meter is not None else torch.no_grad():
            for _ in range(2):
                with torch.enable_grad():
                    model(ids).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
        return model.weight.detach().clone()

    meter = StepMeter()
    assert torch.equal(run(meter), run(None))
    assert meter.error is not None and "SparseTensorImpl" in meter.error
    assert meter.chosen() is None


def test_a_program_the_compiler_does_not_finish_is_stopped_and_reported() -> None:
    """The compiler child gets ``Compiler.timeout`` seconds a program. An all_reduce over the 4
    devices of ``v5p:2x2x1`` compiles (warm child, generous limit); the same program under a
    limit of 0 s is stopped and reported as failed with the limit in its message; the next
    program compiles again, in a new child."""
    pytest.importorskip("libtpu", reason="compile-only mode compiles with libtpu")
    from tpu_dist.collectives._types import ProgramKey
    from tpu_dist.compile_job._compile import Compiler

    compiler = Compiler(Topology.parse("v5p:2x2x1"), timeout=300)
    try:
        keys = [ProgramKey("allreduce", (0, 1, 2, 3), ((n, "float32"),), ("SUM",))
                for n in (8, 16, 32)]
        ok, ops, _, _, error = compiler.compile(keys[0])
        assert ok and "all-reduce" in ops and error is None
        compiler.timeout = 0.0
        ok, _, _, _, error = compiler.compile(keys[1])
        assert not ok and "did not finish this program within 0 s" in error
        compiler.timeout = 300
        ok, ops, _, _, error = compiler.compile(keys[2])
        assert ok and "all-reduce" in ops, error
    finally:
        compiler.close()
