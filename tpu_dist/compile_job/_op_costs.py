"""What one op costs a device: the step meter's per-op accounting, in one place.

:func:`op_cost` is called by the step meter (:class:`~._step.StepMeter`) for every op this
rank runs on its own tensors (a DTensor op once, on its shards), with the op's inputs and
outputs (fake tensors in a compile-only run: shapes, no data), and says what it costs:

* **FLOPs** (:attr:`OpCost.flops`): torch's formulas (``torch.utils.flop_counter``: matmuls,
  convolutions, attention kernels), plus those it lacks on torch 2.13: ``_grouped_mm`` (an
  MoE's experts), the CPU's flash attention kernel and the fused attention kernel of a PrivateUse1 device (the emulated
  ``"tpu"``'s, :mod:`._tpu_device`), both counted as torch counts attention: the forward's two
  ``s x s`` matmuls, a backward of five (the scores recomputed, as a flash kernel does).
  **FlexAttention** (the ``flex_attention`` higher-order op and its backward, TorchTitan's
  default attention) is counted as its block-sparse kernel runs it: torch's dense count times
  the fraction of ``(q block, kv block)`` pairs its block mask computes (the blocks it skips
  cost nothing). The fraction is read from the block mask when its block counts hold values
  (a mask built on real tensors); on fake tensors (always on the emulated device) the mask's
  values are not known, and the fraction is a **causal mask's**: the kv blocks at or below
  each q block's diagonal (``n (n + 1) / 2`` of ``n x n`` blocks for ``n`` blocks a side).
  That is TorchTitan's block-causal mask over one document per sequence; real documents only
  skip more blocks.
* **Model FLOPs** (:attr:`OpCost.model_flops`): the op's share of MFU's numerator, the same
  as its FLOPs but for attention, which is counted over the whole square (TorchTitan's
  ``6 N + 12 L H d_h s`` a token has no causal discount), block mask or not.
* **Tokens** (:attr:`OpCost.token_ids`): the token ids an embedding lookup reads.
* **Bytes** (:attr:`OpCost.bytes_moved`): what the op reads and writes in memory, its tensor
  inputs' bytes plus its outputs' (an in-place op's operand counts as read and as written), as
  the op runs alone: **no fusion**, an upper bound of the step's memory traffic. The step
  meter counts what a fusing compiler moves with :class:`FusedBytes` (below). A view
  (``func.is_view``: ``view``, ``transpose``, ``t``, ``expand``, ...; also ``_unsafe_view``, a
  reshape's view not marked one) moves nothing, nor does an allocation (``empty``) or a
  collective (the recorder prices those); ``zeros_like``, ``fill_`` and their kin write their
  output and read nothing.
* **Kind** (:attr:`OpCost.matmul`): matmul-like ops (those with a FLOP formula: ``mm``,
  ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``, ``_grouped_mm``, the attention kernels,
  convolutions) run on the MXU, at a rate that depends on their shape
  (:attr:`OpCost.mxu_dims`: the ``(M, K, N)`` of the op's matmul, which the step model pads to
  the MXU's tiles); everything else (norms, softmax, elementwise, the optimizer's update, the
  loss) is memory-bound: its time is its bytes over the HBM bandwidth
  (:func:`tpu_dist.compile_job.predict_step`).

**Fusion** (:class:`FusedBytes`, decision 0034): an XLA program fuses the elementwise and
reduction ops between two matmuls into kernels that keep their intermediates in VMEM; only
what enters the chain from outside and what leaves it crosses HBM. The rule, per tensor
storage (so views share their base's fate):

* A **fusion group** is the run of memory-bound ops between two group boundaries: a
  matmul-like op, a collective (``c10d``/``_c10d_functional``), the end of a step
  (:meth:`FusedBytes.end_group`).
* A memory-bound op **reads** each input storage at most once a group: an input written by a
  memory-bound op of the same group costs nothing (fused, read from VMEM); any other input
  costs its bytes the first time the group reads it.
* A memory-bound op's **outputs** are written lazily: a write costs its bytes only when the
  storage is read after its group ended (by a later group, a matmul, a collective: the value
  had to be in HBM), once. A write never read again in a measured step (a dead intermediate,
  one that autograd freed) costs nothing; one read in the next step (the optimizer's state, the
  gradients accumulated) is charged there: in a steady state the same bytes per step.
* Matmul-like ops' and collectives' own operands are not memory-bound bytes (their time is
  priced apart); reading a pending write still charges that write.

Worked example (``tests/test_predict.py``): ``y = relu(x @ w) * 2 + b`` then ``y @ w2``, fp32
``(4, 16)`` activations (256 bytes) and ``b``: the matmul ends a group; ``relu`` reads the
matmul's output (256) and writes a pending ``r``; ``* 2`` reads ``r`` in VMEM (0) and writes a
pending ``m``; ``+ b`` reads ``m`` (0) and ``b`` (256), writes a pending ``y``; ``y @ w2``
reads ``y``: its write is charged (256). Fused: 768 bytes; unfused: 512 + 512 + 768 = 1,792.

A new per-op quantity is a field of :class:`OpCost` computed here; the meter sums every field
over the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["FusedBytes", "OpCost", "bytes_moved", "has_formula", "op_cost"]

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What one op costs the device that runs it (module docstring)."""

    flops: int = 0
    """FLOPs the device executes."""
    model_flops: int = 0
    """The op's FLOPs as MFU counts them (attention over the whole square)."""
    token_ids: int = 0
    """Token ids read (an embedding lookup's indices)."""
    bytes_moved: int = 0
    """Bytes the op reads and writes, unfused (module docstring)."""
    matmul: bool = False
    """Whether the op runs on the MXU (it has a FLOP formula), else it is memory-bound."""
    mxu_dims: tuple[int, int, int] | None = None
    """``(M, K, N)`` of the op's matmul (attention: ``(s_q, d_head, s_kv)``, the shape of its
    score matmul, whose padding its value matmul shares); None: not padded (a convolution)."""


