"""The step estimate's models (tpu_dist/compile_job/_estimate.py), against hand arithmetic.

Pure: one process, no JAX, no worlds. Each test's docstring writes out the arithmetic its
expected values come from (the JAX scaling book's style); the published-results test checks
the model against MaxText's TPU7x recipes (a lower bound must not exceed a measured step).
"""

from __future__ import annotations

import json

import pytest

from tpu_dist.compile_job import (
    StepEstimate,
    collective_time,
    estimate_fsdp_tp_step,
    estimate_seconds,
    flops_per_device,
    flops_per_token,
    fsdp_tp_collectives,
    step_estimate,
)
from tpu_dist.compile_job._estimate import LLAMA3_1_70B, LLAMA3_1_405B, LLAMA3_8B
from tpu_dist.mesh import Topology, get_generation

GiB = 2**30


def test_generation_compute_and_memory_per_device() -> None:
    """Cloud TPU docs, per chip; a device is a chip except on TPU7x (two per chip).

    v7x: 2307 TFLOP/s / 2 = 1153.5e12 FLOP/s; 192 GiB / 2 = 96 GiB = 103,079,215,104 B;
    7380 GB/s / 2 = 3690e9 B/s. v5p (megacore, one device): 459e12, 95 GiB, 2765e9.
    v4 275e12, 32 GiB, 1200e9; v5e 197e12, 16 GiB, 819e9; v6e 918e12, 32 GiB, 1638e9.
    """
    v7x = get_generation("tpu7x")
    assert v7x.peak_bf16_flops_per_device == pytest.approx(1153.5e12)
    assert v7x.hbm_bytes_per_device == 96 * GiB == 103_079_215_104
    assert v7x.hbm_bytes_per_s_per_device == pytest.approx(3690e9)
    for name, flops, hbm, bw in (("v4", 275e12, 32, 1200e9), ("v5e", 197e12, 16, 819e9),
                                 ("v5p", 459e12, 95, 2765e9), ("v6e", 918e12, 32, 1638e9)):
        gen = get_generation(name)
        assert gen.devices_per_chip == 1
        assert gen.peak_bf16_flops_per_device == pytest.approx(flops), name
        assert gen.hbm_bytes_per_device == hbm * GiB, name
        assert gen.hbm_bytes_per_s_per_device == pytest.approx(bw), name
        assert "cloud.google.com/tpu/docs" in gen.compute_source, name


def test_latency_floor_of_a_tiny_all_reduce() -> None:
    """The issue's case: 4 bytes all-reduced over 128 TPU7x devices (``tpu7x:4x4x4``).

    Bandwidth: 4 B * 2 * 127/128 / (3 wrapped axes x 2 x 100 GB/s = 600e9) = 1.3e-11 s (the
    0.013 ns the old estimate printed). Latency: per pass 4//2 + 4//2 + 4//2 = 6 ICI hops, +1
    for the two devices of each chip = 7; an all-reduce is two passes: 14 hops x 1 us = 14 us.
    """
    topo = Topology.parse("tpu7x:4x4x4")
    assert topo.num_devices == 128
    t = collective_time("all_reduce", topo, range(128), 4)
    assert t.bandwidth_seconds == pytest.approx(4 * 2 * 127 / 128 / 600e9)
    assert t.ici_hops == 14 and t.dcn_steps == 0
    assert t.latency_seconds == pytest.approx(14e-6)
    seconds = estimate_seconds("allreduce", topo, list(range(128)), 4)
    assert seconds == pytest.approx(14e-6 + 4 * 2 * 127 / 128 / 600e9)
    assert seconds >= 10e-6  # microseconds, not the bandwidth-only 0.013 ns


