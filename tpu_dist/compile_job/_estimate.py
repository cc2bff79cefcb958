"""How long a training step must take: the collective, compute and step models (pure).

Three models, each a few lines of arithmetic on the hardware facts of
:class:`tpu_dist.mesh.Generation` and the chip layout of :class:`tpu_dist.mesh.Topology`; no JAX,
no torch, nothing runs. Compile-only mode uses the first for each collective's ``est_seconds``
(:func:`tpu_dist.compile_job.estimate_seconds`); the other two give a step's lower bound.

**One collective** (:func:`collective_time`): ``t = bandwidth term + latency term``, the JAX
scaling book's model ("How to Scale Your Model", the sharded-matrices chapter).

* Bandwidth: the message size over the topology's bus-bandwidth bound for the group
  (:func:`tpu_dist.mesh.expected_busbw`, :func:`tpu_dist.mesh.bus_factor`): an all-gather or a
  reduce-scatter over one wraparound torus axis moves ``(n-1)/n V`` through links carrying
  ``W = 2 L`` (both directions of ``L`` GB/s per link), so about ``V / W``; an all-reduce twice
  that; spreading the group over several axes adds their rings, dividing the time by their
  number; a group across slices is priced as XLA compiles it (below). The bound is per chip: on TPU7x a ring over
  both devices of each chip passes between them over the chip's die-to-die link, so each ICI
  link still carries each byte once (die-to-die bandwidth is not published; not charged). An
  all-to-all over ICI takes a quarter of an all-gather of the same bytes (the book's
  ``V / (4 W)``: each block goes to one chip, on average ``n / 4`` links away on a
  bidirectional ring, so each link carries a quarter of what an all-gather puts on it); over
  DCN (a switched network, the NIC the bound) it does not.
* **Across slices** (decision 0034): an all-gather, reduce-scatter or all-reduce over a group
  with ``m > 1`` ranks in each of ``s`` slices compiles (libtpu, checked on ``v5p:4x4x4`` x 2,
  8 ranks a slice) to an ICI collective over each slice's ``m`` ranks and a MegaScale
  transfer across slices of only ``1/m`` of the message: an all-gather first gathers its
  ``s`` shards over DCN (``S / m`` out), then gathers over ICI (``S`` out); a reduce-scatter
  reduces the whole input over ICI, then reduce-scatters its ``S / m`` part over DCN; an
  all-reduce reduces over ICI, all-reduces ``S / m`` over DCN and gathers back over ICI. So
  ``t = S x bus_factor(op, m) / ICI busbw of one slice's part + (S / m) x bus_factor(op, s) /
  DCN per chip``. Any other group across slices (one rank a slice, unequal parts, an
  all-to-all, a broadcast) is priced over the whole group at the lesser of ICI and DCN.
* Latency: ``hops x 1 us`` (the book: about 1 us per ICI hop). An all-gather on a bidirectional
  ring of ``k`` chips moves data ``k // 2`` hops in each direction; along an axis that does not
  wrap around (a line of chips) ``k - 1``. A group spanning several axes runs the axes one
  after the other (each block crosses every spanned axis), so their hops add. **Why ring hops
  and not a tree's log**: XLA:TPU's collectives are rings along the torus axes; nothing in them
  takes a shortcut across the torus, so the data from the farthest chip really crosses that many
  links (a tree on a torus still needs the diameter). An all-reduce is a reduce-scatter then an
  all-gather: twice the hops. A send goes the shortest torus path between its two chips. The
  two TensorCores of one TPU7x chip add one hop (their die-to-die link; its latency is not
  published). Across slices the DCN part is a switched network: ``ceil(log2 slices)`` steps
  (recursive doubling) of :data:`DCN_STEP_SECONDS` each, an *assumed* figure (no Cloud TPU page
  publishes DCN latency), twice for an all-reduce.

Worked example (the issue's): a 4-byte all_reduce over 128 TPU7x devices, ``tpu7x:4x4x4``
(64 chips, every axis wraps around): bandwidth ``4 * 2 * 127/128 / 600e9 = 0.013 ns``
(3 axes x 2 x 100 GB/s), latency ``2 * (4//2 + 4//2 + 4//2 + 1) * 1 us = 14 us`` (two passes,
3 axes of 4 chips plus the chip's two cores). It is all latency, as it should be.

**Compute** (:func:`flops_per_token`, :func:`flops_per_device`): a Llama-style decoder's
training FLOPs per token, TorchTitan's count ``6 N + 12 L H d_h s`` (``N`` the parameters
without the token embedding, ``L`` layers, ``H`` heads of ``d_h``, sequence ``s``: forward
``2``, backward ``4`` FLOPs per weight and per attention multiply-add, the attention's two
``s x s`` matmuls counted over the whole square: **no causal discount**), or MaxText's, which
halves the attention term (a causal mask skips half the square). Remat (recomputation) is not
counted: these are model FLOPs, the numerator of MFU.

**A step** (:func:`step_estimate`, :func:`estimate_fsdp_tp_step`): compute at the device's
peak bf16 rate; communication split into what can overlap compute (FSDP's prefetched
all-gathers and asynchronous reduce-scatters, hidden up to the compute time) and what sits on
the critical path (tensor parallelism's activation collectives: the next matmul waits for
them); ``step >= compute + exposed``, the exposed communication being the critical path plus
whatever overlappable communication exceeds compute. The MFU bound is the model FLOPs over
(step bound x peak): no real step does better. Lower bounds, not predictions: they leave out
memory-bound work (norms, softmax, optimizer), remat, kernel efficiency and stragglers.

**A predicted step** (:func:`predict_step`, beside the bound; decision 0034): the time to
expect, from three terms and the bound's overlap rule, with one fitted parameter.

* Matmuls (every op with a FLOP formula: :mod:`._op_costs`) at
  ``padded FLOPs / (peak x MATMUL_EFFICIENCY)``. Padded FLOPs (:func:`padded_matmul_flops`):
  each matmul's ``(M, K, N)`` rounded up to the MXU's tile (:attr:`tpu_dist.mesh.Generation.
  mxu_size`: 128 on v4/v5e/v5p, 256 on v6e/TPU7x), its FLOPs scaled by the padded volume over
  the real one (the MXU multiplies whole tiles; the JAX scaling book, "How to Scale Your
  Model", the TPU chapter). Attention's head dimension of 128 on a 256-wide MXU runs at half
  rate this way. :data:`MATMUL_EFFICIENCY` is the fraction of the padded peak the compiled
  matmuls reach (pipeline fill, VMEM traffic, scheduling): fitted once, on MaxText's Llama 3.1
  70B on 256 TPU7x chips, and used for every generation and model.
* Memory-bound work (everything else) at ``bytes / HBM bandwidth`` (the generation's
  ``hbm_gbytes_per_s_per_chip``): the bytes its ops read and write. The step meter counts them
  as the ops run, under a fusion rule (:class:`~._op_costs.FusedBytes`: the memory-bound ops
  between two matmuls are one fusion); the analytic decoder
  (:func:`decoder_step_costs`) counts what an XLA program that fuses each elementwise chain
  moves.
* Recomputation: the matmuls and memory-bound ops a checkpointed backward runs again are in
  both counts (the meter sees them run; the analytic decoder is told what is recomputed).
* Communication: the bound's terms (each collective's latency plus bandwidth), the
  overlappable part (FSDP's) hidden under the predicted compute (matmuls + memory-bound work),
  the critical path (tensor parallelism's) added whole.

``predicted = matmul + memory + critical + max(0, overlappable - (matmul + memory))``;
``predicted_mfu = model FLOPs / (predicted x peak)``. It is never below the bound: padded
FLOPs are at least the FLOPs, the efficiency is below 1, and memory time is not negative.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from tpu_dist.mesh import Topology, bus_factor, expected_busbw, plan_mesh

__all__ = [
    "DCN_STEP_SECONDS",
    "MATMUL_EFFICIENCY",
    "Prediction",
    "decoder_step_costs",
    "padded_matmul_flops",
    "predict_step",
    "ICI_HOP_SECONDS",
    "LLAMA3_1_70B",
    "LLAMA3_1_405B",
    "LLAMA3_8B",
    "QWEN3_8B",
    "QWEN3_32B",
    "CollectiveTime",
    "DecoderShape",
    "StepCollective",
    "StepEstimate",
    "collective_time",
    "estimate_fsdp_tp_step",
    "flops_per_device",
    "flops_per_token",
    "fsdp_tp_collectives",
    "step_estimate",
]

ICI_HOP_SECONDS = 1e-6
"""Latency of one ICI hop: about 1 us (the JAX scaling book, "A note on ICI latency")."""

DCN_STEP_SECONDS = 10e-6
"""Latency of one step of a collective across slices over DCN. **Assumed**, not published:
the Cloud TPU docs give DCN bandwidth only; 10 us is a datacenter network's one-way latency
with RDMA-class NICs. Replace it when a measured figure exists."""

FlopsConvention = Literal["torchtitan", "maxtext"]


# -- one collective -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveTime:
    """The modelled time of one collective call, by term (module docstring)."""

    bandwidth_seconds: float
    """Message bytes over the group's bus-bandwidth bound."""
    latency_seconds: float
    """``ici_hops * ICI_HOP_SECONDS + dcn_steps * DCN_STEP_SECONDS``."""
    ici_hops: int
    """ICI hops on the critical path (both passes of an all-reduce)."""
    dcn_steps: int
    """DCN steps (0 within one slice)."""
    basis: str
    """Which links bound the bandwidth (:attr:`tpu_dist.mesh.Expectation.basis`)."""

    @property
    def seconds(self) -> float:
        """The call's time: bandwidth plus latency."""
        return self.bandwidth_seconds + self.latency_seconds