_NOTHING = OpCost()
_FREE = ("_c10d_functional", "c10d", "prim", "profiler")
"""Namespaces of ops that move no bytes of their own (collectives are priced apart)."""
_COLLECTIVES = ("_c10d_functional", "c10d")
"""Namespaces of collectives: each ends a fusion group (:class:`FusedBytes`)."""
_ALLOCATIONS = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
                _aten.new_empty_strided, _aten._local_scalar_dense,
                _aten._unsafe_view}  # a reshape's view, not marked one in its schema


_WRITE_ONLY = {_aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.new_zeros,
               _aten.new_ones, _aten.new_full, _aten.fill_, _aten.zero_}
"""Ops that read only their tensor inputs' shapes (or overwrite them): they write, read nothing."""


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value if isinstance(v, (torch.Tensor, list, tuple)))
    return 0


def bytes_moved(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes ``func`` reads and writes: its tensor inputs and outputs (module docstring)."""
    if getattr(func, "is_view", False) or _packet(func) in _ALLOCATIONS or getattr(
            func, "namespace", None) in _FREE:
        return 0
    if _packet(func) in _WRITE_ONLY:
        return _nbytes(out)
    return _nbytes(args) + _nbytes(tuple(kwargs.values())) + _nbytes(out)


def _tensors(value: Any) -> Iterator[tuple[Any, int]]:
    """``(storage, bytes)`` of each tensor in ``value`` that has a storage (not a sparse or
    nested tensor's, which the fusion rule leaves out)."""
    if isinstance(value, torch.Tensor):
        try:
            storage = value.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        yield storage, value.numel() * value.element_size()
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class FusedBytes:
    """The HBM bytes of memory-bound ops as a fusing compiler moves them (module docstring,
    "Fusion"): call :meth:`op` for every op in the order they run and :meth:`end_group` where
    a fusion group must end (a step's end). Keeps one weak entry per live storage the group
    touched or left pending (no tensor is kept alive): a few dictionary operations an op."""

    def __init__(self) -> None:
        self.group = 0
        """The current fusion group's number."""
        self._pending: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """storage -> (group that wrote it, bytes written): a write not yet charged."""
        self._read: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """storage -> the last group that charged its read."""

    def end_group(self) -> None:
        """The next memory-bound op starts a new fusion group."""
        self.group += 1

    def _materialize(self, storage: Any, boundary: bool = False) -> int:
        """A pending write read by a later group or (``boundary``) by a matmul or a
        collective: it is charged (0 if none)."""
        entry = self._pending.get(storage)
        if entry is None or (entry[0] == self.group and not boundary):
            return 0
        del self._pending[storage]
        return entry[1]

    def op(self, func: Any, args: tuple, kwargs: dict, out: Any, matmul: bool) -> int:
        """The bytes ``func`` (which gave ``out``; ``matmul``: an op with a FLOP formula)
        moves in HBM under the fusion rule."""
        namespace = getattr(func, "namespace", None)
        if getattr(func, "is_view", False) or _packet(func) in _ALLOCATIONS or namespace in (
                "prim", "profiler"):
            return 0
        if _packet(func) in _WRITE_ONLY:
            inputs = []
        elif func is _aten.embedding.default:
            # A lookup reads the rows it gathers (as many bytes as it writes), not the table.
            inputs = list(_tensors((args[1:], kwargs)))
            inputs += [(args[0].untyped_storage(), _nbytes(out))]
        else:
            inputs = list(_tensors((args, kwargs)))
        boundary = matmul or namespace in _COLLECTIVES
        charged = 0
        if boundary:
            for storage, _ in inputs:
                charged += self._materialize(storage, boundary=True)
            for storage, _ in _tensors(out):
                self._pending.pop(storage, None)
            self.end_group()
            return charged
        for storage, size in inputs:
            entry = self._pending.get(storage)
            if entry is not None and entry[0] == self.group:
                continue  # fused: read from VMEM
            charged += self._materialize(storage)
            if self._read.get(storage) != self.group:
                self._read[storage] = self.group
                charged += size
        for storage, written in _tensors(out):
            entry = self._pending.get(storage)
            if entry is not None and entry[0] == self.group:
                # Written again in the group (parts of one buffer, an in-place chain): what
                # leaves the group is at most the storage.
                written = min(entry[1] + written, storage.nbytes())
            self._pending[storage] = (self.group, written)
        return charged


def _matmul_dims(func: Any, args: tuple) -> tuple[int, int, int] | None:
    """``(M, K, N)`` of a matmul-like op (:attr:`OpCost.mxu_dims`), from its operands."""
    packet = _packet(func)
    if packet in (_aten.mm, _aten.bmm, _aten._scaled_mm, _aten._grouped_mm):
        a, b = args[0], args[1]
    elif packet in (_aten.addmm, _aten.baddbmm):
        a, b = args[1], args[2]
    elif packet in _ATTENTION or func in _FLEX_BLOCK_MASK:
        # The forward takes (query, key, ...), torch's backwards (grad_out, query, key, ...),
        # FlexAttention's backward (query, key, ...); (..., s, d) each.
        backward = packet in _ATTENTION and "backward" in str(packet)
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        return int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2])
    else:
        return None  # convolutions: not padded
    return int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])


