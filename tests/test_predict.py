"""The predicted step (issue 53, decision 0034): its formulas against worked examples computed
by hand in each test's docstring, and the step meter's per-op bytes and matmul shapes.

Pure arithmetic and single ops on CPU tensors: no processes, no TPU compiler.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpu_dist.compile_job import MATMUL_EFFICIENCY, DecoderShape, predict_step, step_estimate
from tpu_dist.compile_job._estimate import decoder_step_costs, padded_matmul_flops
from tpu_dist.compile_job._op_costs import FusedBytes, op_cost
from tpu_dist.mesh import get_generation

_aten = torch.ops.aten


def test_matmuls_are_padded_to_the_mxu() -> None:
    """``(1000, 128, 4096)``, 1e9 FLOPs: on a 256-wide MXU 1000 -> 1024 and 128 -> 256, so
    ``1024 x 256 x 4096 / (1000 x 128 x 4096) = 2.048``: 2.048e9; on a 128-wide one only
    1000 -> 1024: 1.024e9. A shape of None (a convolution) is not padded: 5e8 stays."""
    flops = {(1000, 128, 4096): 1e9, None: 5e8}
    assert padded_matmul_flops(flops, 256) == pytest.approx(2.048e9 + 5e8)
    assert padded_matmul_flops(flops, 128) == pytest.approx(1.024e9 + 5e8)
    assert padded_matmul_flops(flops, None) == pytest.approx(1.5e9)


def test_mxu_sizes_of_the_generations() -> None:
    """128 x 128 MXUs up to v5p, 256 x 256 on v6e and (assumed) TPU7x (Generation.mxu_size's
    sources)."""
    assert [get_generation(g).mxu_size for g in ("v4", "v5e", "v5p", "v6e", "v7x")] == [
        128, 128, 128, 256, 256]


def test_predicted_step_by_hand() -> None:
    """TPU7x device: 1,153.5e12 FLOP/s, 3,690e9 B/s of HBM. Matmuls of 576.75e12 FLOPs in
    1024-cubes (no padding) at efficiency 0.5: 1 s. 3.69e12 bytes of memory-bound work: 1 s.
    Compute 2 s; FSDP's 2.5 s of overlappable communication hides 2 s of it, 0.5 s shows; TP's
    0.25 s is on the critical path: exposed 0.75 s, step 2.75 s. At the default efficiency
    the matmuls take 0.5 / MATMUL_EFFICIENCY s."""
    gen = get_generation("v7x")
    peak, hbm = gen.peak_bf16_flops_per_device, gen.hbm_bytes_per_s_per_device
    assert (peak, hbm) == (1153.5e12, 3690e9)
    p = predict_step(matmul_flops={(1024, 1024, 1024): 576.75e12}, memory_bytes=3.69e12,
                     peak_flops_per_s=peak, hbm_bytes_per_s=hbm, mxu_size=256,
                     overlappable_comm_seconds=2.5, critical_comm_seconds=0.25,
                     efficiency=0.5)
    assert (p.matmul_seconds, p.memory_seconds) == (pytest.approx(1.0), pytest.approx(1.0))
    assert p.exposed_comm_seconds == pytest.approx(0.75)
    assert p.seconds == pytest.approx(2.75)
    default = predict_step(matmul_flops={(1024, 1024, 1024): 576.75e12}, memory_bytes=0,
                           peak_flops_per_s=peak, hbm_bytes_per_s=hbm, mxu_size=256)
    assert default.seconds == pytest.approx(0.5 / MATMUL_EFFICIENCY)
    with pytest.raises(ValueError, match="efficiency"):
        predict_step(matmul_flops={}, memory_bytes=0, peak_flops_per_s=peak,
                     hbm_bytes_per_s=hbm, mxu_size=256, efficiency=1.5)


def test_the_prediction_sits_beside_the_bound_and_never_below_it() -> None:
    """The same step through :func:`step_estimate`: the bound is 576.75e12 FLOPs at peak =
    0.5 s compute, + 0.25 critical + (2.5 - 0.5) overlappable = 2.75 s, MFU bound 0.5 / 2.75;
    the prediction 0.5 / 0.5 + 1 + 0.25 + 0.5 = 2.75 s too (communication-bound: the same
    exposed total), MFU 0.5 / 2.75. With less communication (0.25 s overlappable, none
    critical) the bound is 0.5 s and the prediction 2 s, predicted MFU 0.25."""
    gen = get_generation("v7x")
    kwargs = dict(flops_per_device=576.75e12, peak_flops_per_s=gen.peak_bf16_flops_per_device,
                  tokens_per_device=1000, matmul_flops={(1024, 1024, 1024): 576.75e12},
                  memory_bytes=3.69e12, hbm_bytes_per_s=gen.hbm_bytes_per_s_per_device,
                  mxu_size=256)
    e = step_estimate(overlappable_comm_seconds=2.5, critical_comm_seconds=0.25, **kwargs)
    assert e.step_seconds == pytest.approx(2.75)
    assert e.predicted_seconds >= e.step_seconds
    light = step_estimate(overlappable_comm_seconds=0.25, **kwargs)
    assert light.step_seconds == pytest.approx(0.5)
    matmul = 0.5 / MATMUL_EFFICIENCY
    assert light.predicted_seconds == pytest.approx(matmul + 1.0)
    assert light.predicted_mfu == pytest.approx(0.5 / (matmul + 1.0))
    assert light.predicted_tokens_per_second_per_device == pytest.approx(1000 / (matmul + 1))
    assert step_estimate(**{k: v for k, v in kwargs.items()
                            if k not in ("hbm_bytes_per_s", "mxu_size")}).predicted_seconds is None


_TINY = DecoderShape(name="tiny", dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16,
                     vocab_size=32)


def test_decoder_costs_by_hand() -> None:
    """dim 8, 1 layer, 2 heads of 4 (1 kv head), SwiGLU 16, vocab 32; 1 sequence of 4: T = 4.

    Matmuls, ``3 x 2 M K N`` each (forward, two gradients): q and o ``(4, 8, 8)`` 1,536 each:
    3,072; k and v ``(4, 8, 4)`` 768 each: 1,536; the MLP's two inputs ``(4, 8, 16)`` 3,072
    each: 6,144; its output ``(4, 16, 8)`` 3,072; the output projection ``(4, 8, 32)`` 6,144.
    That is 19,968 = 6 x 832 weights x 4 tokens. Attention ``(4, 4, 4)``: 2 heads x 2 s x s
    matmuls of 2 x 4 x 4 x 4 FLOPs = 512 forward, 5 in the backward = 1,280: 1,792.

    Bytes (bf16, per token): forward ``10 x 8 + 2 x (8 + 4) + 3 x 16 = 152``, backward ``12 x 8
    + 2 x 12 + 5 x 16 = 200``, final norm 40, loss ``3 x 32 = 96``: 488 a token, x 4 tokens x 2
    bytes = 3,904; AdamW over all 1,112 parameters (2 x 256 embedding/output + 592 block + 8
    norm) x 28 bytes = 31,136: 35,040. Recomputing o adds one more ``(4, 8, 8)`` forward, 512
    FLOPs, and the block's forward elementwise work again, 4 x 152 x 2 = 1,216 bytes."""
    flops, memory = decoder_step_costs(_TINY, batch_per_dp_rank=1, seq_len=4)
    assert flops == {(4, 8, 8): 3072, (4, 8, 4): 1536, (4, 8, 16): 6144, (4, 16, 8): 3072,
                     (4, 4, 4): 1792, (4, 8, 32): 6144}
    assert memory == 35_040
    flops_o, memory_o = decoder_step_costs(_TINY, batch_per_dp_rank=1, seq_len=4,
                                           recompute={"o"})
    assert flops_o[(4, 8, 8)] == 3072 + 512 and memory_o == 35_040 + 1_216
    with pytest.raises(ValueError, match="recompute names"):
        decoder_step_costs(_TINY, batch_per_dp_rank=1, seq_len=4, recompute={"everything"})