_PASSES = {
    "all_reduce": 2,  # a reduce-scatter, then an all-gather
    "all_gather_into_tensor": 1,
    "reduce_scatter_tensor": 1,
    "all_to_all_single": 1,
    "broadcast": 1,
    "send_recv": 1,
}


def collective_time(
    op: str, topology: Topology, ranks: Sequence[int], size_bytes: int
) -> CollectiveTime | None:
    """The modelled time of one ``op`` over the global ``ranks`` (module docstring).

    Args:
        op: A ``tpu-dist-bench`` op name (``all_reduce``, ``all_gather_into_tensor``,
            ``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, ``send_recv``).
        topology: The chips the ranks drive.
        ranks: The group's global ranks.
        size_bytes: nccl-tests' message size ``S``: an all-gather's *output*, a
            reduce-scatter's *input*, an all-reduce's buffer, a send's message.

    Returns:
        The time by term, or None when the group uses no link (one rank, or the two devices of
        one TPU7x chip).

    Raises:
        ValueError: ``op`` is not one of the names above.
    """
    if op not in _PASSES:
        raise ValueError(f"unknown collective op {op!r}; the model knows {sorted(_PASSES)}")
    ranks_arr = np.asarray(list(ranks), dtype=np.int64)
    expectation = expected_busbw(topology, ranks_arr, op)
    if expectation is None:
        return None
    n = ranks_arr.size
    hierarchical = _hierarchical(op, topology, ranks_arr, size_bytes)
    if hierarchical is not None:
        bandwidth, basis = hierarchical
    else:
        bandwidth = size_bytes * bus_factor(op, n) / (expectation.busbw_gbytes_per_s * 1e9)
        basis = expectation.basis
        if op == "all_to_all_single" and not basis.startswith("DCN"):
            bandwidth /= 4
    ici_hops, dcn_steps = _hops(op, topology, ranks_arr)
    passes = _PASSES[op]
    ici_hops, dcn_steps = passes * ici_hops, passes * dcn_steps
    return CollectiveTime(
        bandwidth_seconds=bandwidth,
        latency_seconds=ici_hops * ICI_HOP_SECONDS + dcn_steps * DCN_STEP_SECONDS,
        ici_hops=ici_hops,
        dcn_steps=dcn_steps,
        basis=basis,
    )


