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
  its real kernel would hand it (:func:`_issue`), so it is recorded like any other call;
* an op on DTensors is left to DTensor, which runs it on its local tensors under this mode
  (the rules above then apply to those).

Reading a fake tensor's value back to Python (``.item()``, ``float(t)``, ``bool(t)``, so also
printing a loss) gives a placeholder, 0 of the tensor's type (unless its values are known:
below), not an error: the values of a
compile-only run are not meaningful anyway. What cannot run fake (``.tolist()`` and ``.numpy()``
of a fake tensor, saving one) raises, and ``tpu-launch --compile-only --tensors real`` runs the
script with real tensors instead.

**Values that sizes depend on.** Some sizes come from values: an MoE's all-to-all splits are
its tokens per expert, counted from the router's top-k choices (``.tolist()`` of a count
tensor). A fake tensor has no values, so the mode follows them where it can: a small integer
or bool tensor (sizes come from those: counts, indices, masks) made fake from a real one
(``torch.tensor([...], device="tpu")``), or computed by an op from tensors whose values are
known (up to 4 Mi elements), keeps its values (computed on the CPU,
beside the fake one), and reading it back (``.item()``, ``.tolist()``) gives them. Where the
values cannot be known, one **assumption**: a top-k over values this run does not know (a
router's scores) picks **balanced**: row ``r`` of ``k`` choices among ``n`` takes
``(r k + j) mod n``, so every expert gets the same tokens (``rows k / n``), every rank of an
expert-parallel all-to-all sends and receives the same, and the recorded sizes are those of
balanced routing (:attr:`LargeTensorsFake.balanced_topk` counts the top-k calls it applied
to; the compile report says so). Real routing is uneven: the busiest expert's rank moves and
computes more.

FSDP2's ``fully_shard`` cuts every parameter into one chunk per data-parallel rank
(``torch.chunk``) and keeps only this rank's: at 2,048 dp ranks that is 2,048 view ops per
parameter, each through every dispatch mode (measured: 0.6 CPU-s a parameter, 2.4x that under
the step meter), while the run needs two of them. Inside this mode FSDP2's chunking helper
(``torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty``, torch-private) gives
the same chunks lazily: a chunk is made (``narrow``, the same view ``torch.chunk`` makes) only
when FSDP reads it. Only when that name exists with the signature ``(tensor, num_chunks, dim)``
(torch 2.13's); otherwise FSDP's own runs, slower, same result (``lazy_fsdp_chunks=False``
forces that).
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from tpu_dist.compile_job._step import _is_dtensor_type

__all__ = ["LargeTensorsFake"]

_READ_BACK = torch.ops.aten._local_scalar_dense.default
"""The op behind ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``."""
_DETACH = torch.ops.aten.detach.default
"""The op that makes ``nn.Parameter(t)`` of a tensor subclass (a fake tensor)."""


class LargeTensorsFake(TorchDispatchMode):
    """A dispatch mode in which large tensors are fake (module doc). Use as a context manager
    around the script's run, on the thread that runs it. Higher-order ops (FlexAttention's)
    follow the same rules as any op (torch's fake mode has their fake kernels)."""

    supports_higher_order_operators = True

    def __init__(
        self,
        min_elements: int = 1 << 16,
        *,
        lazy_fsdp_chunks: bool = True,
        fake_device_types: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.min_elements = min_elements
        self.lazy_fsdp_chunks = lazy_fsdp_chunks
        """Make FSDP2's per-rank chunks lazily while the mode is active (module docstring)."""
        self.fake_device_types = frozenset(fake_device_types)
        """Device types whose every tensor is fake, whatever its size (the emulated ``"tpu"``
        device: no memory holds its tensors, :mod:`._tpu_device`)."""
        self._restore: Callable[[], None] | None = None
        self._lift_cpu_only = False
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.faked = 0
        """How many tensors a factory made fake (for the report)."""
        self.placeholders = 0
        """How many values were read back from fake tensors as placeholders."""
        self.balanced_topk = 0
        """How many top-k calls over values this run does not know were given balanced
        indices (module docstring: the balanced-routing assumption)."""

    def __enter__(self) -> LargeTensorsFake:
        if self.lazy_fsdp_chunks:
            self._restore = _install_lazy_fsdp_chunks()
        # torch.tensor(data, device="tpu") makes a CPU tensor, then moves it with every mode
        # set aside (a real copy the emulated device cannot make), unless told to move it
        # through the modes, as FakeTensorMode does for CUDA (torch's only_lift_cpu_tensors).
        self._lift_cpu_only = torch._C._only_lift_cpu_tensors()
        if self.fake_device_types:
            torch._C._set_only_lift_cpu_tensors(True)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch._C._set_only_lift_cpu_tensors(self._lift_cpu_only)
            restore, self._restore = self._restore, None
            if restore is not None:
                restore()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if any(_is_dtensor_type(t) for t in types):
            # DTensor runs the op itself, on its local tensors, while this mode stays active:
            # the local ops (and the functional collectives DTensor issues, loss_parallel's
            # all-reduces among them) come back here. Run here instead, they ran with this mode
            # set aside, and a collective on fake local tensors was never recorded.
            return NotImplemented
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            if func is _READ_BACK:
                value = _value(tensors[0])
                if value is not None:
                    return value.item()
                self.placeholders += 1
                return _placeholder(tensors[0].dtype)
            with self.fake:
                out = (_grouped_mm(*args, **kwargs) if func is _GROUPED_MM
                       else func(*args, **kwargs))
            if func is _DETACH:
                _unmemoise(self.fake, out)
            elif func.namespace == "_c10d_functional":
                _issue(func, args, out)
            self._follow_values(func, args, kwargs, out)
            return out
        if self.fake_device_types and _places_on(args, kwargs, self.fake_device_types):
            # An op of real inputs that puts its result on the emulated device (a factory with
            # device="tpu", t.to("tpu")): every input made fake first, since FakeTensorMode runs
            # an op of real inputs for real, which the device cannot.
            real_args, real_kwargs = args, kwargs
            args, kwargs = tree_map_only(torch.Tensor, self._as_fake, (args, kwargs))
            with self.fake:
                out = func(*args, **kwargs)
            self.faked += 1
            if tensors or sum(o.numel() for o in tree_leaves(out)
                              if isinstance(o, torch.Tensor)) < self.min_elements:
                # A large factory's values are as unknown as on the CPU (a large one is fake)
                self._follow_values(func, real_args, real_kwargs, out)
            return out
        if not tensors:  # a factory: fake if large
            with self.fake:
                shaped = func(*args, **kwargs)
            outputs = [o for o in tree_leaves(shaped) if isinstance(o, torch.Tensor)]
            if outputs and sum(o.numel() for o in outputs) >= self.min_elements:
                self.faked += len(outputs)
                return shaped
        return func(*args, **kwargs)


    def _as_fake(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if isinstance(tensor, FakeTensor) else self.fake.from_tensor(tensor)

    def _follow_values(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out``'s small fake tensors their values when every input's is known
        (module docstring, "Values that sizes depend on")."""
        outs = [o for o in tree_leaves(out) if isinstance(o, FakeTensor)]
        if not outs or sum(o.numel() for o in outs) > _MAX_VALUE_ELEMENTS:
            return
        if func is _TOPK and _value(args[0]) is None:
            values, indices = out
            _set_value(indices, _balanced_indices(indices.shape, args[0].shape, *args[1:3]))
            self.balanced_topk += 1
            return
        if not all(_countable(o.dtype) for o in outs):
            return
        if func.namespace == "_c10d_functional":
            _follow_collective(func, args, out)
            return
        if func is _COPY and _value(args[1]) is not None:
            # Its destination's old values do not matter (a collective's result copied into
            # its output: the count exchange of an MoE run through c10d).
            _set_value(out, _value(args[1]).to(out.dtype).expand(out.shape).clone())
            return
        if func in _SHAPE_ONLY and _value(args[0]) is None:
            # Its input gives only a shape and a dtype: any tensor of them stands for it.
            args = (torch.zeros(args[0].shape, dtype=args[0].dtype), *args[1:])
        try:
            real_args, real_kwargs = tree_map(_value_or_self, (args, kwargs))
        except _Unknown:
            return
        real_out = func(*real_args, **real_kwargs)
        for o, v in zip(tree_leaves(out), tree_leaves(real_out)):
            if isinstance(o, FakeTensor) and isinstance(v, torch.Tensor):
                _set_value(o, v)


# -- values that sizes depend on (module docstring) -------------------------------------------

_MAX_VALUE_ELEMENTS = 1 << 22
"""The largest fake output (elements) whose values are followed (a router's one-hot map of
8,192 tokens over 128 experts is 1 Mi elements)."""
_TOPK = torch.ops.aten.topk.default
_COPY = torch.ops.aten.copy_.default
_GROUPED_MM = torch.ops.aten._grouped_mm.default
_SHAPE_ONLY = frozenset(
    getattr(torch.ops.aten, name).default for name in (
        "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones",
        "new_full", "new_empty")
)
"""Ops whose result depends on their first input's shape and dtype only."""
_VALUE = "_tpu_dist_value"
"""The attribute of a fake tensor holding its known values (a CPU tensor of its shape): an
attribute, not a weak-keyed table, since ``Module.to()`` cannot swap a tensor that has weak
references (:func:`_unmemoise`)."""


def _countable(dtype: torch.dtype) -> bool:
    """Values are followed for integer and bool tensors only: sizes come from them (counts,
    indices, masks); following floating-point data would compute the model on the CPU."""
    return not (dtype.is_floating_point or dtype.is_complex)


class _Unknown(Exception):
    """An input of the op has no known values."""


def _value(tensor: Any) -> torch.Tensor | None:
    return getattr(tensor, _VALUE, None) if isinstance(tensor, FakeTensor) else None


def _set_value(tensor: torch.Tensor, value: torch.Tensor) -> None:
    if tuple(value.shape) == tuple(tensor.shape) and value.dtype == tensor.dtype:
        setattr(tensor, _VALUE, value)


def _value_or_self(leaf: Any) -> Any:
    """An op's argument for running it on known values: a fake tensor's values (else
    :class:`_Unknown`), the CPU for an emulated device, anything else as it is."""
    if isinstance(leaf, FakeTensor):
        value = _value(leaf)
        if value is None:
            raise _Unknown
        return value
    if isinstance(leaf, torch.device) and leaf.type != "cpu":
        return torch.device("cpu")
    return leaf


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch._grouped_mm`` (an MoE's experts) on fake tensors of any floating dtype. Its
    shape rule (torch 2.13's meta kernel) copies CUDA's check for bf16 inputs, while the CPU
    kernel also takes float32 (so a model in float32 ran for real and failed fake): the rule
    is asked in bf16, and the result takes the dtype the op returns (``out_dtype``, else the
    inputs')."""
    if a.dtype == b.dtype == torch.bfloat16:
        return _GROUPED_MM(a, b, *args, **kwargs)
    dtype = kwargs.get("out_dtype") or a.dtype
    out = _GROUPED_MM(a.to(torch.bfloat16), b.to(torch.bfloat16), *args, **kwargs)
    return out.to(dtype)


def _balanced_indices(shape: torch.Size, source: torch.Size, k: int, dim: int = -1
                      ) -> torch.Tensor:
    """Top-k indices as balanced routing picks them: row ``r`` of the ``k`` picked among ``n``
    (the size of ``dim`` in ``source``) takes ``(r k + j) mod n`` for ``j < k``: every one of
    the ``n`` picked equally often (``rows k / n`` times, give or take one)."""
    n = source[dim]
    rows = math.prod(shape) // max(k, 1)
    picks = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k)) % max(n, 1)
    moved = list(shape)
    moved.append(moved.pop(dim))
    return picks.reshape(moved).movedim(-1, dim).contiguous()


def _follow_collective(func: Any, args: tuple, out: Any) -> None:
    """A functional collective's result values, as the recording makes them (every rank passed
    this rank's input: :attr:`tpu_dist.collectives.pipelines.Kind.recorded_output`): its
    input's values, when the shapes agree (a count exchange: balanced counts are the same on
    every rank); ``wait_tensor`` passes them on."""
    source = _value(args[0]) if args else None
    if source is None:
        return
    for o in tree_leaves(out):
        if isinstance(o, FakeTensor) and o.numel() == source.numel():
            _set_value(o, source.reshape(o.shape).to(o.dtype))


def _unmemoise(mode: FakeTensorMode, out: Any) -> None:
    """Drop the weak reference torch's fake mode keeps to every fake op output (its converter
    memoises the output under the fresh meta tensor it wraps, which nothing looks up again),
    for a detached fake tensor: ``nn.Parameter`` is one, and ``Module.to()`` / ``_apply`` swap
    fake parameters with ``torch.utils.swap_tensors``, which refuses a tensor with a weak
    reference (torch 2.13: ``nn.Linear(4, 4).to("cpu")`` fails under a plain
    ``FakeTensorMode``). So ``model.to(device)`` works on a model with fake parameters."""
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo
    for ref in weakref.getweakrefs(out):
        key = getattr(ref, "key", None)
        if key is not None and memo.get(key) is out:
            del memo[key]


def _places_on(args: tuple, kwargs: dict, device_types: frozenset[str]) -> bool:
    """Whether an op's tensors or device arguments are on one of ``device_types``."""
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type in device_types:
                return True
        elif isinstance(leaf, torch.device) and leaf.type in device_types:
            return True
    return False


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


# -- FSDP2's per-rank chunks, lazily (module docstring) ----------------------------------------


class _LazyChunks(Sequence):
    """``torch.chunk(tensor, num_chunks, dim)`` padded with empty tensors to ``num_chunks``
    (FSDP2's ``_chunk_with_empty``), each chunk made when it is read: chunk ``i`` is
    ``tensor.narrow(dim, i * c, min(c, n - i * c))`` for ``c = ceil(n / num_chunks)`` while
    ``i * c < n`` (``torch.chunk``'s views), else ``new_empty(0)`` of the first chunk."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self._tensor, self._num, self._dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self._step = -(-size // num_chunks)
        self._made = -(-size // self._step)  # how many torch.chunk makes
        self._cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self._num

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num))]
        i = index + self._num if index < 0 else index
        if not 0 <= i < self._num:
            raise IndexError(f"chunk {index} of {self._num}")
        if i not in self._cache:
            if i < self._made:
                start = i * self._step
                length = min(self._step, self._tensor.size(self._dim) - start)
                self._cache[i] = self._tensor.narrow(self._dim, start, length)
            else:
                self._cache[i] = self[0].new_empty(0)
        return self._cache[i]


def _install_lazy_fsdp_chunks() -> Callable[[], None] | None:
    """Replace FSDP2's chunking helper by :class:`_LazyChunks` in the module that calls it;
    returns what undoes it, or None (the helper is not there with the expected signature, or
    another mode already replaced it)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param as site
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    original = getattr(site, "_chunk_with_empty", None)
    if original is None or getattr(original, "_tpu_dist_lazy", False):
        return None
    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return None
    if names != ["tensor", "num_chunks", "dim"]:
        return None

    def lazy(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
        if num_chunks <= 1 or tensor.size(dim) == 0:
            return original(tensor, num_chunks, dim)
        return _LazyChunks(tensor, num_chunks, dim)

    lazy._tpu_dist_lazy = True  # type: ignore[attr-defined]
    site._chunk_with_empty = lazy

    def restore() -> None:
        if site._chunk_with_empty is lazy:
            site._chunk_with_empty = original

    return restore
