"""Tensors without storage for a compile-only run: model size and sequence length cost nothing.

A compile-only run executes the job's script once, as one rank of the whole target world, only
to learn which collectives it issues with which shapes; the values are not meaningful (the
"tpu" groups return outputs of the right shape without communicating). So the script's large
tensors need no memory and no compute: :class:`LargeTensorsFake` makes them *fake tensors*
(torch's ``FakeTensorMode``: shape, dtype and strides, no data), and every op on a fake tensor
runs on the fakes. A Llama-3-405B step at sequence 8192 then runs on a laptop; with real
tensors it needs hundreds of GiB.

Small tensors stay real. DeviceMesh, for one, computes its rank layout with tensor ops whose
output size depends on values (``nonzero``), which fake tensors cannot run; the layout is tiny.
The rule, per op:

* an op with a fake tensor among its inputs runs under ``FakeTensorMode`` (real inputs are
  treated as constants): its outputs are fake;
* an op with no tensor inputs (a factory: ``empty``, ``zeros``, ``randn``, ``arange``, ...) makes
  a fake tensor when it would hold at least ``min_elements`` elements (default 65,536), else a
  real one;
* every other op (real inputs only) runs for real;
* a functional collective (DTensor's, TP's) on fake tensors is handed to its "tpu" group as
  its real kernel would hand it (:func:`_issue`), so it is recorded like any other call.

Reading a fake tensor's value back to Python (``.item()``, ``float(t)``, ``bool(t)``, so also
printing a loss) gives a placeholder, 0 of the tensor's type, not an error: the values of a
compile-only run are not meaningful anyway. What cannot run fake (``.tolist()`` and ``.numpy()``
of a fake tensor, saving one) raises, and ``tpu-launch --compile-only --tensors real`` runs the
script with real tensors instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LargeTensorsFake"]

_READ_BACK = torch.ops.aten._local_scalar_dense.default
"""The op behind ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``."""


class LargeTensorsFake(TorchDispatchMode):
    """A dispatch mode in which large tensors are fake (module doc). Use as a context manager
    around the script's run, on the thread that runs it."""

    def __init__(self, min_elements: int = 1 << 16) -> None:
        super().__init__()
        self.min_elements = min_elements
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.faked = 0
        """How many tensors a factory made fake (for the report)."""
        self.placeholders = 0
        """How many values were read back from fake tensors as placeholders."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            if func is _READ_BACK:
                self.placeholders += 1
                return _placeholder(tensors[0].dtype)
            with self.fake:
                out = func(*args, **kwargs)
            if func.namespace == "_c10d_functional":
                _issue(func, args, out)
            return out
        if not tensors:  # a factory: fake if large
            with self.fake:
                shaped = func(*args, **kwargs)
            outputs = [o for o in tree_leaves(shaped) if isinstance(o, torch.Tensor)]
            if outputs and sum(o.numel() for o in outputs) >= self.min_elements:
                self.faked += len(outputs)
                return shaped
        return func(*args, **kwargs)


def _issue(func: Any, args: tuple, out: Any) -> None:
    """Hand a functional collective on fake tensors to its process group, as its real kernel
    would (the same group method: what the recording group records).

    FakeTensorMode runs functional collectives (``torch.ops._c10d_functional``: DTensor's,
    TP's, ``torch.compile``'s) with their fake kernels, which never reach the process group; a
    compile-only run would then miss them. Only "tpu" groups are called (they take fake
    tensors; others keep their fake result only). ``wait_tensor`` and point-to-point ops have
    nothing to record here.
    """
    import torch._C._distributed_c10d as c10d  # the option types (not all in torch.distributed)
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = func._schema.name.split("::")[-1]
    if name not in _FUNCTIONAL:
        return
    group = _resolve_process_group(args[-1])
    if group.name() != "tpu":
        return
    _FUNCTIONAL[name](c10d, group, args, out)


def _reduce_op(c10d: Any, name: str) -> Any:
    return c10d.ReduceOp.RedOpType.__members__[name.upper()]


def _all_reduce(c10d: Any, group: Any, args: tuple, out: Any) -> None:
    opts = c10d.AllreduceOptions()
    opts.reduceOp = _reduce_op(c10d, args[1])
    group.allreduce([out], opts)


def _all_reduce_coalesced(c10d: Any, group: Any, args: tuple, out: Any) -> None:
    opts = c10d.AllreduceCoalescedOptions()
    opts.reduceOp = _reduce_op(c10d, args[1])
    group.allreduce_coalesced(list(out), opts)


def _all_gather(c10d: Any, group: Any, args: tuple, out: Any) -> None:
    inputs, outputs = (list(args[0]), list(out)) if isinstance(out, list) else ([args[0]], [out])
    group.all_gather_single_coalesced(outputs, inputs, c10d.AllgatherOptions())


def _reduce_scatter(c10d: Any, group: Any, args: tuple, out: Any) -> None:
    inputs, outputs = (list(args[0]), list(out)) if isinstance(out, list) else ([args[0]], [out])
    opts = c10d.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(c10d, args[1])
    group.reduce_scatter_single_coalesced(outputs, inputs, opts)


def _all_to_all_single(c10d: Any, group: Any, args: tuple, out: Any) -> None:
    group.all_to_all_single(out, args[0], list(args[1]), list(args[2]), c10d.AllToAllOptions())


def _broadcast(c10d: Any, group: Any, args: tuple, out: Any) -> None:
    opts = c10d.BroadcastOptions()
    opts.rootRank = args[1]
    group.broadcast([out], opts)


_FUNCTIONAL = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "all_gather_into_tensor": _all_gather,
    "all_gather_into_tensor_coalesced": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "reduce_scatter_tensor_coalesced": _reduce_scatter,
    "all_to_all_single": _all_to_all_single,
    "broadcast": _broadcast,
}
"""Functional collective -> the process-group call its kernel makes (measured on torch 2.13:
an all-gather and a reduce-scatter go to the coalesced forms)."""


def _placeholder(dtype: torch.dtype) -> bool | int | float | complex:
    if dtype == torch.bool:
        return False
    if dtype.is_complex:
        return 0j
    if dtype.is_floating_point:
        return 0.0
    return 0