def test_ring_line_all_to_all_and_send() -> None:
    """Hops along wrapped and unwrapped axes; the all-to-all quarter; a send's path.

    v5e 2x4 (no wraparound: a pod side is 16): L = 400 / 4 / 2 = 50 GB/s; both axes spanned,
    busbw = 50 + 50 = 100 GB/s. All-gather of S = 33,554,432 B (the scaling book's
    bf16[2048, 8192]): 7/8 * S / 100e9 = 293.6 us; hops on lines of 2 and 4 chips: 1 + 3 = 4,
    so 4 us; total 297.6 us (the book's 373 us at its 9e10 B/s per link: 0.80x).

    v5p 4x4x4, 4 chips along x (wrapped ring, 2 x 100 GB/s): all-to-all of b = 1 MiB:
    0.75 b / 200e9 / 4 = 0.983 us + 2 hops = 2.983 us. A send from x=0 to x=2: 2 hops (either
    way round), b / 100e9 = 10.49 us + 2 us.

    The whole 4x4x4 (64 chips, 3 wrapped axes, 600 GB/s): reduce-scatter of S = 64 MiB:
    63/64 * S / 600e9 = 110.1 us, a third of one axis's 330.3 us; hops 2 + 2 + 2 = 6.
    """
    v5e = Topology.parse("v5e:2x4")
    s = 33_554_432
    t = collective_time("all_gather_into_tensor", v5e, range(8), s)
    assert t.bandwidth_seconds == pytest.approx(7 / 8 * s / 100e9)
    assert t.ici_hops == 4
    assert t.seconds == pytest.approx(297.6e-6, rel=1e-3)

    cube = Topology.parse("v5p:4x4x4")
    ring = [int(r) for r in cube.rank_grid()[0, :, 0, 0, 0]]
    b = 1 << 20
    a2a = collective_time("all_to_all_single", cube, ring, b)
    assert a2a.seconds == pytest.approx(0.75 * b / 200e9 / 4 + 2e-6)
    send = collective_time("send_recv", cube, [ring[0], ring[2]], b)
    assert send.ici_hops == 2
    assert send.seconds == pytest.approx(b / 100e9 + 2e-6)

    big = 64 << 20
    whole = collective_time("reduce_scatter_tensor", cube, range(64), big)
    one_axis = collective_time("reduce_scatter_tensor", cube, ring, big)
    assert whole.bandwidth_seconds == pytest.approx(63 / 64 * big / 600e9)
    assert one_axis.bandwidth_seconds == pytest.approx(0.75 * big / 200e9)
    assert whole.ici_hops == 6


def test_dcn_steps_across_slices() -> None:
    """v5p 4x4x4 x 4 slices, one chip per slice (ranks 0, 64, 128, 192): no ICI hop; DCN
    recursive doubling over 4 slices: log2 4 = 2 steps of 10 us, twice for an all-reduce:
    40 us. Bandwidth: 2 * 3/4 * 1 MiB / (50 Gb/s / 8 = 6.25e9 B/s) = 251.7 us.
    """
    topo = Topology.parse("v5p:4x4x4", 4)
    t = collective_time("all_reduce", topo, [0, 64, 128, 192], 1 << 20)
    assert (t.ici_hops, t.dcn_steps) == (0, 4)
    assert t.latency_seconds == pytest.approx(40e-6)
    assert t.bandwidth_seconds == pytest.approx(2 * 0.75 * (1 << 20) / 6.25e9)
    with pytest.raises(ValueError, match="unknown collective op 'gather'"):
        collective_time("gather", topo, [0, 1], 4)


def test_groups_across_slices_are_hierarchical() -> None:
    """v5p 4x4x4 x 2 slices; the group: one wraparound ring of 4 chips in each slice (8 ranks,
    ``m = 4`` a slice, ``s = 2`` slices), as libtpu compiles it (an ICI collective over each
    slice's part, 1/m of the message over DCN). ``S = 8 MiB``; ICI: one wrapping axis, 2 x 100
    GB/s; DCN: 50 Gb/s = 6.25 GB/s a chip.

    all-gather: ``3/4 S / 200e9 + (S/4) x 1/2 / 6.25e9`` = 31.5 us + 167.8 us = 199.2 us
    (priced flat over DCN it was ``7/8 S / 6.25e9`` = 1,174 us); reduce-scatter the same;
    all-reduce twice both terms. Latency: ring of 4 (2 hops) + 1 DCN step (log2 2), twice for
    the all-reduce. One chip a slice (ranks 0 and 64) stays flat: ``1/2 S / 6.25e9``."""
    topo = Topology.parse("v5p:4x4x4", 2)
    ring = [int(r) for r in topo.rank_grid()[0, :, 0, 0, 0]]
    group = ring + [r + topo.devices_per_slice for r in ring]
    size = 8 << 20
    ici, dcn = 0.75 * size / 200e9, size / 4 * 0.5 / 6.25e9
    for op, passes in (("all_gather_into_tensor", 1), ("reduce_scatter_tensor", 1),
                       ("all_reduce", 2)):
        t = collective_time(op, topo, group, size)
        assert t.bandwidth_seconds == pytest.approx(passes * (ici + dcn)), op
        assert (t.ici_hops, t.dcn_steps) == (2 * passes, passes)
        assert t.basis.startswith("hierarchical: ICI")
    assert ici + dcn == pytest.approx(199.2e-6, rel=1e-3)
    pair = collective_time("all_gather_into_tensor", topo, [0, topo.devices_per_slice], size)
    assert pair.bandwidth_seconds == pytest.approx(0.5 * size / 6.25e9)
    assert pair.basis.startswith("DCN")
    a2a = collective_time("all_to_all_single", topo, group, size)
    assert a2a.bandwidth_seconds == pytest.approx(7 / 8 * size / 6.25e9)


