"""One training step of a compile-only run, measured while the script runs: FLOPs, memory, tokens.

:class:`StepMeter` wraps the script's run (inside :class:`~._fake.LargeTensorsFake`, so it sees
fake tensors and costs no memory) and cuts it into steps: **a step ends when an optimizer's
``step()`` returns** (torch's global optimizer hooks; of optimizers stepped by another's
``step``, as TorchTitan's container steps its own, the outermost), and the next begins there.
Per step it keeps:

* **FLOPs**, counted on the ops this rank runs, each priced by :func:`~._op_costs.op_cost`
  (torch's FLOP formulas and the attention kernels it lacks; the step meter's per-op
  accounting, in one place). A DTensor op is counted once, on its local shards: the counter's
  dispatch mode passes DTensor ops on to DTensor (as torch's ``MemTracker`` does) and counts the
  local ops DTensor then runs, so the count is per device, not the global op's; the global op
  that DTensor's sharding propagation runs under a fake mode of its own (to learn the output's
  shape) is not counted either (MemTracker's rule: only ops under the fake mode that was active
  when counting began). Without both, a sharded matmul counts 5x its shard's FLOPs on 4 ranks
  (measured, ``tests/test_step_report.py``). Attention kernels (the CPU's flash kernel, the
  emulated ``"tpu"``'s fused one) count the forward's two ``s x s`` matmuls over the whole
  square (no causal discount, as TorchTitan counts) and a backward of five (it recomputes the
  scores, as flash attention does on a TPU), so attention counts 7/6 of TorchTitan's analytic
  ``12 L H d_h s``; FlexAttention (a higher-order op, which every mode of the meter takes)
  counts the blocks its block mask computes (a causal mask's when the mask's values are fake:
  :mod:`._op_costs`). With activation checkpointing the recomputed forward is counted too:
  these are the FLOPs the device executes.
* **Tokens**: the token ids that go through the step's embedding lookups (``aten.embedding``),
  over the ranks that share them: a DTensor input replicated over a mesh (tensor parallelism's
  embedding) counts ``1 / mesh size`` per rank, as does a lookup on local tensors in the
  forward of an ``nn.Embedding`` whose table is a DTensor sharded over a mesh (TorchTitan's
  vocab-parallel embedding): TorchTitan's tokens per device.
* **Peak tensor bytes**, tracked by torch's :class:`~torch.distributed._tools.mem_tracker.
  MemTracker` (parameters, gradients, optimizer state, activations, temporaries), from the
  step's first module forward (so building the unsharded model before sharding it is not part
  of any step) to its end.
* **Collectives**: the recorder (:class:`~._recording.Recorder`) counts each call under the
  step it was issued in (:attr:`~._recording.RecordedCall.per_step`).

:func:`step_report` turns the chosen step (the last one measured: the second, a steady state, or the
first of a script that runs one) and the compiled collectives into the report's ``"step"`` object.
**Only the first two steps are measured**: after the second the meter's modes and hooks pass every
op through (docs/guides/compile-only.md's 20-step example on ``tpu7x:16x16x16``: the script 13 s ->
8.6 s); the steps are still counted and the recorder still files each call under its step. The modes
stay on torch's mode stack until the script ends (popping them saved nothing more).

The meter never fails the script. When one of its parts raises on something the script does
(measured: MemTracker on an ``nn.Embedding(sparse=True)``'s sparse gradient, ``Cannot access
storage of SparseTensorImpl``), the meter stops measuring from there on (its modes pass every
op through), keeps the first error (:attr:`StepMeter.error`), and the report says the step was
not measured and why. An op during which a mode failed is run again without the meter; an
op's own error (the script's) propagates as it would without the meter.
"""

from __future__ import annotations

import dataclasses
import math
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch._ops import HigherOrderOperator

from tpu_dist.compile_job._compile import _human_bytes, _human_seconds
from tpu_dist.compile_job._estimate import MATMUL_EFFICIENCY, StepEstimate, step_estimate
from tpu_dist.compile_job._op_costs import FusedBytes, OpCost, has_formula, op_cost

if TYPE_CHECKING:
    from tpu_dist.compile_job._compile import CompiledCall, CompileReport
    from tpu_dist.compile_job._recording import Recorder
    from tpu_dist.mesh import Topology

__all__ = ["StepMeter", "StepRecord", "StepReport", "step_report", "write_step_picture"]

_aten = torch.ops.aten