def test_op_costs_count_bytes_and_matmul_shapes() -> None:
    """A (4, 8) @ (8, 16) fp32 matmul: matmul-like, ``(M, K, N) = (4, 8, 16)``, 2 x 4 x 8 x 16
    = 1,024 FLOPs, reads 128 + 512 bytes and writes 256: 896. A ReLU of the (4, 16) result:
    memory-bound, reads 256 and writes 256: 512 bytes. A view of it moves nothing; a
    ``zeros_like`` of it writes 256."""
    a, b = torch.ones(4, 8), torch.ones(8, 16)
    out = a @ b
    mm = op_cost(_aten.mm.default, (a, b), {}, out)
    assert (mm.matmul, mm.mxu_dims, mm.flops, mm.bytes_moved) == (True, (4, 8, 16), 1024, 896)
    relu = op_cost(_aten.relu.default, (out,), {}, out.relu())
    assert (relu.matmul, relu.flops, relu.bytes_moved) == (False, 0, 512)
    view = op_cost(_aten.view.default, (out, [64]), {}, out.view(64))
    assert view.bytes_moved == 0 and not view.matmul
    # zeros_like reads only its input's shape: it writes 256 bytes and reads nothing.
    zeros = op_cost(_aten.zeros_like.default, (out,), {}, torch.zeros_like(out))
    assert zeros.bytes_moved == 256