def _attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
               **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                        out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``torch._grouped_mm`` (an MoE's experts, TorchTitan's): every row meets one group's
    matrix, so the work is that of one matmul of the whole operands. A ``(M, K)`` x B
    ``(G, K, N)`` (groups along M): ``2 M K N``; ``(G, M, K)`` x ``(K, N)`` (along N):
    ``2 M K N``; ``(M, K)`` x ``(K, N)`` (along K, a weight gradient): ``2 M K N``;
    ``(G, M, K)`` x ``(G, K, N)``: ``2 G M K N``."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


_MORE = {
    _aten._grouped_mm: _grouped_mm,
    _aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
    _aten._scaled_dot_product_fused_attention_overrideable: _attention,
    _aten._scaled_dot_product_fused_attention_overrideable_backward: _attention_backward,
}
"""Kernels torch 2.13 has no formula for (module docstring)."""

_ATTENTION = {
    packet for packet in (*flop_registry, *_MORE)
    if "attention" in str(packet) and "flex" not in str(packet)
}
"""The attention kernels among the ops with a FLOP formula."""

_FORMULAS = {**flop_registry, **{op: shape_wrapper(f) for op, f in _MORE.items()}}
"""Op (overload packet, or higher-order op) -> ``f(*args, out_val=out, **kwargs)`` -> FLOPs."""