def test_flops_per_token_llama3_8b() -> None:
    """Llama 3 8B: dim 4096, 32 layers, 32 heads of 128, 8 kv heads, ffn 14336, vocab 128256.

    Per layer: q, o 2 x 4096^2 = 33,554,432; k, v 2 x 4096 x 1024 = 8,388,608; MLP
    3 x 4096 x 14336 = 176,160,768; norms 2 x 4096 = 8,192; sum 218,112,000. x 32 =
    6,979,584,000. Embedding and output 128256 x 4096 = 525,336,576 each; final norm 4,096.
    All: 8,030,261,248 (the published 8.03B). Non-embedding (less the token embedding, the
    output stays): 7,504,924,672; 6N = 45,029,548,032.
    Attention at seq 8192: 6 x 32 x 32 x (2 x 128) x 8192 = 12,884,901,888.
    TorchTitan (no causal discount): 57,914,449,920 per token; MaxText (halved):
    45,029,548,032 + 6,442,450,944 = 51,471,998,976.
    """
    s = LLAMA3_8B
    assert s.layer_params == 218_112_000
    assert s.params == 8_030_261_248
    assert s.non_embedding_params == 7_504_924_672
    assert flops_per_token(s, 8192) == 57_914_449_920
    assert flops_per_token(s, 8192, "maxtext") == 51_471_998_976
    with pytest.raises(ValueError, match="convention"):
        flops_per_token(s, 8192, "palm")  # type: ignore[arg-type]


def test_flops_per_device() -> None:
    """Llama 3 8B, global batch 16 of 8192, dp 8 x tp 2 = 16 devices: 16 x 8192 / 16 = 8192
    tokens per device x 57,914,449,920 = 474,435,173,744,640 FLOPs per device per step.
    """
    f = flops_per_device(LLAMA3_8B, global_batch=16, seq_len=8192, dp=8, tp=2)
    assert f == pytest.approx(8192 * 57_914_449_920)
    with pytest.raises(ValueError, match="global_batch=12 does not split over dp=8"):
        flops_per_device(LLAMA3_8B, global_batch=12, seq_len=8192, dp=8)


def test_step_estimate_overlap_rules() -> None:
    """1e15 FLOPs at 1e15 FLOP/s = 1 s of compute, 8192 tokens.

    (a) 0.5 s of FSDP (overlappable) + 0.2 s of TP (critical): exposed = 0.2 + max(0, 0.5 - 1)
        = 0.2; step 1.2 s; MFU bound 1 / 1.2 = 0.8333; 8192 / 1.2 = 6826.7 tokens/s.
    (b) 1.5 s of FSDP alone: exposed = 1.5 - 1 = 0.5; step 1.5 s; MFU bound 0.6667.
    """
    a = step_estimate(flops_per_device=1e15, peak_flops_per_s=1e15, tokens_per_device=8192,
                      overlappable_comm_seconds=0.5, critical_comm_seconds=0.2,
                      hbm_capacity_bytes=96 * GiB)
    assert a.compute_seconds == pytest.approx(1.0)
    assert a.comm_seconds == pytest.approx(0.7)
    assert a.exposed_comm_seconds == pytest.approx(0.2)
    assert a.step_seconds == pytest.approx(1.2)
    assert a.mfu_bound == pytest.approx(1 / 1.2)
    assert a.tokens_per_second_per_device == pytest.approx(8192 / 1.2)
    b = step_estimate(flops_per_device=1e15, peak_flops_per_s=1e15, tokens_per_device=8192,
                      overlappable_comm_seconds=1.5)
    assert b.exposed_comm_seconds == pytest.approx(0.5)
    assert b.step_seconds == pytest.approx(1.5)
    assert b.mfu_bound == pytest.approx(1 / 1.5)
    with pytest.raises(ValueError, match="critical_comm_seconds must not be negative"):
        step_estimate(flops_per_device=1, peak_flops_per_s=1, tokens_per_device=1,
                      critical_comm_seconds=-1)


def test_step_estimate_json_fields() -> None:
    """The report's ``"step"`` object has exactly the issue's fields and the model FLOPs its
    MFU bound is computed from, then the predicted step's (issue 53; None without the HBM
    bandwidth and MXU size), JSON-serialisable."""
    est = step_estimate(flops_per_device=1e15, peak_flops_per_s=1e15, tokens_per_device=1)
    fields = ["flops_per_device", "model_flops_per_device", "compute_seconds", "comm_seconds", "exposed_comm_seconds",
              "step_seconds", "mfu_bound", "tokens_per_second_per_device", "hbm_peak_bytes",
              "hbm_capacity_bytes", "predicted_seconds", "predicted_mfu",
              "predicted_matmul_seconds", "predicted_memory_seconds",
              "predicted_exposed_comm_seconds", "predicted_tokens_per_second_per_device",
              "memory_bound_bytes"]
    assert list(est.to_json()) == fields
    assert [f.name for f in __import__("dataclasses").fields(StepEstimate)] == fields
    assert json.loads(json.dumps(est.to_json()))["hbm_peak_bytes"] is None


