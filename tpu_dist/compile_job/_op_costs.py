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

A new per-op quantity (bytes read and written, say) is a field of :class:`OpCost` computed
here; the meter sums every field over the step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

__all__ = ["OpCost", "has_formula", "op_cost"]

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


_NOTHING = OpCost()


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
    if func is _aten.embedding.default:
        return OpCost(token_ids=args[1].numel())
    formula = _FORMULAS.get(_packet(func))
    if formula is None:
        return _NOTHING
    flops = int(formula(*args, **kwargs, out_val=out))
    if func in _FLEX_BLOCK_MASK:
        fraction = computed_block_fraction(args[_FLEX_BLOCK_MASK[func]])
        return OpCost(flops=math.ceil(flops * fraction), model_flops=flops)
    return OpCost(flops=flops, model_flops=flops)


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
