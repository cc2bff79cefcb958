"""The call forms of c10d's ``ProcessGroup`` ops, for a process group written in Python.

torch reaches a group's op methods two ways:

* through c10d's dispatcher (``dist.all_reduce`` and the rest): always the full form
  ``(tensors, opts)``, which :class:`~._backend.ProcessGroupTPU`'s methods declare;
* on the group object itself, in the short forms the C++ ``ProcessGroup``'s Python overloads
  accept: DDP's ``join()`` with ``find_unused_parameters=True`` calls
  ``process_group.allreduce(local_used_map)`` (one tensor, no options), comm hooks call
  ``process_group.allreduce([bucket.buffer()])``, user code ``pg.broadcast(t, 0)``,
  ``pg.barrier()``.

A method defined in Python hides those overloads, so each op method is defined with
``@call_forms(op)`` (:func:`call_forms`), which wraps it: the forms below (the overloads of torch 2.13's ``ProcessGroup``, in their order, with
their parameter names for keyword calls) are turned into the full form before the method runs.
A call matching none raises a ``TypeError`` naming the op, what was passed, and the forms, as
c10d's own error does. For example, ``pg.allreduce(t, ReduceOp.MAX)`` becomes
``pg.allreduce([t], opts)`` with ``opts.reduceOp = ReduceOp.MAX``.

Ops that torch's trampoline calls by names other than c10d's (``all_gather_single`` for
``_allgather_base``, ...) get c10d's names too (:data:`ALIASES`; the group's class body binds
``_allgather_base = call_forms("_allgather_base")(all_gather_single)``): c10d's C++ methods of
those names would look for a C++ backend, which a process group written in Python has not.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions


class Tensors:
    """A list or tuple of tensors (one per device in c10d; one here)."""


class TensorLists:
    """A list or tuple of :class:`Tensors`."""


class Ints:
    """A list or tuple of ints."""


Timeout = timedelta
"""An op's timeout (``None``: the group's)."""

_SUM = ReduceOp.SUM


def _matches(value: Any, kind: Any) -> bool:
    if kind is Tensors:
        return isinstance(value, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in value)
    if kind is TensorLists:
        return isinstance(value, (list, tuple)) and all(_matches(v, Tensors) for v in value)
    if kind is Ints:
        return isinstance(value, (list, tuple)) and all(_matches(v, int) for v in value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _options(cls: type, timeout: timedelta | None, **fields: Any) -> Any:
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    if timeout is not None:
        opts.timeout = timeout
    return opts


def _given(opts: Any, cls: type) -> Any:
    return cls() if opts is None else opts


# -- the forms, per op: each returns the full form's arguments --------------------------------
# A parameter whose value is its default (None for options and timeouts) is not type-checked.


def _allreduce_full(tensors: Tensors, opts: dist.AllreduceOptions = None):
    return tensors, _given(opts, dist.AllreduceOptions)


def _allreduce_list(tensors: Tensors, op: ReduceOp = _SUM, timeout: Timeout = None):
    return tensors, _options(dist.AllreduceOptions, timeout, reduceOp=op)


def _allreduce_one(tensor: torch.Tensor, op: ReduceOp = _SUM, timeout: Timeout = None):
    return [tensor], _options(dist.AllreduceOptions, timeout, reduceOp=op)


def _allreduce_coalesced_full(tensors: Tensors, opts: dist.AllreduceCoalescedOptions = None):
    return tensors, _given(opts, dist.AllreduceCoalescedOptions)


def _reduce_full(tensors: Tensors, opts: dist.ReduceOptions = None):
    return tensors, _given(opts, dist.ReduceOptions)


def _reduce_one(tensor: torch.Tensor, root: int, op: ReduceOp = _SUM, timeout: Timeout = None):
    return [tensor], _options(dist.ReduceOptions, timeout, rootRank=root, reduceOp=op)


def _allgather_full(
    output_tensors: TensorLists, input_tensors: Tensors, opts: AllgatherOptions = None
):
    return output_tensors, input_tensors, _given(opts, AllgatherOptions)


def _allgather_one(output_tensors: Tensors, input_tensor: torch.Tensor, timeout: Timeout = None):
    return [output_tensors], [input_tensor], _options(AllgatherOptions, timeout)


def _allgather_coalesced_full(
    output_lists: TensorLists, input_list: Tensors, opts: AllgatherOptions = None
):
    return output_lists, input_list, _given(opts, AllgatherOptions)


def _gather_full(
    output_tensors: TensorLists, input_tensors: Tensors, opts: dist.GatherOptions = None
):
    return output_tensors, input_tensors, _given(opts, dist.GatherOptions)


def _gather_one(
    output_tensors: Tensors, input_tensor: torch.Tensor, root: int, timeout: Timeout = None
):
    return [output_tensors], [input_tensor], _options(dist.GatherOptions, timeout, rootRank=root)


def _reduce_scatter_full(
    output_tensors: Tensors, input_tensors: TensorLists, opts: dist.ReduceScatterOptions = None
):
    return output_tensors, input_tensors, _given(opts, dist.ReduceScatterOptions)


def _reduce_scatter_one(
    output: torch.Tensor, input: Tensors, op: ReduceOp = _SUM, timeout: Timeout = None
):
    return [output], [input], _options(dist.ReduceScatterOptions, timeout, reduceOp=op)


def _broadcast_full(tensors: Tensors, opts: dist.BroadcastOptions = None):
    return tensors, _given(opts, dist.BroadcastOptions)


def _broadcast_one(tensor: torch.Tensor, root: int, timeout: Timeout = None):
    return [tensor], _options(dist.BroadcastOptions, timeout, rootRank=root)


def _scatter_full(
    output_tensors: Tensors, input_tensors: TensorLists, opts: dist.ScatterOptions = None
):
    return output_tensors, input_tensors, _given(opts, dist.ScatterOptions)


def _scatter_one(
    output_tensor: torch.Tensor, input_tensors: Tensors, root: int, timeout: Timeout = None
):
    return [output_tensor], [input_tensors], _options(dist.ScatterOptions, timeout, rootRank=root)


def _alltoall_full(
    output_tensors: Tensors, input_tensors: Tensors, opts: dist.AllToAllOptions = None
):
    return output_tensors, input_tensors, _given(opts, dist.AllToAllOptions)


def _barrier_full(opts: dist.BarrierOptions = None):
    return (_given(opts, dist.BarrierOptions),)


def _barrier_timeout(timeout: Timeout = None):
    return (_options(dist.BarrierOptions, timeout),)


# c10d's names of the ops that torch's trampoline calls by other names (ALIASES).


def _allgather_base_full(output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions = None):
    return output, input, _given(opts, AllgatherOptions)


def _reduce_scatter_base_full(
    outputTensor: torch.Tensor, inputTensor: torch.Tensor, opts: dist.ReduceScatterOptions = None
):
    return outputTensor, inputTensor, _given(opts, dist.ReduceScatterOptions)


def _alltoall_base_full(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Ints,
    input_split_sizes: Ints,
    opts: dist.AllToAllOptions = None,
):
    return output, input, output_split_sizes, input_split_sizes, _given(opts, dist.AllToAllOptions)


def _alltoall_base_timeout(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Ints,
    input_split_sizes: Ints,
    timeout: Timeout = None,
):
    opts = _options(dist.AllToAllOptions, timeout)
    return output, input, output_split_sizes, input_split_sizes, opts


def _allgather_into_tensor_coalesced_full(
    outputs: Tensors, inputs: Tensors, opts: AllgatherOptions = None
):
    return outputs, inputs, _given(opts, AllgatherOptions)


def _reduce_scatter_tensor_coalesced_full(
    outputs: Tensors, inputs: Tensors, opts: dist.ReduceScatterOptions = None
):
    return outputs, inputs, _given(opts, dist.ReduceScatterOptions)


FORMS: dict[str, tuple[Callable[..., tuple], ...]] = {
    "allreduce": (_allreduce_full, _allreduce_list, _allreduce_one),
    "allreduce_coalesced": (_allreduce_coalesced_full,),
    "reduce": (_reduce_full, _reduce_one),
    "allgather": (_allgather_full, _allgather_one),
    "allgather_coalesced": (_allgather_coalesced_full,),
    "gather": (_gather_full, _gather_one),
    "reduce_scatter": (_reduce_scatter_full, _reduce_scatter_one),
    "broadcast": (_broadcast_full, _broadcast_one),
    "scatter": (_scatter_full, _scatter_one),
    "alltoall": (_alltoall_full,),
    "barrier": (_barrier_full, _barrier_timeout),
    "_allgather_base": (_allgather_base_full,),
    "_reduce_scatter_base": (_reduce_scatter_base_full,),
    "alltoall_base": (_alltoall_base_full, _alltoall_base_timeout),
    "allgather_into_tensor_coalesced": (_allgather_into_tensor_coalesced_full,),
    "reduce_scatter_tensor_coalesced": (_reduce_scatter_tensor_coalesced_full,),
}
"""Op method -> the forms c10d's ``ProcessGroup`` accepts for it, the full form first."""