_HIERARCHICAL = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
"""The ops XLA splits into an ICI part within each slice and a DCN part across slices."""


def _hierarchical(op: str, topology: Topology, ranks: np.ndarray,
                  size_bytes: int) -> tuple[float, str] | None:
    """The bandwidth term and basis of ``op`` over a group spanning slices with ``m > 1``
    ranks in each, as XLA compiles it (module docstring, "Across slices"); None for any other
    group (one slice, one rank a slice, unequal parts) or op."""
    slices = topology.slice_of(ranks)
    ids, counts = np.unique(slices, return_counts=True)
    if op not in _HIERARCHICAL or ids.size < 2 or counts.min() != counts.max() or counts[0] < 2:
        return None
    s, m = int(ids.size), int(counts[0])
    ici, ici_basis = 0.0, "no ICI link (one chip a slice)"
    for slice_id in ids:
        part = expected_busbw(topology, ranks[slices == slice_id], op)
        if part is not None:
            ici = max(ici, size_bytes * bus_factor(op, m) / (part.busbw_gbytes_per_s * 1e9))
            ici_basis = part.basis
    dcn = topology.generation.dcn_gbits_per_s / 8
    dcn_seconds = size_bytes / m * bus_factor(op, s) / (dcn * 1e9)
    return ici + dcn_seconds, (f"hierarchical: {ici_basis} within each slice's {m}, then DCN "
                               f"{dcn:g} GB/s per chip over {s} slices on 1/{m} of the message")


def _hops(op: str, topology: Topology, ranks: np.ndarray) -> tuple[int, int]:
    """ICI hops and DCN steps of one pass of ``op`` over ``ranks`` (module docstring)."""
    slices = topology.slice_of(ranks)
    num_slices = np.unique(slices).size
    if op == "send_recv":
        hops = topology.ici_hops(ranks[:-1], ranks[1:]) if ranks.size > 1 else np.zeros(1)
        ici = int(hops.max(initial=0))
        return max(ici, 0), int(np.any(hops < 0))
    ici = 0
    wrap = topology.wraparound
    for s in np.unique(slices):
        mine = ranks[slices == s]
        coords = topology.coords_of(mine)
        hops = 0
        for axis, side in enumerate(topology.shape):
            k = np.unique(coords[:, axis]).size
            if k > 1:
                hops += k // 2 if (wrap[axis] and k == side) else k - 1
        if np.unique(coords, axis=0).shape[0] < mine.size:
            hops += 1  # two devices of one chip: the die-to-die step
        ici = max(ici, hops)
    dcn = math.ceil(math.log2(num_slices)) if num_slices > 1 else 0
    return ici, dcn