class _Fusing(TorchDispatchMode):
    """Runs each op and prices it as the step meter does: unfused (``op_cost``) and under the
    fusion rule (``FusedBytes``), logging ``(op name, fused bytes)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fusion, self.log, self.unfused = FusedBytes(), [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cost = op_cost(func, args, kwargs or {}, out)
        self.log.append((func.__name__, self.fusion.op(func, args, kwargs or {}, out,
                                                       cost.matmul)))
        self.unfused += 0 if cost.matmul else cost.bytes_moved
        return out


def test_fusion_rule_worked_example() -> None:
    """``_op_costs``'s worked example: ``(relu(x @ w) * 2 + b) @ w2``, fp32 ``(4, 16)``
    activations of 256 bytes. The first mm ends a group; relu reads its output (256) and leaves
    ``r`` pending; ``* 2`` reads ``r`` from VMEM (0); ``+ b`` reads ``b`` (256); the second mm
    reads ``y``, so ``y``'s write is charged (256). Fused 768; unfused 512 + 512 + 768 =
    1,792."""
    x, w, b, w2 = torch.ones(4, 8), torch.ones(8, 16), torch.ones(4, 16), torch.ones(16, 2)
    with _Fusing() as m:
        (torch.relu(x @ w) * 2 + b) @ w2
    assert [n for n, _ in m.log] == ["mm.default", "relu.default", "mul.Tensor",
                                     "add.Tensor", "mm.default"]
    assert [c for _, c in m.log] == [0, 256, 0, 256, 256]
    assert m.unfused == 1_792


def test_fusion_rule_later_reads_views_and_dead_writes() -> None:
    """fp32 ``(4, 16)`` tensors (256 bytes). ``h = x + 1`` reads ``x`` (256), leaves ``h``
    pending; ``d = h * 5`` is fused (0) and ``d`` is never read: its write costs nothing.
    ``h.t() @ w`` reads ``h`` through a view (same storage): ``h``'s write is charged (256) and
    the group ends. ``h * 3`` (a later group) reads ``h``, now in HBM (256) and leaves ``g``
    pending; ``g + h`` reads ``h`` again in the same group: once only (0). A step's end
    (``end_group``) then ``g - 1``: ``g``'s write (256) and its read (256)."""
    x, w = torch.ones(4, 16), torch.ones(4, 8)
    with _Fusing() as m:
        h = x + 1
        h * 5
        h.t() @ w
        g = h * 3
        g + h
    m.fusion.end_group()
    with m:
        g - 1
    costs = [(n, c) for n, c in m.log if n != "t.default"]
    assert costs == [("add.Tensor", 256), ("mul.Tensor", 0), ("mm.default", 256),
                     ("mul.Tensor", 256), ("add.Tensor", 0), ("sub.Tensor", 512)]