class _Guard:
    """The meter's state shared by its modes and hooks: the first error of any of them, after
    which they all pass through (module docstring)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.done = False
        """Every step to measure was measured: the modes and hooks pass everything through."""

    def fail(self, where: str, err: BaseException) -> None:
        if self.error is None:
            self.error = f"{where}: {type(err).__name__}: {err}"

    def dispatch(self, measured: Any, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """``measured()`` (a mode's own dispatch of ``func``); if it raises, the op once more
        without the mode: the op's own error then propagates, else the meter failed."""
        if self.error is not None or self.done:
            return func(*args, **(kwargs or {}))
        try:
            return measured()
        except Exception as err:
            error = err
        out = func(*args, **(kwargs or {}))  # raises the op's own error (the script's)
        self.fail(f"measuring {func}", error)
        return out

    def hook(self, where: str, run: Any) -> Any:
        """``run()`` (a hook's body); an error stops the meter instead of the script."""
        if self.error is not None or self.done:
            return None
        try:
            return run()
        except Exception as err:
            self.fail(where, err)
            return None


def _is_dtensor_type(t: type) -> bool:
    from torch.distributed.tensor import DTensor

    return issubclass(t, DTensor)


class _LocalOpsMode(TorchDispatchMode):
    """The counter's dispatch mode: leaves DTensor ops to DTensor and counts, with
    :func:`~._op_costs.op_cost`, the local ops it runs (each op once, per device: module
    docstring). Higher-order ops (FlexAttention's) are counted as one op. An op with no FLOP
    formula is decomposed, where it can be, into ops that have one (as torch's
    ``FlopCounterMode`` does)."""

    supports_higher_order_operators = True

    def __init__(self, counter: _OpCounter) -> None:
        super().__init__()
        self.counter = counter
        self.guard = counter.guard
        # As MemTracker does: DTensor's sharding propagation runs the global op under a fake
        # mode of its own to learn the output's shape; that run is not the device's work.
        self._fake_mode_on_entry = active_fake_mode()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if any(_is_dtensor_type(t) for t in types):
            return NotImplemented
        if active_fake_mode() is not self._fake_mode_on_entry:
            return func(*args, **(kwargs or {}))
        return self.guard.dispatch(lambda: self._count(func, args, kwargs or {}), func, args,
                                   kwargs)

    def _count(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if (not isinstance(func, HigherOrderOperator) and not has_formula(func)
                and func is not torch.ops.prim.device.default):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out)
        self.counter.add(cost, self.counter.fusion.op(func, args, kwargs, out, cost.matmul))
        return out


def _shared_by(table: Any) -> int:
    """How many ranks share the ids an ``nn.Embedding``'s forward looks up on plain tensors:
    those its table is sharded over when the lookup runs (a vocab-parallel embedding on local
    tensors, TorchTitan's: every rank of the table's tensor-parallel mesh looks up every id).
    Read at the lookup, when FSDP has gathered the table (its sharding over data-parallel
    ranks, before the forward, is not one)."""
    weight = getattr(table, "weight", None)
    if not _is_dtensor_type(type(weight)):
        return 1
    return math.prod(size for size, placement in zip(weight.device_mesh.shape, weight.placements)
                     if placement.is_shard())


class _OpCounter:
    """The step's op costs summed (:class:`~._op_costs.OpCost`), its mode on torch's mode
    stack while entered."""

    def __init__(self, guard: _Guard) -> None:
        self.guard = guard
        self.flops = 0
        """FLOPs run (every op, recomputation included)."""
        self.token_ids = 0.0
        """Token ids looked up, each counted over the ranks that share it (module doc)."""
        self.forward_flops = 0
        """The model FLOPs of ops run outside autograd's backward (the forward pass; a
        recomputed forward under activation checkpointing runs inside the backward and is not
        here)."""
        self.memory_bytes = 0
        """HBM bytes read and written by memory-bound ops (every op but the matmul-like ones;
        recomputation included), fused (:class:`~._op_costs.FusedBytes`)."""
        self.unfused_memory_bytes = 0
        """The same ops' bytes as each runs alone (:attr:`~._op_costs.OpCost.bytes_moved`)."""
        self.fusion = FusedBytes()
        self.matmul_flops: dict[tuple[int, int, int] | None, int] = {}
        """FLOPs of matmul-like ops by their ``(M, K, N)`` (:attr:`~._op_costs.OpCost.mxu_dims`;
        None: not padded): a few dozen shapes a step, padded to the MXU in the report."""
        self.mode: _LocalOpsMode | None = None
        self.lookup_table: Any = None
        """The ``nn.Embedding`` whose forward is running, for the next embedding lookup on
        plain tensors: the ranks its table is sharded over share the lookup's ids (module doc);
        used once."""

    def add(self, cost: OpCost, fused_bytes: int) -> None:
        """Add one op's ``cost``; ``fused_bytes``: what it moves under the fusion rule."""
        self.flops += cost.flops
        self.memory_bytes += fused_bytes
        if cost.matmul:
            dims = cost.mxu_dims
            self.matmul_flops[dims] = self.matmul_flops.get(dims, 0) + cost.flops
        else:
            self.unfused_memory_bytes += cost.bytes_moved
        if cost.token_ids:
            table, self.lookup_table = self.lookup_table, None
            self.token_ids += cost.token_ids / _shared_by(table)
        if cost.model_flops and torch._C._current_autograd_node() is None:
            self.forward_flops += cost.model_flops

    def __enter__(self) -> _OpCounter:
        self.mode = _LocalOpsMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        mode, self.mode = self.mode, None
        mode.__exit__(*args)


class _DTensorTokens(TorchDispatchMode):
    """Sees an embedding lookup on a DTensor before DTensor runs it, and notes how many ranks
    share its token ids (a Replicate input over a mesh of n ranks: n; plain ids with a DTensor
    table: the table's mesh, over which DTensor replicates them); the local lookup then counts
    ``ids / n`` (:class:`_LocalOpsMode`)."""

    supports_higher_order_operators = True

    def __init__(self, counter: _OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is _aten.embedding.default and any(_is_dtensor_type(t) for t in types):
            return self.counter.guard.dispatch(lambda: self._lookup(func, args, kwargs), func,
                                               args, kwargs)
        return func(*args, **(kwargs or {}))

    def _lookup(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        self.counter.lookup_table = None  # a DTensor lookup: its sharing is worked out here
        weight, ids = args[0], args[1]
        shared = 1
        if _is_dtensor_type(type(ids)):
            for size, placement in zip(ids.device_mesh.shape, ids.placements):
                if placement.is_replicate():
                    shared *= size
        elif _is_dtensor_type(type(weight)):
            # Plain ids with a DTensor table (TorchTitan's tensor parallelism): DTensor takes
            # them as replicated over the table's mesh (implicit replication).
            shared = weight.device_mesh.size()
        before = self.counter.token_ids
        out = func(*args, **(kwargs or {}))
        added = self.counter.token_ids - before
        self.counter.token_ids = before + added / shared
        return out


def _run_flex_attention_eagerly() -> Any:
    """Let FlexAttention run under the meter's modes; returns what undoes it.

    Eager ``flex_attention`` compiles its higher-order op with ``torch.compile(...,
    fullgraph=True)``, and Dynamo traces nothing while a dispatch mode of this kind is active
    ("non-infra torch dispatch mode present"): the call fails ("found no compiled frames").
    With torch's ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` the op is called directly, through
    the modes, which count it (its debug switch: the values of a compile-only run are not
    meaningful anyway)."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return None
    before = getattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    if before is None or before:
        return None
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True

    def restore() -> None:
        flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before

    return restore


class _PeakBytes:
    """The peak part of :func:`_peak_tracker`'s tracker (mixed in before ``MemTracker``): the
    overall peak, restartable at a step's start, and the device's bytes (``device_type``: the
    bytes on devices of that type whenever the script put any there, else every device's)."""

    device_peak = 0
    """The device's bytes at their peak since :meth:`restart_device_peak`."""
    _total_key: str
    """MemTracker's key of a snapshot's total (set by the class :func:`_peak_tracker` makes)."""

    def __init__(self, *, device_type: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._device_type = device_type

    def restart_peak(self) -> None:
        """The peak from now on (what ``__enter__`` does)."""
        snap = self.get_tracker_snapshot("current")
        self._peak_mem_snap = snap
        self._peak_mem = {dev: s[self._total_key] for dev, s in snap.items()}

    def _device_snaps(self, snaps: dict) -> list[dict]:
        """The snapshots that count as the device's (class doc)."""
        if self._device_type is not None:
            mine = [s for dev, s in snaps.items() if dev.type == self._device_type]
            if any(s[self._total_key] for s in mine):
                return mine
        return list(snaps.values())

    def peak(self) -> tuple[int, dict[str, int]]:
        """Peak bytes on the device since :meth:`restart_peak`, and what they held."""
        total, kinds = 0, {}
        for dev_snap in self._device_snaps(self._peak_mem_snap):
            total += dev_snap[self._total_key]
            for k, v in dev_snap.items():
                if k != self._total_key and v:
                    name = getattr(k, "value", str(k))
                    kinds[name] = kinds.get(name, 0) + v
        return total, kinds

    def device_bytes(self) -> int:
        """The device's bytes now."""
        return sum(s[self._total_key] for s in self._device_snaps(self._curr_mem_snap))

    def restart_device_peak(self) -> None:
        self.device_peak = self.device_bytes()

    def _update_peak_stats(self, peak_state: Any) -> None:
        # The overall peak only: MemTracker's per-module peaks look at every module on
        # every op (minutes at 126 layers) and are not reported here.
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[self._total_key]:
                self._peak_mem[dev] = dev_snap[self._total_key]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)
        if self._device_type is not None:
            self.device_peak = max(self.device_peak, self.device_bytes())


class _GuardedHooks:
    """The hooks part of :func:`_peak_tracker`'s tracker (mixed in before ``MemTracker``): each
    of MemTracker's hooks run under ``guard``."""

    def __init__(self, *, guard: _Guard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._guard = guard

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        def run() -> None:
            try:
                super(_GuardedHooks, self)._pre_fw_hook(module, inputs)
            except NotImplementedError:  # a root module again in the same step
                self.reset_mod_stats()  # (gradient accumulation)
                super(_GuardedHooks, self)._pre_fw_hook(module, inputs)

        self._guard.hook("MemTracker's pre-forward hook", run)

    # The three hooks below keep per-module snapshots only (not reported here). A module
    # whose stats were reset within the step has none to add to: a module run again at the
    # top level in one step (TorchTitan's chunked loss runs the final norm and the output
    # projection chunk by chunk) resets every module's stats (_pre_fw_hook above), and the
    # modules whose forward ran before then reach their backward untracked.

    def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
        if module in self.memory_tracking:
            self._guard.hook("MemTracker's post-forward hook", lambda: super(
                _GuardedHooks, self)._post_fw_hook(module, inputs, outputs))

    def _pre_bw_hook(self, module: Any, args: Any) -> None:
        if module in self.memory_tracking:
            self._guard.hook("MemTracker's pre-backward hook",
                             lambda: super(_GuardedHooks, self)._pre_bw_hook(module, args))

    def _post_bw_hook(self, module: Any, args: Any) -> None:
        if module in self.memory_tracking:
            self._guard.hook("MemTracker's post-backward hook",
                             lambda: super(_GuardedHooks, self)._post_bw_hook(module, args))

    def _track_optimizer_states(self, *args: Any) -> None:
        self._guard.hook("MemTracker's optimizer-state tracking",
                         lambda: super(_GuardedHooks, self)._track_optimizer_states(*args))

    def _update_and_maybe_create_winfos(self, *args: Any, **kwargs: Any) -> set:
        # Also what its gradient hooks call, from autograd.
        found = self._guard.hook("MemTracker's tensor tracking", lambda: super(
            _GuardedHooks, self)._update_and_maybe_create_winfos(*args, **kwargs))
        return set() if found is None else found


def _peak_tracker(guard: _Guard, device_type: str | None = None) -> Any:
    """A :class:`MemTracker` whose peak can be restarted at a step's start (:class:`_PeakBytes`),
    its dispatch and hooks under ``guard`` (:class:`_GuardedHooks`); None if torch's tracker is
    missing. With ``device_type`` (the emulated ``"tpu"``), the device's memory is the bytes on
    devices of that type whenever the script put any there (host tensors are not HBM then),
    else every device's."""
    try:
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    except ImportError:  # pragma: no cover - torch without the tracker
        return None

    class _PeakTracker(_PeakBytes, _GuardedHooks, MemTracker):
        supports_higher_order_operators = True  # FlexAttention's ops: tracked like any other
        _total_key = _TOTAL_KEY

        # Defined here, on the TorchDispatchMode subclass itself: its __init_subclass__ wraps
        # the __torch_dispatch__ a class defines (torch._disable_dynamo), not a mixin's.
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            return guard.dispatch(
                lambda: super(_PeakTracker, self).__torch_dispatch__(func, types, args, kwargs),
                func, args, kwargs)

    return _PeakTracker(guard=guard, device_type=device_type)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one step of the script did on this rank."""

    index: int
    """0 for the first step."""
    flops: int
    """FLOPs this rank ran in the step (module docstring)."""
    tokens: float
    """Tokens this device is credited with (module docstring); 0 if no embedding ran."""
    peak_bytes: int | None
    """Peak tensor bytes in the step; None when memory was not tracked."""
    peak_breakdown: dict[str, int]
    """What the peak held: ``Parameter``, ``Gradient``, ``Optstate``, ``Activation``, ``Temp``,
    ... (MemTracker's kinds) -> bytes."""
    model_flops: int | None = None
    """The step's model FLOPs (MFU's numerator): 3x its forward pass's FLOPs, which is
    TorchTitan's 6N + 12 L H d_h s a token (each matmul's backward is twice its forward; no
    recomputation, no causal discount); None: take :attr:`flops`."""
    memory_bytes: int = 0
    """HBM bytes read and written by the step's memory-bound ops, fused
    (:class:`~._op_costs.FusedBytes`; recomputation included)."""
    unfused_memory_bytes: int = 0
    """The same ops' bytes as each runs alone (:attr:`~._op_costs.OpCost.bytes_moved`)."""
    matmul_flops: dict[tuple[int, int, int] | None, int] = dataclasses.field(
        default_factory=dict)
    """The step's matmul FLOPs by ``(M, K, N)`` (None: a convolution, not padded)."""


class StepMeter:
    """Measures each step of the script it wraps (module docstring). A context manager, entered
    inside :class:`~._fake.LargeTensorsFake` on the thread that runs the script.

    Args:
        recorder: The session's recorder; its :attr:`~._recording.Recorder.step` is advanced
            at each step's end.
        track_memory: Track tensor bytes with MemTracker (default True).
        device_type: The device whose bytes are the step's memory when the script puts
            tensors on it (the emulated ``"tpu"``: host tensors are then not counted); None:
            every device's (a script on CPU tensors, which stand for the device's).
        measure: How many steps to measure (default 2: the first may build lazily what the
            others reuse); the later ones are only counted.
    """

    def __init__(
        self, recorder: Recorder | None = None, *, track_memory: bool = True, measure: int = 2,
        device_type: str | None = None,
    ) -> None:
        self.recorder = recorder
        self.steps: list[StepRecord] = []
        """Every measured step, in order."""
        self.steps_run = 0
        """Steps the script completed (measured or not)."""
        self._measure = measure
        self._guard = _Guard()
        self._flops = _OpCounter(self._guard)
        self._tokens = _DTensorTokens(self._flops)
        self._memory = _peak_tracker(self._guard, device_type) if track_memory else None
        self._hooks: list[Any] = []
        self._flops_at_start = 0
        self._forward_flops_at_start = 0
        self._tokens_at_start = 0.0
        self._fresh = True  # no module forward yet in this step
        self._flex_eager: Any = None
        self._optimizers_stepping = 0
        """Optimizer steps running (nested: TorchTitan's container is an optimizer whose
        ``step`` steps each of its optimizers; only the outermost ends a training step)."""

    def __enter__(self) -> StepMeter:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        # The token mode on top: it must see a DTensor lookup before MemTracker (which passes
        # DTensor ops on to DTensor unseen by the modes below it) does.
        self._flops.__enter__()
        if self._memory is not None:
            self._memory.__enter__()
        self._tokens.__enter__()
        self._hooks = [
            register_optimizer_step_pre_hook(self._step_starting),
            register_optimizer_step_post_hook(self._step_done),
            register_module_forward_pre_hook(self._forward),
        ]
        self._flex_eager = _run_flex_attention_eagerly()
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        restore, self._flex_eager = self._flex_eager, None
        if restore is not None:
            restore()
        self._tokens.__exit__(*exc)
        if self._memory is not None:
            self._memory.__exit__(*exc)
        self._flops.__exit__(*exc)

    @property
    def error(self) -> str | None:
        """Why the meter stopped measuring (where, the error), or None (module docstring)."""
        return self._guard.error

    def _forward(self, module: Any, inputs: Any) -> None:
        self._guard.hook("the step meter's forward hook", lambda: self._forward_body(module))

    def _forward_body(self, module: Any) -> None:
        if isinstance(module, torch.nn.Embedding):
            self._flops.lookup_table = module
        if self._fresh:
            self._fresh = False
            if self._memory is not None:
                self._memory.restart_peak()

    def _step_starting(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizers_stepping += 1

    def _step_done(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizers_stepping = max(0, self._optimizers_stepping - 1)
        if self._optimizers_stepping:
            return  # an optimizer stepped by another's step: the outer one ends the step
        self.steps_run += 1
        if self.recorder is not None:
            self.recorder.step = self.steps_run
        if self._guard.done or self._guard.error is not None:
            return
        self._guard.hook("the step meter's optimizer hook", lambda: self._step_done_body())
        if len(self.steps) >= self._measure:
            self._guard.done = True  # from here on every mode and hook passes through

    def _step_done_body(self) -> None:
        flops = self._flops.flops
        forward = self._flops.forward_flops
        tokens = self._flops.token_ids
        peak, kinds = self._memory.peak() if self._memory is not None else (None, {})
        self.steps.append(StepRecord(
            index=len(self.steps), flops=flops - self._flops_at_start,
            tokens=tokens - self._tokens_at_start, peak_bytes=peak, peak_breakdown=kinds,
            model_flops=3 * (forward - self._forward_flops_at_start),
            memory_bytes=self._flops.memory_bytes, matmul_flops=dict(self._flops.matmul_flops),
            unfused_memory_bytes=self._flops.unfused_memory_bytes,
        ))
        self._flops.memory_bytes, self._flops.matmul_flops = 0, {}
        self._flops.unfused_memory_bytes = 0
        self._flops.fusion.end_group()  # no fusion across a step's end
        self._flops_at_start, self._tokens_at_start = flops, tokens
        self._forward_flops_at_start = forward
        self._fresh = True
        if self._memory is not None:
            # The next forward of the root module is a new step, not the error MemTracker
            # raises for a module run twice.
            self._memory.reset_mod_stats()

    def device_memory(self) -> tuple[int, int]:
        """The tensor bytes on the device now and at their peak since
        :meth:`restart_device_peak` (0, 0 without memory tracking): what the emulated
        ``torch.tpu.memory_stats()`` reports. Frozen once the measured steps are done."""
        if self._memory is None:
            return 0, 0
        return self._memory.device_bytes(), self._memory.device_peak

    def restart_device_peak(self) -> None:
        """The peak of :meth:`device_memory` from now on (``reset_peak_memory_stats``)."""
        if self._memory is not None:
            self._memory.restart_device_peak()

    def chosen(self) -> StepRecord | None:
        """The step the report describes: the last one measured (None: no optimizer step, or
        the meter failed: :attr:`error`)."""
        if self.error is not None:
            return None
        return self.steps[-1] if self.steps else None


# -- the report's "step" object ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """One recorded collective's share of the step."""

    op: str
    group_size: int
    mesh_dim: str | None
    bytes_per_rank: int
    origin: str
    overlappable: bool
    calls: int
    """Calls in the step."""
    seconds: float
    """``calls * est_seconds``."""
    first_call: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepReport:
    """The report's ``"step"`` object: the estimate (:class:`StepEstimate`'s fields first)
    and what it was made of."""

    estimate: StepEstimate
    step_index: int
    """Which step (0-based) of ``steps_run`` was measured: the last completed."""
    steps_run: int
    tokens_per_device: float
    peak_flops_per_s: float
    tensor_peak_bytes: int | None
    """MemTracker's peak of the step (``hbm_peak_bytes`` less ``program_temp_bytes``)."""
    memory: dict[str, int]
    """What the tensor peak held, by MemTracker's kind (bytes)."""
    program_temp_bytes: int
    """The largest scratch (``temp_bytes``) of the programs the step runs."""
    costs: tuple[StepCost, ...]
    """Every collective the step issued, costliest first."""
    unestimated: int
    """Collective kinds of the step with no time (did not compile is not one of them)."""
    unfused_memory_bytes: int = 0
    """The memory-bound ops' bytes as each runs alone (``memory_bound_bytes`` is them fused)."""

    @property
    def costliest(self) -> tuple[StepCost, ...]:
        """The five collectives costing most per step."""
        return self.costs[:5]

    @property
    def fits(self) -> bool | None:
        e = self.estimate
        if e.hbm_peak_bytes is None or e.hbm_capacity_bytes is None:
            return None
        return e.hbm_peak_bytes <= e.hbm_capacity_bytes

    def hbm_verdict(self) -> str:
        """``fits (X of Y GiB)``, ``short by X GiB (...)`` or ``unknown``."""
        e = self.estimate
        if self.fits is None:
            return "unknown"
        need, have = e.hbm_peak_bytes / 2**30, e.hbm_capacity_bytes / 2**30
        if self.fits:
            return f"fits ({need:.1f} of {have:.1f} GiB)"
        return f"short by {need - have:.1f} GiB (needs {need:.1f}, has {have:.1f} GiB)"

    def to_json(self) -> dict[str, Any]:
        return self.estimate.to_json() | {
            "hbm_fits": self.fits,
            "hbm_verdict": self.hbm_verdict(),
            "step_index": self.step_index,
            "steps_run": self.steps_run,
            "tokens_per_device": self.tokens_per_device,
            "peak_flops_per_s": self.peak_flops_per_s,
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "memory_bytes": self.memory,
            "program_temp_bytes": self.program_temp_bytes,
            "collectives": [c.to_json() for c in self.costs],
            "unestimated_collectives": self.unestimated,
            "memory_bound_bytes_unfused": self.unfused_memory_bytes,
            "rules": STEP_RULES,
        }

    def format_lines(self) -> list[str]:
        """A short summary for the terminal table."""
        e = self.estimate
        lines = [
            f"step (the {_ordinal(self.step_index + 1)} of {self.steps_run}, per device): "
            f"{e.flops_per_device / 1e12:.4g} TFLOP, compute {_secs(e.compute_seconds)} at "
            f"peak, communication {_secs(e.comm_seconds)} of which {_secs(e.exposed_comm_seconds)}"
            f" exposed; step >= {_secs(e.step_seconds)}, MFU <= {100 * e.mfu_bound:.1f} %, "
            f"<= {e.tokens_per_second_per_device:,.0f} tokens/s per device",
        ]
        if e.predicted_seconds is not None:
            lines.append(
                f"predicted step: {_secs(e.predicted_seconds)} (matmuls "
                f"{_secs(e.predicted_matmul_seconds)} at {MATMUL_EFFICIENCY:.0%} of the "
                f"MXU-padded peak, memory-bound ops {_secs(e.predicted_memory_seconds)} at HBM "
                f"bandwidth fused, exposed communication "
                f"{_secs(e.predicted_exposed_comm_seconds)}), MFU ~{100 * e.predicted_mfu:.1f} %,"
                f" ~{e.predicted_tokens_per_second_per_device:,.0f} tokens/s per device")
        lines += [
            f"memory per device: {self.hbm_verdict()}; tensors at peak "
            + (", ".join(f"{k} {_gib(v)}" for k, v in sorted(self.memory.items(),
                                                              key=lambda kv: -kv[1]))
               or "not tracked")
            + f"; largest program scratch {_gib(self.program_temp_bytes)}",
        ]
        if self.unestimated:
            lines.append(
                f"({self.unestimated} kind(s) of collective in the step have no time: their "
                "groups stay within one chip: one device, nothing moves, or a TPU7x chip's two "
                "cores, whose die-to-die link the model does not price)")
        if self.costliest:
            lines.append("costliest collectives per step:")
            for c in self.costliest:
                lines.append(
                    f"  {_secs(c.seconds):>9}  {c.calls:>4} x {c.op} over {c.group_size} "
                    f"({c.mesh_dim or '-'}, {c.origin}, "
                    f"{'overlappable' if c.overlappable else 'critical path'}), "
                    f"{_gib(c.bytes_per_rank)}/rank"
                )
        return lines


STEP_RULES = (
    "flops: torch's FLOP formulas on this rank's local ops (DTensor ops once, on their shards; "
    "attention without causal discount, backward recomputing the scores; FlexAttention over "
    "the blocks its block mask computes, a causal mask's when its values are fake; "
    "recomputation under activation checkpointing included); compute_seconds: flops at the device's peak bf16 "
    "rate; collectives: each call's est_seconds, FSDP's and DDP's overlappable (hidden up to "
    "compute_seconds), DTensor's (tensor parallelism) and the script's own on the critical "
    "path; step_seconds = compute + exposed, a lower bound; mfu_bound = model_flops / "
    "(step_seconds * peak), model_flops = 3 x the forward pass's flops (TorchTitan's 6N + "
    "12 L H d_h s a token: no recomputation, no causal discount); predicted_seconds = matmul "
    "flops padded to the MXU's tiles at peak x MATMUL_EFFICIENCY (fitted once on a published "
    "TPU7x step) + the memory-bound ops' bytes at HBM bandwidth, fused (each run of them "
    "between two matmuls or collectives one fusion: an input it wrote itself is free, other "
    "inputs are read once, an output is written only if read after the run; "
    "memory_bound_bytes_unfused: every op's inputs and outputs) + the critical-path collectives + the overlappable ones beyond that "
    "compute; predicted_mfu = model_flops / (predicted_seconds * peak); hbm_peak_bytes = MemTracker's peak tensor bytes in the step + the largest "
    "program scratch (temp_bytes); XLA's fusion buffers for compute are not included"
)


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


_secs = _human_seconds


def _gib(n: int) -> str:
    """The step report's byte counts: the compile report's format with 2 decimals."""
    return _human_bytes(n, digits=2)


def step_report(
    record: StepRecord,
    steps_run: int,
    rows: list[CompiledCall],
    per_step_calls: list[int],
    topology: Topology,
) -> StepReport | None:
    """The ``"step"`` object for ``record`` (module docstring).

    Args:
        record: The measured step.
        steps_run: How many steps the script completed.
        rows: The report's collectives.
        per_step_calls: For each row, its calls in ``record``'s step.
        topology: The target world (the generation's peak FLOP/s and HBM).

    Returns:
        None when the generation has no peak FLOP/s figure.
    """
    gen = topology.generation
    peak = gen.peak_bf16_flops_per_device
    if peak is None:
        return None
    costs, overlappable, critical, unestimated, temp = [], 0.0, 0.0, 0, 0
    for row, calls in zip(rows, per_step_calls):
        if not calls:
            continue
        if row.temp_bytes is not None:
            temp = max(temp, row.temp_bytes)
        if row.est_seconds is None:
            unestimated += 1
            continue
        seconds = calls * row.est_seconds
        if row.overlappable:
            overlappable += seconds
        else:
            critical += seconds
        costs.append(StepCost(
            op=row.op, group_size=row.group_size, mesh_dim=row.mesh_dim,
            bytes_per_rank=row.bytes_per_rank, origin=row.origin,
            overlappable=row.overlappable, calls=calls, seconds=seconds,
            first_call=row.first_call,
        ))
    hbm_peak = None if record.peak_bytes is None else record.peak_bytes + temp
    estimate = step_estimate(
        flops_per_device=record.flops,
        peak_flops_per_s=peak,
        tokens_per_device=record.tokens,
        overlappable_comm_seconds=overlappable,
        critical_comm_seconds=critical,
        hbm_capacity_bytes=gen.hbm_bytes_per_device,
        hbm_peak_bytes=hbm_peak,
        model_flops_per_device=record.model_flops,
        matmul_flops=dict(record.matmul_flops) or None,
        memory_bytes=record.memory_bytes,
        hbm_bytes_per_s=gen.hbm_bytes_per_s_per_device,
        mxu_size=gen.mxu_size,
    )
    return StepReport(
        estimate=estimate,
        step_index=record.index,
        steps_run=steps_run,
        tokens_per_device=record.tokens,
        peak_flops_per_s=peak,
        tensor_peak_bytes=record.peak_bytes,
        memory=dict(record.peak_breakdown),
        program_temp_bytes=temp,
        costs=tuple(sorted(costs, key=lambda c: -c.seconds)),
        unestimated=unestimated,
        unfused_memory_bytes=record.unfused_memory_bytes,
    )


def step_svg(step: StepReport, title: str) -> str:
    """Where the step's time goes, as an SVG drawing (no plotting library needed): one bar for
    the step (compute, then exposed communication), one for all communication (the part hidden
    under compute and the exposed part), and a bar per costly collective."""
    e = step.estimate
    total = max(e.step_seconds, e.comm_seconds, 1e-12)
    width, left, bar_w, row_h = 860, 250, 560, 26
    rows: list[tuple[str, list[tuple[float, str, str]]]] = [
        ("step (lower bound)", [(e.compute_seconds, "#4878d0", "compute"),
                                (e.exposed_comm_seconds, "#d65f5f", "exposed communication")]),
        ("all communication", [(e.comm_seconds - e.exposed_comm_seconds, "#95b4e8",
                                "hidden under compute"),
                               (e.exposed_comm_seconds, "#d65f5f", "exposed")]),
    ]
    for c in step.costliest:
        color = "#95b4e8" if c.overlappable else "#d65f5f"
        rows.append((f"{c.calls} x {c.op} /{c.group_size} ({c.origin})", [(c.seconds, color, "")]))
    height = 70 + row_h * len(rows) + 40
    out = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'font-family="sans-serif" font-size="12">'),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14">{_xml(title)}</text>',
        (f'<text x="10" y="40">{_xml(f"step >= {_secs(e.step_seconds)}, MFU <= ")}'
         f'{100 * e.mfu_bound:.1f} %, memory {_xml(step.hbm_verdict())}</text>'),
    ]
    y = 60
    for label, parts in rows:
        out.append(f'<text x="{left - 8}" y="{y + 17}" text-anchor="end">{_xml(label)}</text>')
        x = float(left)
        for seconds, color, name in parts:
            w = bar_w * seconds / total
            if w > 0:
                out.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{max(w, 0.5):.1f}" '
                           f'height="{row_h - 8}" fill="{color}"><title>{_xml(name)} '
                           f'{_secs(seconds)}</title></rect>')
            x += w
        total_row = sum(p[0] for p in parts)
        out.append(f'<text x="{x + 6:.1f}" y="{y + 17}">{_secs(total_row)}</text>')
        y += row_h
    legend = [("#4878d0", "compute at peak"), ("#95b4e8", "overlappable (FSDP/DDP)"),
              ("#d65f5f", "exposed / critical path")]
    x = 10
    for color, name in legend:
        out.append(f'<rect x="{x}" y="{y + 10}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 21}">{_xml(name)}</text>')
        x += 40 + 7 * len(name)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_step_picture(report: CompileReport, report_path: str) -> str:
    """Write where ``report``'s step goes (compute, exposed and hidden communication, the
    costliest collectives) as an SVG drawing next to the JSON report (``X.json`` ->
    ``X.step.svg``); returns its path.

    Raises:
        ValueError: the report has no step (the script completed no optimizer step).
    """
    if report.step is None:
        raise ValueError("the report has no step (the script completed no optimizer step)")
    base = report_path[:-5] if report_path.endswith(".json") else report_path
    path = base + ".step.svg"
    title = (f"{report.topology} x {report.num_slices} slice(s), {report.num_devices} devices: "
             "one step per device (tpu-launch --compile-only)")
    with open(path, "w") as f:
        f.write(step_svg(report.step, title))
    return path