# -- compute ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """A Llama-style decoder: grouped-query attention, SwiGLU MLP, RMSNorm, untied output.

    Parameters per layer: ``q`` and ``o`` projections ``dim x (n_heads * head_dim)``, ``k`` and
    ``v`` ``dim x (n_kv_heads * head_dim)``, the MLP ``3 x dim x ffn_dim``, two norms of
    ``dim``; plus the token embedding and the output projection (``vocab x dim`` each) and a
    final norm.
    """

    name: str
    dim: int
    """Model width (``n_heads * head_dim`` unless ``attention_head_dim`` is set)."""
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    """The MLP's hidden width."""
    vocab_size: int
    attention_head_dim: int | None = None
    """Each head's width when heads are not ``dim / n_heads`` wide (Qwen3: 64 heads of 128 on
    width 5120); None: ``dim / n_heads``."""

    def __post_init__(self) -> None:
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)!r}")
        if self.attention_head_dim is not None and self.attention_head_dim <= 0:
            raise ValueError(f"attention_head_dim must be positive, got {self.attention_head_dim!r}")
        if (self.attention_head_dim is None and self.dim % self.n_heads) or (
                self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"dim must split into n_heads heads (or pass attention_head_dim) and n_heads "
                f"into n_kv_heads groups, got {self.dim=} {self.n_heads=} {self.n_kv_heads=}"
            )

    @property
    def head_dim(self) -> int:
        if self.attention_head_dim is not None:
            return self.attention_head_dim
        return self.dim // self.n_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return 2 * self.dim * q + 2 * self.dim * kv + 3 * self.dim * self.ffn_dim + (
            2 * self.dim
        )

    @property
    def embedding_params(self) -> int:
        """The token embedding's parameters (``vocab x dim``)."""
        return self.vocab_size * self.dim

    @property
    def params(self) -> int:
        """All parameters: embedding, blocks, final norm, output projection."""
        return 2 * self.embedding_params + self.n_layers * self.layer_params + self.dim

    @property
    def non_embedding_params(self) -> int:
        """``params`` less the token embedding (a lookup, no FLOPs); the output projection, a
        real matmul, stays (as TorchTitan counts it)."""
        return self.params - self.embedding_params


LLAMA3_8B = DecoderShape(
    name="Llama 3 8B", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
    vocab_size=128256,
)
LLAMA3_1_70B = DecoderShape(
    name="Llama 3.1 70B", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
    vocab_size=128256,
)
LLAMA3_1_405B = DecoderShape(
    name="Llama 3.1 405B", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
    vocab_size=128256,
)
QWEN3_8B = DecoderShape(
    name="Qwen3 8B (without its QK-norm weights)", dim=4096, n_layers=36, n_heads=32,
    n_kv_heads=8, ffn_dim=12288, vocab_size=151936, attention_head_dim=128,
)
QWEN3_32B = DecoderShape(
    name="Qwen3 32B (without its QK-norm weights)", dim=5120, n_layers=64, n_heads=64,
    n_kv_heads=8, ffn_dim=25600, vocab_size=151936, attention_head_dim=128,
)


def flops_per_token(
    shape: DecoderShape, seq_len: int, convention: FlopsConvention = "torchtitan"
) -> float:
    """Training FLOPs (forward and backward) per token of a ``seq_len`` sequence.

    ``"torchtitan"``: ``6 N + 6 L H (2 d_h) s`` with ``N`` the non-embedding parameters, no
    causal discount (TorchTitan's ``get_num_flop_per_token``). ``"maxtext"``: the attention
    term halved for the causal mask (MaxText's ``calculate_tflops_training_per_device``;
    MaxText also leaves the norms' weights out, under 0.01 % of ``N``, kept here).
    """
    if convention not in ("torchtitan", "maxtext"):
        raise ValueError(f"convention must be 'torchtitan' or 'maxtext', got {convention!r}")
    attention = 6 * shape.n_layers * shape.n_heads * 2 * shape.head_dim * seq_len
    if convention == "maxtext":
        attention /= 2
    return 6 * shape.non_embedding_params + attention


def flops_per_device(
    shape: DecoderShape,
    *,
    global_batch: int,
    seq_len: int,
    dp: int,
    tp: int = 1,
    convention: FlopsConvention = "torchtitan",
) -> float:
    """Training FLOPs of one device for one step of ``global_batch`` sequences of ``seq_len``.

    The step's tokens split over ``dp`` data-parallel ranks (replicas and FSDP shards alike)
    and each rank's work over ``tp`` tensor-parallel ranks: ``flops_per_token * global_batch *
    seq_len / (dp * tp)``.

    Raises:
        ValueError: ``global_batch`` does not split over ``dp``.
    """
    if global_batch % dp:
        raise ValueError(
            f"global_batch={global_batch} does not split over dp={dp} data-parallel ranks; "
            "make it a multiple of dp"
        )
    tokens = global_batch * seq_len
    return flops_per_token(shape, seq_len, convention) * tokens / (dp * tp)