def test_tp_collectives_are_exposed_fsdp_are_hidden() -> None:
    """v5p 2x2x1 (4 devices) as dp 2 x tp 2: plan_mesh puts tp on ranks (0, 1), dp on (0, 2).

    Llama 3 8B, 1 sequence of 8192 per dp rank: TP all-reduces 4 per layer (2 forward, 2
    backward) x 32 + 2 (embedding, output) = 130 calls of 1 x 8192 x 4096 x 2 B = 64 MiB, all
    on the critical path; FSDP all-gathers of a block's TP half in bf16: 218,112,000 / 2 x 2 B.
    Compute 8192 x 57.9e9 / 2 / 459e12 = 0.517 s per device, and the step bound is at least
    compute + TP.
    """
    topo = Topology.parse("v5p:2x2x1")
    found = fsdp_tp_collectives(LLAMA3_8B, topo, tp=2, batch_per_dp_rank=1, seq_len=8192)
    tp_rows = [c for c in found if not c.overlappable]
    assert [c.calls for c in tp_rows] == [128, 2]
    assert {c.size_bytes for c in tp_rows} == {8192 * 4096 * 2}
    ag = next(c for c in found if c.name == "fsdp all_gather block (forward)")
    assert ag.size_bytes == 218_112_000 // 2 * 2 and ag.calls == 32 and ag.group_size == 2
    step, ranked = estimate_fsdp_tp_step(LLAMA3_8B, topo, global_batch=2, seq_len=8192, tp=2)
    assert step.compute_seconds == pytest.approx(8192 * 57_914_449_920 / 2 / 459e12)
    critical = sum(c.seconds for c in tp_rows)
    assert step.exposed_comm_seconds >= critical
    assert step.step_seconds == pytest.approx(step.compute_seconds + step.exposed_comm_seconds)
    assert step.hbm_capacity_bytes == 95 * GiB
    assert ranked[0].seconds == max(c.seconds for c in found)


# MaxText's TPU7x recipes (AI-Hypercomputer/tpu-recipes, training/ironwood): pure FSDP over all
# devices, sequence 8192, per-device batch counted per JAX device (TensorCore).
PUBLISHED = [
    # (shape, topology, sequences per device, measured s/step, measured MFU)
    (LLAMA3_1_70B, "tpu7x:4x8x8", 2, 12.27, 0.520),   # 256 chips, 512 devices
    (LLAMA3_1_405B, "tpu7x:4x8x8", 3, 98.34, 0.547),  # 256 chips
    (LLAMA3_1_70B, "tpu7x:4x4x4", 2, 12.20, 0.523),   # 64 chips, 128 devices
]


@pytest.mark.parametrize("shape,topology,per_device,measured_s,measured_mfu", PUBLISHED)
def test_bound_holds_against_published_results(shape, topology, per_device, measured_s,
                                               measured_mfu) -> None:
    """A lower bound above a measured step, or an MFU bound below a measured MFU, is wrong.

    70B on 512 devices, MaxText's count (their MFU's): 449.23e9 FLOPs/token x 16,384 tokens per
    device = 7.360e15 FLOPs; at 1153.5e12 FLOP/s: 6.381 s. FSDP: per block an all-gather of
    855.4M bf16 parameters (1.711 GB) forward and backward and a reduce-scatter of fp32 grads
    (3.423 GB) over 512 devices (3 wrapped axes, 600 GB/s): 2.86 + 2.86 + 5.70 ms, x 80 blocks,
    + the embedding/output unit: 0.94 s, under the compute, so hidden: bound 6.381 s = 0.52 x
    12.27 s, MFU bound 1.0. The count also reproduces the published MFU: 6.381 / 12.27 =
    52.0 %; 405B: 2524.0e9 x 24,576 / 1153.5e12 = 53.77 s / 98.34 = 54.7 %.
    """
    topo = Topology.parse(topology)
    for convention in ("maxtext", "torchtitan"):
        step, _ = estimate_fsdp_tp_step(shape, topo, global_batch=per_device * topo.num_devices,
                                        seq_len=8192, convention=convention)
        assert step.step_seconds <= measured_s, (convention, step)
        assert step.mfu_bound >= measured_mfu, (convention, step)
    # MaxText's own MFU is its FLOP count at its measured step: ours must match it.
    implied = step_estimate(flops_per_device=flops_per_device(
        shape, global_batch=per_device * topo.num_devices, seq_len=8192, dp=topo.num_devices,
        convention="maxtext"), peak_flops_per_s=1153.5e12, tokens_per_device=1).compute_seconds
    assert implied / measured_s == pytest.approx(measured_mfu, abs=0.002)
