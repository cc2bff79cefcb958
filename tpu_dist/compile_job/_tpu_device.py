"""TorchTPU's ``"tpu"`` device, emulated for a compile-only run: no TorchTPU, no TPU.

Scripts written for TorchTPU (``torch-tpu``, Google's PyTorch backend) put their tensors on the
device ``"tpu"``, call ``torch.tpu`` as their device module and take their c10d backend from
torch's device map. Frameworks find the device the same way: TorchTitan takes
``torch._utils._get_available_device_type()`` (the PrivateUse1 backend's name when
``torch.<name>.is_available()``), then calls ``set_device``, ``synchronize``, the memory
statistics and ``get_device_properties`` of that module. On a TorchTPU host that is ``"tpu"``
everywhere. :func:`install` makes the compile-only process such a host, as TorchTPU 0.2.0's
loader does (``torch_tpu/_loader.py``, read from its wheel), without its native runtime:

1. **The device string**: PrivateUse1 renamed ``"tpu"`` (``torch.device("tpu:3")`` parses),
   ``Tensor.is_tpu``, ``Tensor.tpu()``, ``Module.tpu()``; torch's PrivateUse1 hooks registered
   from Python (``torch._C._acc``), so that torch's accelerator is ``"tpu"``
   (``torch._C._get_accelerator()``, what ``init_process_group()`` with no backend reads).
2. **The device module** ``torch.tpu`` (:class:`EmulatedTpu`): TorchTPU 0.2.0's public names
   (``is_available``, ``device_count``, ``current_device``, ``set_device``, ``synchronize``,
   ``get_device_name``, ``get_device_properties``, streams, events, RNG state,
   ``get_amp_supported_dtype``, ...) and what frameworks call of a CUDA-like module that
   TorchTPU 0.2.0's lacks: the memory statistics (``memory_stats``, ``memory_allocated``,
   ``max_memory_allocated``, ``reset_peak_memory_stats``, ``empty_cache``, ``mem_get_info``),
   fed from the step meter (:class:`~._step.StepMeter`: the tensor bytes on ``"tpu"`` now and
   at their peak). The values, per TorchTPU's rules: the devices of one emulated host
   (``device_count``: 8 on a TPU7x host, 4 on a v5p host), this rank's device bound to the
   process (``current_device()`` = ``LOCAL_RANK``; ``set_device`` to another index raises
   TorchTPU's ``ValueError``), TorchTPU's device names (``"TPU v7"``) and per-device HBM.
3. **Tensors on "tpu:N"** are fake tensors (:class:`~._fake.LargeTensorsFake`: shapes and
   dtypes, no data), whatever their size: there is no device memory to hold them.
4. **The c10d backend for device "tpu"** is tpu_dist's (the recording group in this mode):
   ``Backend.default_device_backend_map["tpu"]`` and the backend's device list name it, so
   ``init_process_group()`` with no backend, ``init_process_group("tpu")`` and
   ``"cpu:gloo,tpu:tpu"`` / ``"tpu:tpu,cpu:gloo"`` configs all make a recording group, whose
   calls take fake tensors on ``"tpu"`` as they take CPU tensors. (torch 2.13 keeps only the
   first Python process group of a per-device config: the recording group then serves CPU
   tensors too; ``tpu-launch --compile-only`` sets ``TORCH_GLOO_LAZY_INIT=1`` so that a gloo
   backend named first is never connected to the world's thousands of absent ranks.)

The report, memory and step estimate are those of the same script on CPU tensors: the
recorded collectives take the same shapes, and the step meter counts the bytes on ``"tpu"``
as HBM when the script puts tensors there (host tensors then stay out of the count).

**Nothing leaks out of compile-only mode.** Only ``tpu-launch --compile-only``'s job process
installs it (PrivateUse1 cannot be renamed back, so it is done in that process only, after the
compiler process was forked); a normal run in the same environment sees no ``"tpu"`` device.
If torch-tpu is installed, the launcher starts the job with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
so that TorchTPU does not load inside ``import torch`` (it would on a TPU host): a TorchTPU
already loaded is refused here with what to do.

What is not emulated: compute (ops on fake tensors compute nothing), TorchTPU's compiler and
its ``torch.compile`` backend, its autocast rules (``torch.autocast("tpu")`` casts nothing), ``torch.tpu.ops`` / ``pallas`` / ``optimizers`` (they raise an
``AttributeError`` naming this mode), and ``torch.accelerator``'s device index (torch's
Python hooks give no way to set it; it stays 0: use ``torch.tpu.current_device()``).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "DEVICE_TYPE",
    "DeviceMemory",
    "EmulatedTpu",
    "TpuDeviceProperties",
    "device_name",
    "install",
    "installed",
]

DEVICE_TYPE = "tpu"
"""The device string TorchTPU gives PrivateUse1."""

_DEVICE_NAMES = {"v4": "TPU v4", "v5e": "TPU v5e", "v5p": "TPU v5p", "v6e": "TPU v6e",
                 "v7x": "TPU v7"}
"""tpu_dist's generation name -> ``torch.tpu.get_device_name()`` on TorchTPU 0.2.0 (its
``hardware._PCI_DEVICE_ID_TO_NAME``; ``"TPU"`` for a chip it does not know)."""

_AMP_DTYPES = (
    torch.bfloat16, torch.bool, torch.complex128, torch.complex64, torch.float16,
    torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
    torch.float8_e5m2, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.int16, torch.int32,
    torch.int64, torch.int8, torch.uint16, torch.uint32, torch.uint64, torch.uint8,
)
"""``torch.tpu.get_amp_supported_dtype()`` of TorchTPU 0.2.0 (its ``_AMP_SUPPORTED_DTYPES``)."""

_RNG_STATE_BYTES = 16
"""The RNG state a device generator hands out: a seed and an offset, 8 bytes each (the layout
DTensor's offset-based RNG tracker reads and writes, as on CUDA)."""


def device_name(generation: str) -> str:
    """What TorchTPU 0.2.0's ``get_device_name()`` says on a chip of ``generation`` (tpu_dist's
    name: ``"v7x"`` -> ``"TPU v7"``)."""
    return _DEVICE_NAMES.get(generation, "TPU")


@dataclasses.dataclass(frozen=True)
class TpuDeviceProperties:
    """``torch.tpu.get_device_properties()``: TorchTPU 0.2.0's ``_TpuDeviceProperties``."""

    name: str
    total_memory: int
    """HBM one device addresses, in bytes (a TPU7x chip's 192 GiB over its two devices)."""
    multi_processor_count: int = 1


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Tensor bytes on the device, as the step meter tracks them."""

    current: int = 0
    peak: int = 0
    """Since the last :meth:`EmulatedTpu.reset_peak_memory_stats` (or the meter's start)."""


class Stream(torch.Stream):
    """``torch.tpu.Stream``: a stream of the emulated device. Nothing runs, so every wait is
    already satisfied (TorchTPU's streams are placeholders for FSDP's use too). A
    ``torch.Stream``, as TorchTPU's is: device-generic code takes it (``torch.accelerator``),
    and its ``device_type`` is torch's device type number (PrivateUse1), which FSDP2 passes to
    an operator on torch 2.15."""

    def __new__(cls, device: Any = None, priority: int = 0, stream_id: int = 0,
                **kwargs: Any) -> Stream:
        return super().__new__(
            cls, stream_id=stream_id, device_index=_index(device), priority=priority,
            device_type=int(torch._C._autograd.DeviceType.PrivateUse1))

    def __init__(self, device: Any = None, priority: int = 0, stream_id: int = 0,
                 **kwargs: Any) -> None:
        self.priority = priority

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and (other.device, other.stream_id) == (
            self.device, self.stream_id)

    def __hash__(self) -> int:
        return hash((self.device, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.tpu.Stream device={self.device} stream_id={self.stream_id}>"


class Event:
    """``torch.tpu.Event``: completes at once (nothing runs); ``elapsed_time`` is 0."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False, device: Any = None) -> None:
        self.enable_timing = enable_timing
        self.device = torch.device(DEVICE_TYPE, _index(device))

    def record(self, stream: Stream | None = None) -> Event:
        return self

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Event) -> float:
        return 0.0

    def __repr__(self) -> str:
        return "<torch.tpu.Event>"


class _StreamContext:
    """``torch.tpu.stream(s)``: makes ``s`` the current stream inside the block."""

    def __init__(self, owner: EmulatedTpu, stream: Stream | None) -> None:
        self._owner, self._stream, self._previous = owner, stream, None

    def __enter__(self) -> None:
        if self._stream is not None:
            self._previous = self._owner.current_stream()
            self._owner._stream = self._stream

    def __exit__(self, *exc: Any) -> bool:
        if self._previous is not None:
            self._owner._stream = self._previous
        return False


def _index(device: Any) -> int:
    """The device index in ``device`` (an int, ``"tpu:3"``, a torch.device); 0 for ``"tpu"``
    or None (every stream and event belongs to the process's one device)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.index is not None:
        return device.index
    return 0


class EmulatedTpu:
    """The state behind the emulated ``torch.tpu`` (module doc): the host's devices, the one
    this process is bound to, what TorchTPU reports of the chip, the memory counts.

    Args:
        generation: tpu_dist's generation name (``"v7x"``).
        devices_per_host: Devices of one host (``device_count()``).
        local_index: This process's device on its host (``LOCAL_RANK``).
        hbm_bytes: HBM per device (``get_device_properties().total_memory``); None: unknown
            (``get_device_properties`` then raises TorchTPU's ``RuntimeError``).
        memory: The bytes on the device now and at their peak since the last reset (the step
            meter's); None: 0.
        reset_peak: Restart ``memory``'s peak (``reset_peak_memory_stats``).
    """

    def __init__(
        self,
        *,
        generation: str,
        devices_per_host: int,
        local_index: int,
        hbm_bytes: int | None,
        memory: Callable[[], DeviceMemory] | None = None,
        reset_peak: Callable[[], None] | None = None,
    ) -> None:
        if not 0 <= local_index < devices_per_host:
            raise ValueError(
                f"local_index={local_index} is outside the host's {devices_per_host} devices "
                "(LOCAL_RANK must be below LOCAL_WORLD_SIZE)"
            )
        self.generation = generation
        self.devices_per_host = devices_per_host
        self.local_index = local_index
        self.hbm_bytes = hbm_bytes
        self._memory = memory
        self._reset_peak = reset_peak
        self._stream: Stream | None = None  # made on first use: "tpu" parses after install()
        self._rng = torch.zeros(_RNG_STATE_BYTES, dtype=torch.uint8)
        self._seed = 0
        self.module = self._build_module()
        """The ``torch.tpu`` module object (registered by :func:`install`)."""
        self.kernels: torch.library.Library | None = None
        """The device's kernels registered with torch (:func:`install`), kept alive here."""
        self.autocast: torch.library.Library | None = None
        """Its autocast fallthrough (:func:`install`), kept alive here."""

    # -- what TorchTPU 0.2.0's torch.tpu offers -------------------------------------------------

    def is_available(self) -> bool:
        """True: this process is bound to an (emulated) TPU device."""
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        """The devices of this host (TorchTPU: the host's TPU devices)."""
        return self.devices_per_host

    def current_device(self) -> int:
        """This process's device index (TorchTPU binds each process to one device)."""
        return self.local_index

    def set_device(self, device: int | str | torch.device) -> None:
        """Check ``device`` is this process's (TorchTPU cannot switch devices in a process).

        Raises:
            ValueError: another index, or not a TPU device (TorchTPU's messages).
            TypeError: not an int, str or torch.device.
        """
        if isinstance(device, str):
            if device != DEVICE_TYPE:
                raise ValueError(f"Invalid device string {device}")
            index = self.local_index
        elif isinstance(device, torch.device):
            if device.type != DEVICE_TYPE:
                raise ValueError(f"Invalid device type {device.type}")
            index = self.local_index if device.index is None else device.index
        elif isinstance(device, int):
            index = device
        else:
            raise TypeError(f"Got unrecognized device type, {device}")
        if index != self.local_index:
            raise ValueError(
                f"Cannot set TPU device to index {index}, current process is bound to device "
                f"index {self.local_index}. Changing the active TPU device within a process is "
                "not supported."
            )

    def synchronize(self, device: Any = None) -> None:
        """Nothing runs on the emulated device: returns at once."""

    def get_device_name(self, device: Any = None) -> str:
        return device_name(self.generation)

    def get_device_properties(self, device: Any = None) -> TpuDeviceProperties:
        """Raises RuntimeError when the generation's HBM is unknown (as TorchTPU does)."""
        name = self.get_device_name(device)
        if self.hbm_bytes is None:
            raise RuntimeError(f"unrecognized TPU {name!r}; cannot determine device memory")
        return TpuDeviceProperties(name=name, total_memory=self.hbm_bytes)

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return list(_AMP_DTYPES)

    def current_stream(self, device: Any = None) -> Stream:
        if self._stream is None:
            self._stream = Stream(self.local_index)
        return self._stream

    def default_stream(self, device: Any = None) -> Stream:
        return Stream(self.local_index)

    def set_stream(self, stream: Stream) -> None:
        self._stream = stream

    def stream(self, stream: Stream | None) -> _StreamContext:
        return _StreamContext(self, stream)

    def manual_seed(self, seed: int) -> None:
        self._seed = int(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._seed = int(seed)

    def initial_seed(self) -> int:
        return self._seed

    def get_rng_state(self, device: Any = "tpu") -> torch.Tensor:
        """A copy of the device generator's state (16 bytes: seed, offset)."""
        return self._rng.clone()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "tpu") -> None:
        self._rng = new_state.detach().to("cpu", torch.uint8).clone()

    # -- what frameworks call of a CUDA-like module (TorchTPU 0.2.0 has none of these) ----------

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """CUDA's key names that frameworks read (TorchTitan: ``active_bytes.all.peak``,
        ``reserved_bytes.all.peak``, ``num_alloc_retries``, ``num_ooms``), from the step
        meter's tensor bytes on the device (no allocator: reserved = allocated = active)."""
        now = self._memory() if self._memory is not None else DeviceMemory()
        stats = {"num_alloc_retries": 0, "num_ooms": 0}
        for kind in ("allocated_bytes", "active_bytes", "reserved_bytes"):
            stats[f"{kind}.all.current"] = now.current
            stats[f"{kind}.all.peak"] = now.peak
        return stats

    def memory_allocated(self, device: Any = None) -> int:
        return self.memory_stats()["allocated_bytes.all.current"]

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.memory_stats()["allocated_bytes.all.peak"]

    def memory_reserved(self, device: Any = None) -> int:
        return self.memory_stats()["reserved_bytes.all.current"]

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.memory_stats()["reserved_bytes.all.peak"]

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        if self._reset_peak is not None:
            self._reset_peak()

    def reset_max_memory_allocated(self, device: Any = None) -> None:
        self.reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        """No cache to empty."""

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of the device's HBM."""
        total = self.hbm_bytes or 0
        return max(0, total - self.memory_allocated()), total

    # -- the module ------------------------------------------------------------------------------

    _FUNCTIONS = (
        "is_available", "is_initialized", "device_count", "current_device", "set_device",
        "synchronize", "get_device_name", "get_device_properties", "get_amp_supported_dtype",
        "current_stream", "default_stream", "set_stream", "stream", "manual_seed",
        "manual_seed_all", "initial_seed", "get_rng_state", "set_rng_state", "memory_stats",
        "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
        "reset_peak_memory_stats", "reset_max_memory_allocated", "empty_cache", "mem_get_info",
    )

    def _build_module(self) -> types.ModuleType:
        module = _TpuModule("torch.tpu", __doc__)
        for name in self._FUNCTIONS:
            setattr(module, name, getattr(self, name))
        owner = self

        class device:  # noqa: N801 (torch.tpu.device, as torch.cuda.device)
            """``with torch.tpu.device(i)``: ``i`` must be this process's device."""

            def __init__(self, device: Any) -> None:
                self.index = _index(device) if device is not None else -1

            def __enter__(self) -> None:
                if self.index >= 0:
                    owner.set_device(self.index)

            def __exit__(self, *exc: Any) -> bool:
                return False

        module.device = device
        module.device_of = lambda obj: device(
            obj.get_device() if getattr(obj, "device", None) is not None
            and obj.device.type == DEVICE_TYPE else -1)
        module.Stream = Stream
        module.Event = Event
        module.default_generators = ()
        # What torch's PrivateUse1 machinery and DTensor's RNG tracker call.
        module._is_in_bad_fork = lambda: False
        module._lazy_init = lambda: None
        module._is_compiled = lambda: True
        module.emulated = True  # tells tpu_dist's own check (installed()) apart from TorchTPU
        module.__all__ = sorted(n for n in vars(module) if not n.startswith("_"))
        return module


class _TpuModule(types.ModuleType):
    """``torch.tpu`` of the emulation: a name TorchTPU has and the emulation lacks raises an
    ``AttributeError`` that says so."""

    _NOT_EMULATED = frozenset({
        "ops", "pallas", "optimizers", "compiler", "distributed", "profiler", "precision",
        "EagerMode", "Precision", "eager_mode", "set_eager_mode", "allow_excess_precision",
        "topology_aware_mesh",
    })

    def __getattr__(self, name: str) -> Any:
        if name in self._NOT_EMULATED:
            raise AttributeError(
                f"torch.tpu.{name} is TorchTPU's and is not emulated by tpu-launch "
                "--compile-only, which emulates TorchTPU's device (torch.tpu's device, stream, "
                "RNG and memory functions), not its compiler, kernels or runtime"
            )
        raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}")


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """torch's PrivateUse1 hooks, from Python: the accelerator is available."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    """torch's device guard for PrivateUse1, from Python: it names the device type."""

    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


class _NoTorchTpu(importlib.abc.MetaPathFinder):
    """Refuses ``import torch_tpu`` in a process that emulates its device: TorchTPU's import
    installs its own ``torch.tpu`` over the emulation's (its ``public_api.install``)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch_tpu" or name.startswith("torch_tpu."):
            raise ModuleNotFoundError(
                f"No module named {name!r} in this compile-only run: tpu-launch --compile-only "
                "emulates TorchTPU's 'tpu' device and does not load torch-tpu (pass "
                "--tpu-device none to run without the emulation)",
                name=name,
            )
        return None


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on ``"tpu"``, as TorchTPU runs it: its fused kernel,
    torch's ``_scaled_dot_product_fused_attention_overrideable`` (the backend PyTorch keeps
    for PrivateUse1 devices; TorchTPU's graph passes name it), which keeps the output and the
    log-sum-exp for the backward, not the ``s x s`` scores (a flash kernel: what the CPU's
    does too). Without it torch decomposes attention into its math form on a PrivateUse1
    device, with other FLOPs and memory than the same script on CPU tensors."""
    if enable_gqa and key.size(-3) != query.size(-3):
        group = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    return torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale)[0]


def _allow_flex_attention() -> None:
    """FlexAttention on ``"tpu"`` tensors, as TorchTPU 0.2.0 allows it: torch 2.13's
    ``flex_attention`` refuses devices other than CUDA, CPU, XPU, HPU and MPS
    (``_validate_device``), and TorchTPU's loader wraps that check to let ``"tpu"`` through
    (``torch_tpu/_internal/compile/__init__.py``). The emulation does the same, and no more:
    TorchTPU also reroutes a call with no score_mod and no auxiliary output to
    ``scaled_dot_product_attention`` with the mask made dense (a ``(B, H, S, S)`` bias), which
    its compiler may turn back into a causal kernel; here FlexAttention stays the block-sparse
    higher-order op the step meter counts (:mod:`._op_costs`)."""
    from torch.nn.attention import flex_attention

    check = flex_attention._validate_device
    if getattr(check, "_tpu_dist_allows", False):
        return

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != DEVICE_TYPE:
            check(query, key, value)

    validate_device._tpu_dist_allows = True  # type: ignore[attr-defined]
    flex_attention._validate_device = validate_device


def installed() -> EmulatedTpu | None:
    """The emulated device of this process, if :func:`install` ran (else None: also when the
    ``"tpu"`` device is TorchTPU's own)."""
    module = getattr(torch, DEVICE_TYPE, None)
    return getattr(module, "_emulation", None) if getattr(module, "emulated", False) else None


def install(emulation: EmulatedTpu, backend_name: str) -> None:
    """Make ``"tpu"`` a device of this process, served by ``emulation`` (module doc), with
    tpu_dist's backend ``backend_name`` as torch's c10d backend for it. Once per process; it
    cannot be undone (PrivateUse1 keeps its name).

    Raises:
        RuntimeError: PrivateUse1 already has a name (TorchTPU loaded: run with
            ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, which ``tpu-launch --compile-only`` sets where
            torch-tpu is installed; or another backend), or ``torch.tpu`` exists.
    """
    import torch.distributed as dist

    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone" or hasattr(torch, DEVICE_TYPE):
        owner = "TorchTPU (torch-tpu)" if current == DEVICE_TYPE else f"a backend ({current!r})"
        raise RuntimeError(
            f"compile-only mode cannot emulate the 'tpu' device: {owner} already owns torch's "
            f"PrivateUse1 device in this process. Start the job with "
            "TORCH_DEVICE_BACKEND_AUTOLOAD=0 (tpu-launch --compile-only does so where torch-tpu "
            "is installed) and do not import torch_tpu in the script."
        )
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
    emulation.module._emulation = emulation
    torch._register_device_module(DEVICE_TYPE, emulation.module)
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    sys.modules[f"torch.{DEVICE_TYPE}"] = emulation.module
    sys.meta_path.insert(0, _NoTorchTpu())
    _allow_flex_attention()
    # Attention as TorchTPU's kernel runs it (above autograd: the fused op records its own
    # backward); the library must live as long as the process.
    emulation.kernels = torch.library.Library("aten", "IMPL")
    emulation.kernels.impl("scaled_dot_product_attention", _fused_attention,
                           "AutogradPrivateUse1")
    # Autocast on "tpu" (torch.autocast(device_type="tpu"), TorchTitan's MoE router) passes
    # every op through: torch has no autocast kernels for a PrivateUse1 device (TorchTPU
    # registers its casting rules natively; they are not emulated, so ops keep their dtypes).
    emulation.autocast = torch.library.Library("_", "IMPL")
    emulation.autocast.fallback(torch.library.fallthrough_kernel,
                                dispatch_key="AutocastPrivateUse1")
    # tpu_dist's backend serves tensors on "tpu": the device map and the backend's devices.
    dist.Backend.default_device_backend_map[DEVICE_TYPE] = backend_name
    devices = dist.Backend.backend_capability.setdefault(backend_name, [])
    if DEVICE_TYPE not in devices:
        devices.append(DEVICE_TYPE)