# -- a step -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepEstimate:
    """One training step's lower bound, per device: the report's ``"step"`` object."""

    flops_per_device: float
    """FLOPs one device computes per step (counted: recomputation under activation
    checkpointing included)."""
    model_flops_per_device: float
    """The step's *model* FLOPs per device, MFU's numerator: TorchTitan's 6N + 12 L H d_h s a
    token (no recomputation, no causal discount). Measured as 3x the forward pass's FLOPs; equal
    to ``flops_per_device`` when not told otherwise."""
    compute_seconds: float
    """``flops_per_device`` at the device's peak bf16 rate."""
    comm_seconds: float
    """All modelled communication per step, overlappable or not."""
    exposed_comm_seconds: float
    """The part that cannot hide behind compute: critical-path collectives plus whatever
    overlappable communication exceeds the compute time."""
    step_seconds: float
    """The lower bound: ``compute_seconds + exposed_comm_seconds``."""
    mfu_bound: float
    """``model_flops_per_device / (step_seconds * peak)``: the best MFU the step can reach."""
    tokens_per_second_per_device: float
    """The step's tokens per device over ``step_seconds``: an upper bound."""
    hbm_peak_bytes: int | None
    """Peak HBM one device needs for the step; None when not tracked."""
    hbm_capacity_bytes: int | None
    """The device's HBM (:attr:`tpu_dist.mesh.Generation.hbm_bytes_per_device`)."""
    predicted_seconds: float | None = None
    """The step to expect (:func:`predict_step`); None when the generation lacks the HBM
    bandwidth or MXU size the prediction needs."""
    predicted_mfu: float | None = None
    """``model_flops_per_device / (predicted_seconds * peak)``."""
    predicted_matmul_seconds: float | None = None
    """The prediction's matmul term: padded FLOPs at ``peak x MATMUL_EFFICIENCY``."""
    predicted_memory_seconds: float | None = None
    """The prediction's memory-bound term: bytes at the HBM bandwidth."""
    predicted_exposed_comm_seconds: float | None = None
    """Communication the predicted compute does not hide."""
    predicted_tokens_per_second_per_device: float | None = None
    """The step's tokens per device over ``predicted_seconds``."""
    memory_bound_bytes: float | None = None
    """Bytes the memory-bound ops read and write (the prediction's input)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def step_estimate(
    *,
    flops_per_device: float,
    peak_flops_per_s: float,
    tokens_per_device: float,
    overlappable_comm_seconds: float = 0.0,
    critical_comm_seconds: float = 0.0,
    hbm_capacity_bytes: int | None = None,
    hbm_peak_bytes: int | None = None,
    model_flops_per_device: float | None = None,
    matmul_flops: MatmulFlops | None = None,
    memory_bytes: float = 0.0,
    hbm_bytes_per_s: float | None = None,
    mxu_size: int | None = None,
) -> StepEstimate:
    """The step's lower bound from its compute and communication, and the predicted step
    (module docstring).

    ``model_flops_per_device`` is MFU's numerator when it differs from the FLOPs computed (a
    measured step that recomputes activations); default: ``flops_per_device``. The prediction
    (:func:`predict_step`) needs ``hbm_bytes_per_s`` and ``mxu_size`` (else its fields are
    None); ``matmul_flops`` are the FLOPs by matmul shape (default: ``flops_per_device``, not
    padded), ``memory_bytes`` the memory-bound ops' bytes.

    Raises:
        ValueError: a non-positive peak, or negative FLOPs, tokens or seconds.
    """
    if model_flops_per_device is None:
        model_flops_per_device = flops_per_device
    if not peak_flops_per_s > 0:
        raise ValueError(f"peak_flops_per_s must be positive, got {peak_flops_per_s!r}")
    for name, value in (("flops_per_device", flops_per_device),
                        ("model_flops_per_device", model_flops_per_device),
                        ("tokens_per_device", tokens_per_device),
                        ("overlappable_comm_seconds", overlappable_comm_seconds),
                        ("critical_comm_seconds", critical_comm_seconds)):
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value!r}")
    compute = flops_per_device / peak_flops_per_s
    exposed = critical_comm_seconds + max(0.0, overlappable_comm_seconds - compute)
    step = compute + exposed
    predicted: dict[str, float] = {}
    if hbm_bytes_per_s is not None and mxu_size is not None:
        p = predict_step(
            matmul_flops={None: flops_per_device} if matmul_flops is None else matmul_flops,
            memory_bytes=memory_bytes, peak_flops_per_s=peak_flops_per_s,
            hbm_bytes_per_s=hbm_bytes_per_s, mxu_size=mxu_size,
            overlappable_comm_seconds=overlappable_comm_seconds,
            critical_comm_seconds=critical_comm_seconds)
        predicted = dict(
            predicted_seconds=p.seconds,
            predicted_mfu=model_flops_per_device / (p.seconds * peak_flops_per_s)
            if p.seconds > 0 else 0.0,
            predicted_matmul_seconds=p.matmul_seconds,
            predicted_memory_seconds=p.memory_seconds,
            predicted_exposed_comm_seconds=p.exposed_comm_seconds,
            predicted_tokens_per_second_per_device=tokens_per_device / p.seconds
            if p.seconds > 0 else 0.0,
            memory_bound_bytes=float(memory_bytes),
        )
    return StepEstimate(
        flops_per_device=flops_per_device,
        model_flops_per_device=model_flops_per_device,
        compute_seconds=compute,
        comm_seconds=overlappable_comm_seconds + critical_comm_seconds,
        exposed_comm_seconds=exposed,
        step_seconds=step,
        mfu_bound=model_flops_per_device / (step * peak_flops_per_s) if step > 0 else 0.0,
        tokens_per_second_per_device=tokens_per_device / step if step > 0 else 0.0,
        hbm_peak_bytes=hbm_peak_bytes,
        hbm_capacity_bytes=hbm_capacity_bytes,
        **predicted,
    )


# -- the predicted step ---------------------------------------------------------------------------

MATMUL_EFFICIENCY = 0.7175
"""The fraction of the MXU-padded peak that a step's matmuls reach (module docstring): fitted
once, on MaxText's Llama 3.1 70B, pure FSDP on 256 TPU7x chips (``tpu7x:4x8x8``, 2 sequences of
8192 a device, MaxText's ``remat_policy=custom`` saving q, k, v and the attention output:
12.27 s a step; AI-Hypercomputer/tpu-recipes, training/ironwood), so that
:func:`estimate_fsdp_tp_step` predicts that step exactly; every other published result is a
check (``benchmarks/step_estimate_check.py``, decision 0034). One number for every generation
and model: no per-model factor."""

MatmulFlops = dict[tuple[int, int, int] | None, float]
"""FLOPs by the ``(M, K, N)`` of the matmul that ran them (None: not padded, a convolution)."""


def padded_matmul_flops(matmul_flops: MatmulFlops, mxu_size: int | None) -> float:
    """The FLOPs the MXU spends on ``matmul_flops``: each shape's ``M``, ``K`` and ``N``
    rounded up to a multiple of ``mxu_size`` (the MXU multiplies whole ``mxu_size``-square
    tiles), its FLOPs scaled by the padded volume over the real one.

    ``{(1000, 128, 4096): 1e9}`` on a 256-wide MXU: ``1024 x 256 x 4096 / (1000 x 128 x 4096)
    = 2.048``, so 2.048e9. Shapes of None, or ``mxu_size`` None, are not padded."""
    total = 0.0
    for dims, flops in matmul_flops.items():
        if dims is None or mxu_size is None or 0 in dims:
            total += flops
            continue
        real = math.prod(dims)
        padded = math.prod(-(-d // mxu_size) * mxu_size for d in dims)
        total += flops * padded / real
    return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """A predicted step by term (module docstring)."""

    matmul_seconds: float
    memory_seconds: float
    exposed_comm_seconds: float

    @property
    def seconds(self) -> float:
        return self.matmul_seconds + self.memory_seconds + self.exposed_comm_seconds


def predict_step(
    *,
    matmul_flops: MatmulFlops,
    memory_bytes: float,
    peak_flops_per_s: float,
    hbm_bytes_per_s: float,
    mxu_size: int | None,
    overlappable_comm_seconds: float = 0.0,
    critical_comm_seconds: float = 0.0,
    efficiency: float | None = None,
) -> Prediction:
    """The step to expect (module docstring): ``padded_matmul_flops / (peak x efficiency) +
    memory_bytes / hbm_bytes_per_s + critical + max(0, overlappable - compute)``.

    ``efficiency`` defaults to :data:`MATMUL_EFFICIENCY`.

    Raises:
        ValueError: a non-positive rate or efficiency above 1.
    """
    efficiency = MATMUL_EFFICIENCY if efficiency is None else efficiency
    if not peak_flops_per_s > 0 or not hbm_bytes_per_s > 0 or not 0 < efficiency <= 1:
        raise ValueError(
            f"peak_flops_per_s and hbm_bytes_per_s must be positive and efficiency in (0, 1], "
            f"got {peak_flops_per_s=} {hbm_bytes_per_s=} {efficiency=}")
    matmul = padded_matmul_flops(matmul_flops, mxu_size) / (peak_flops_per_s * efficiency)
    memory = memory_bytes / hbm_bytes_per_s
    compute = matmul + memory
    exposed = critical_comm_seconds + max(0.0, overlappable_comm_seconds - compute)
    return Prediction(matmul_seconds=matmul, memory_seconds=memory, exposed_comm_seconds=exposed)


Recomputed = Literal["q", "k", "v", "attention", "o", "mlp_in", "mlp_out"]
"""What a checkpointed decoder block can run again in its backward: its projections (``o``
the attention output's, ``mlp_in`` the SwiGLU's two input ones, ``mlp_out`` its output one)
and the attention kernel's forward."""