ALIASES = {
    "_allgather_base": "all_gather_single",
    "_reduce_scatter_base": "reduce_scatter_single",
    "alltoall_base": "all_to_all_single",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
}
"""c10d's name -> the name torch's trampoline calls (the method the group defines). c10d's C++
methods under these names look for a C++ backend, which a Python group has not: so the group's
class binds them too, to the trampoline's methods (module doc)."""


@functools.cache
def _signature(form: Callable[..., tuple]) -> inspect.Signature:
    return inspect.signature(form, eval_str=True)


def _full_form(form: Callable[..., tuple], args: tuple, kwargs: dict) -> tuple | None:
    """``form``'s full-form arguments for this call, or None if the call is not this form."""
    signature = _signature(form)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    for name, value in bound.arguments.items():
        param = signature.parameters[name]
        if value is not param.default and not _matches(value, param.annotation):
            return None
    return form(*bound.args, **bound.kwargs)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return type(value).__name__ if not isinstance(value, (int, str)) else repr(value)


def _form_text(op: str, form: Callable[..., tuple]) -> str:
    params = []
    for param in _signature(form).parameters.values():
        kind = getattr(param.annotation, "__name__", str(param.annotation))
        default = "" if param.default is inspect.Parameter.empty else f" = {param.default}"
        params.append(f"{param.name}: {kind}{default}")
    return f"{op}({', '.join(params)})"