def _flex_ops() -> tuple[Any, Any]:
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    return flex_attention, flex_attention_backward


_FLEX, _FLEX_BACKWARD = _flex_ops()
_FLEX_BLOCK_MASK = {_FLEX: 4, _FLEX_BACKWARD: 9}
"""Where each FlexAttention op takes its block mask (``BlockMask.as_tuple()``: q length, kv
length, kv block counts, kv indices, full kv block counts, ..., q block size, kv block size,
mask_mod)."""


def _packet(func: Any) -> Any:
    return getattr(func, "_overloadpacket", func)


def has_formula(func: Any) -> bool:
    """Whether :func:`op_cost` counts FLOPs for ``func`` (else the meter may decompose it into
    ops that have one, as torch's ``FlopCounterMode`` does)."""
    return _packet(func) in _FORMULAS


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> OpCost:
    """What running ``func(*args, **kwargs)``, which gave ``out``, cost (module docstring)."""
    moved = bytes_moved(func, args, kwargs, out)
    if func is _aten.embedding.default:
        return OpCost(token_ids=args[1].numel(), bytes_moved=moved)
    formula = _FORMULAS.get(_packet(func))
    if formula is None:
        return OpCost(bytes_moved=moved) if moved else _NOTHING
    flops = int(formula(*args, **kwargs, out_val=out))
    dims = _matmul_dims(func, args)
    if func in _FLEX_BLOCK_MASK:
        fraction = computed_block_fraction(args[_FLEX_BLOCK_MASK[func]])
        return OpCost(flops=math.ceil(flops * fraction), model_flops=flops, bytes_moved=moved,
                      matmul=True, mxu_dims=dims)
    return OpCost(flops=flops, model_flops=flops, bytes_moved=moved, matmul=True,
                  mxu_dims=dims)


def computed_block_fraction(block_mask: tuple) -> float:
    """The fraction of (q block, kv block) pairs a FlexAttention kernel computes for
    ``block_mask`` (``BlockMask.as_tuple()``): counted from its block counts when they hold
    values, else a causal mask's (module docstring)."""
    q_len, kv_len, kv_blocks, full_kv_blocks = block_mask[0], block_mask[1], block_mask[2], \
        block_mask[4]
    q_block, kv_block = block_mask[-3], block_mask[-2]
    n_q, n_kv = math.ceil(q_len / q_block), math.ceil(kv_len / kv_block)
    if n_q == 0 or n_kv == 0:
        return 1.0
    known = [t for t in (kv_blocks, full_kv_blocks) if t is not None]
    if known and not any(isinstance(t, FakeTensor) or t.is_meta for t in known):
        computed = sum(int(t.sum()) for t in known)
        return min(1.0, computed / (kv_blocks.numel() * n_kv))
    return causal_block_fraction(q_len, kv_len, q_block, kv_block)


def causal_block_fraction(q_len: int, kv_len: int, q_block: int, kv_block: int) -> float:
    """The fraction of (q block, kv block) pairs a causal mask (``q_idx >= kv_idx``, as
    FlexAttention's and TorchTitan's are written: query ``i`` sees keys ``0..i``) leaves to
    compute: kv block ``j`` is computed for q block ``i`` when it holds a key at or before the
    block's last query. ``n`` blocks a side: ``n (n + 1) / 2`` of ``n x n``."""
    n_q, n_kv = math.ceil(q_len / q_block), math.ceil(kv_len / kv_block)
    computed = 0
    for i in range(n_q):
        last_key = min(kv_len, q_len, (i + 1) * q_block) - 1
        computed += min(n_kv, last_key // kv_block + 1)
    return computed / (n_q * n_kv)