def decoder_step_costs(
    shape: DecoderShape,
    *,
    batch_per_dp_rank: int,
    seq_len: int,
    tp: int = 1,
    recompute: frozenset[str] | set[str] = frozenset(),
    attention_fraction: float = 1.0,
    activation_bytes: int = 2,
    optimizer_bytes_per_param: int = 28,
    dp: int = 1,
) -> tuple[MatmulFlops, float]:
    """One device's matmul FLOPs by shape and memory-bound bytes for a training step of
    ``shape`` (the analytic twin of what the step meter measures; module docstring).

    Per device ``T = batch_per_dp_rank x seq_len`` tokens, each weight matmul split over ``tp``
    (its output or input width / tp). Matmuls (``(M, K, N)``, FLOPs): per block q ``(T, dim,
    H d_h / tp)``, k and v ``(T, dim, H_kv d_h / tp)``, o ``(T, H d_h / tp, dim)``, the MLP's
    two inputs ``(T, dim, ffn / tp)`` and output ``(T, ffn / tp, dim)``, ``2 M K N`` each in the
    forward and twice that in the backward (its two gradient matmuls have the same three
    dimensions, so the same padding), once more for each projection in ``recompute``; the
    output projection ``(T, dim, vocab / tp)`` likewise. Attention ``(seq, d_h, seq)`` per
    head: the forward's two matmuls ``4 seq^2 d_h`` a sequence and head, the backward's five
    (it recomputes the scores), ``attention_fraction`` of it computed (a block-causal kernel's
    share: :func:`~._op_costs.causal_block_fraction`), the forward once more if ``"attention"``
    is in ``recompute``.

    Memory-bound bytes (activations of ``activation_bytes``), as a fusing compiler runs each
    elementwise chain (read its inputs, write its outputs, once), per token and block, sharded
    over ``tp`` (sequence parallelism for the ``dim``-wide, heads and ``ffn`` for the rest):
    forward: two norms ``2 dim`` each, rotary on q and k ``2 (H + H_kv) d_h``, two residual
    adds ``3 dim`` each, the SwiGLU product ``3 ffn``: ``10 dim + 2 (H + H_kv) d_h + 3 ffn``;
    backward: norms ``3 dim`` each (read the gradient and the input, write one), rotary the
    same as forward, residuals ``3 dim`` each, SwiGLU ``5 ffn`` (read the gradient and both
    inputs, write two): ``12 dim + 2 (H + H_kv) d_h + 5 ffn``; a block that recomputes
    anything runs its forward's elementwise work again. Plus the final norm (``5 dim``) and
    the loss over the logits (read them, read them again and write their gradient: ``3 vocab
    / tp``), and the optimizer's update of the device's parameter shard (``params / (dp x
    tp)``; AdamW in fp32: read parameter, gradient and two moments, write three: 28 bytes).

    Raises:
        ValueError: an unknown name in ``recompute``.
    """
    unknown = set(recompute) - set(Recomputed.__args__)
    if unknown:
        raise ValueError(f"recompute names {sorted(unknown)} are not among "
                         f"{list(Recomputed.__args__)}")
    t = batch_per_dp_rank * seq_len
    d, f, dh = shape.dim, shape.ffn_dim, shape.head_dim
    q, kv = shape.n_heads * dh, shape.n_kv_heads * dh
    flops: MatmulFlops = {}

    def add(dims: tuple[int, int, int], amount: float) -> None:
        flops[dims] = flops.get(dims, 0.0) + amount

    layer = [("q", (t, d, q // tp), 1), ("k", (t, d, kv // tp), 1), ("v", (t, d, kv // tp), 1),
             ("o", (t, q // tp, d), 1), ("mlp_in", (t, d, f // tp), 2),
             ("mlp_out", (t, f // tp, d), 1)]
    for name, dims, count in layer:
        runs = 3 + (1 if name in recompute else 0)  # forward, backward x 2, recomputed
        add(dims, shape.n_layers * count * runs * 2 * math.prod(dims))
    heads = shape.n_heads // tp
    attention_forward = batch_per_dp_rank * heads * 4 * seq_len * seq_len * dh
    runs = 2 + 5 + (2 if "attention" in recompute else 0)  # in units of one s x s matmul
    add((seq_len, dh, seq_len),
        shape.n_layers * attention_forward / 2 * runs * attention_fraction)
    add((t, d, shape.vocab_size // tp), 3 * 2 * t * d * (shape.vocab_size // tp))

    forward = 10 * d + 2 * (q + kv) + 3 * f
    backward = 12 * d + 2 * (q + kv) + 5 * f
    per_token_layer = forward + backward + (forward if recompute else 0)
    per_token = shape.n_layers * per_token_layer + 5 * d + 3 * shape.vocab_size
    memory = t / tp * per_token * activation_bytes
    memory += shape.params / (dp * tp) * optimizer_bytes_per_param
    return flops, memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCollective:
    """One kind of collective a step issues, with its modelled time."""

    name: str
    """What it is for (``"fsdp all_gather (forward)"``)."""
    op: str
    """Its ``tpu-dist-bench`` op name."""
    group_size: int
    size_bytes: int
    """nccl-tests' message size ``S`` of one call (:func:`collective_time`)."""
    calls: int
    """Calls per step."""
    seconds_per_call: float
    overlappable: bool
    """Whether it can run under compute (FSDP's) or sits on the critical path (TP's)."""

    @property
    def seconds(self) -> float:
        """Per step: ``calls * seconds_per_call``."""
        return self.calls * self.seconds_per_call


def fsdp_tp_collectives(
    shape: DecoderShape,
    topology: Topology,
    *,
    tp: int,
    batch_per_dp_rank: int,
    seq_len: int,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    activation_bytes: int = 2,
) -> list[StepCollective]:
    """The collectives of one step of FSDP2 (over dp) x Megatron TP (over tp), per device.

    The mesh is :func:`tpu_dist.mesh.plan_mesh`'s ``(dp, tp)`` layout of every device of
    ``topology`` (tp innermost: its groups are ICI neighbours); one dp group and one tp group
    stand for all. FSDP units: each transformer block, and one more for the embedding, final
    norm and output projection. Per unit: an all-gather of its ``param_bytes`` parameters
    before the forward and again before the backward (resharded after the forward), and a
    reduce-scatter of its ``grad_bytes`` gradients (4: fp32, FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` as TorchTitan uses it), all
    of the TP-local shard. Per block with ``tp > 1``: two activation all-reduces in the forward
    (after the attention output and the MLP down projection) and two in the backward, of
    ``batch_per_dp_rank x seq_len x dim`` ``activation_bytes`` words; two more for the embedding
    and the output. TP collectives are on the critical path; FSDP's are not.

    Raises:
        ValueError: ``tp`` does not divide the devices.
    """
    n = topology.num_devices
    if tp < 1 or n % tp:
        raise ValueError(f"tp={tp} must divide the topology's {n} devices")
    dp = n // tp
    mesh = plan_mesh(topology, (dp, tp))
    dp_group = [int(r) for r in mesh[:, 0]]
    tp_group = [int(r) for r in mesh[0, :]]
    found: list[StepCollective] = []

    def add(name: str, op: str, group: list[int], size: int, calls: int, overlap: bool) -> None:
        t = collective_time(op, topology, group, size) if len(group) > 1 else None
        if t is None:
            return
        found.append(StepCollective(
            name=name, op=op, group_size=len(group), size_bytes=size, calls=calls,
            seconds_per_call=t.seconds, overlappable=overlap,
        ))

    units = [("block", shape.layer_params, shape.n_layers),
             ("embedding+output", 2 * shape.embedding_params + shape.dim, 1)]
    for unit, params, count in units:
        local = params // tp  # this TP rank's part of the unit
        # all_gather's S is its output (the TP-local unit); reduce_scatter's S its input.
        add(f"fsdp all_gather {unit} (forward)", "all_gather_into_tensor", dp_group,
            local * param_bytes, count, True)
        add(f"fsdp all_gather {unit} (backward)", "all_gather_into_tensor", dp_group,
            local * param_bytes, count, True)
        add(f"fsdp reduce_scatter {unit} grads", "reduce_scatter_tensor", dp_group,
            local * grad_bytes, count, True)
    if tp > 1:
        act = batch_per_dp_rank * seq_len * shape.dim * activation_bytes
        add("tp all_reduce block activations", "all_reduce", tp_group, act,
            4 * shape.n_layers, False)
        add("tp all_reduce embedding/output", "all_reduce", tp_group, act, 2, False)
    return found


def estimate_fsdp_tp_step(
    shape: DecoderShape,
    topology: Topology,
    *,
    global_batch: int,
    seq_len: int,
    tp: int = 1,
    convention: FlopsConvention = "torchtitan",
    grad_bytes: int = 4,
    recompute: frozenset[str] | set[str] = frozenset(),
    attention_fraction: float = 1.0,
) -> tuple[StepEstimate, list[StepCollective]]:
    """The step lower bound of ``shape`` trained with FSDP x TP over every device of
    ``topology`` (:func:`fsdp_tp_collectives`, :func:`step_estimate`), its predicted step
    (:func:`decoder_step_costs` with ``recompute`` and ``attention_fraction``, the FLOPs and
    bytes that run; :func:`predict_step`), and its collectives, costliest first. The bound's
    compute is the model FLOPs in ``convention`` (no recomputation), as before.

    Raises:
        ValueError: the generation has no peak FLOP/s figure, or the batch does not split.
    """
    gen = topology.generation
    peak = gen.peak_bf16_flops_per_device
    if peak is None:
        raise ValueError(
            f"{gen.name} has no peak_bf16_tflops_per_chip figure; register the generation "
            "with one (tpu_dist.mesh.register_generation) to estimate compute time"
        )
    dp = topology.num_devices // tp
    flops = flops_per_device(shape, global_batch=global_batch, seq_len=seq_len, dp=dp, tp=tp,
                             convention=convention)
    collectives = fsdp_tp_collectives(shape, topology, tp=tp,
                                      batch_per_dp_rank=global_batch // dp, seq_len=seq_len,
                                      grad_bytes=grad_bytes)
    matmul_flops, memory_bytes = decoder_step_costs(
        shape, batch_per_dp_rank=global_batch // dp, seq_len=seq_len, tp=tp, dp=dp,
        recompute=recompute, attention_fraction=attention_fraction)
    step = step_estimate(
        flops_per_device=flops,
        peak_flops_per_s=peak,
        tokens_per_device=global_batch * seq_len / topology.num_devices,
        overlappable_comm_seconds=sum(c.seconds for c in collectives if c.overlappable),
        critical_comm_seconds=sum(c.seconds for c in collectives if not c.overlappable),
        hbm_capacity_bytes=gen.hbm_bytes_per_device,
        matmul_flops=matmul_flops,
        memory_bytes=memory_bytes,
        hbm_bytes_per_s=gen.hbm_bytes_per_s_per_device,
        mxu_size=gen.mxu_size,
    )
    return step, sorted(collectives, key=lambda c: -c.seconds)