def normalize(op: str, args: tuple, kwargs: dict) -> tuple:
    """The full-form arguments of a call of ``op`` in any of its forms (:data:`FORMS`).

    Raises:
        TypeError: the call matches none of ``op``'s forms.
    """
    forms = FORMS[op]
    for form in forms:
        full = _full_form(form, args, kwargs)
        if full is not None:
            return full
    passed = ", ".join([_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()])
    accepted = "; ".join(f"{i}. {_form_text(op, f)}" for i, f in enumerate(forms, 1))
    raise TypeError(
        f"ProcessGroupTPU.{op}(): incompatible arguments ({passed}). The accepted forms, as "
        f"for c10d's ProcessGroup, are: {accepted}. Tensors is a list of tensors, TensorLists "
        f"a list of such lists."
    )


def call_forms(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Method decorator: the op method accepts every form c10d's ``ProcessGroup`` accepts for
    ``op`` (:data:`FORMS`), turned into the full form ``(..., opts)`` before it runs (module
    doc). The full form, as c10d's dispatcher calls it, goes straight through."""
    full = _signature(FORMS[op][0])
    arity = len(full.parameters)
    options = full.parameters["opts"].annotation

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def accepting(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs and len(args) == arity and isinstance(args[-1], options):
                return method(self, *args)
            return method(self, *normalize(op, args, kwargs))

        accepting.call_forms = op  # what tests read to see every op of FORMS wrapped
        return accepting

    return decorate
