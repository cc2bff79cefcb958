"""Every private JAX/jaxlib call tpu_dist makes, each beside its public fallback.

The private calls save time on the hot path of every collective: jaxlib's direct DLPack import
and export and the loaded executable's own ``execute`` on single-device blocks
(docs/decisions/0002-direct-dlpack-and-execute.md), and draining jaxlib's queue of deferred
buffer frees (result blocks otherwise stay allocated until Python's next garbage collection); on
a new group, loading the program another group of the same size compiled instead of compiling
(docs/decisions/0010-one-cpu-program-per-group-size.md). None is
a stable API, so each is reached here only, and when one is missing or its signature changed
the public call is used instead and a warning says so, once per call per process:

========================  =============================================  ========================
what                      private                                        public fallback
========================  =============================================  ========================
DLPack import             ``_jax.dlpack_managed_tensor_to_buffer``       ``jax.dlpack.from_dlpack``
DLPack export             ``_jax.buffer_to_dlpack_managed_tensor``       ``torch.from_dlpack``
start a program           ``Compiled._executable.xla_executable          ``Compiled.__call__`` on
                          .execute``                                     global arrays
free deferred results     ``_jax.collect_garbage``                       Python's garbage collector
load a program onto       ``compiler.get_compile_options``, a client's   compile the program for
other devices (CPU)       ``deserialize_executable`` with them, and      those devices
                          ``jax.stages.Compiled`` built by hand
keep a program out of     a thread-local ``persistent_cache_min_         none: the executable is
JAX's persistent cache    compile_time_secs`` (``jax._src.config``)      written (compile-only
                                                                         ones then warn on read)
========================  =============================================  ========================

Two private calls have no public fallback, because JAX has no public way to do what they do:
``jax.distributed.initialize`` always starts the coordination service inside process 0. A
service that outlives every rank (tpu-launch's, so that rank 0's death does not end the others)
is started with ``_service.start_coordination_service`` (``_jax.get_distributed_runtime_service``,
kept out of this module so that a launcher need not import JAX), and each rank, rank 0 included, joins it with :func:`connect_to_service`, which does what
``jax.distributed.initialize`` does for a process other than 0 (``_jax.
get_distributed_runtime_client``, ``connect``, then JAX's ``distributed.global_state``). When
either is missing or changed they raise a ``RuntimeError`` that says so and how to do without
(unset ``TPU_DIST_COORDINATION_SERVICE``: rank 0 hosts the service, as before).
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
import torch

from tpu_dist import _process
from tpu_dist.collectives._service import no_service_api

logger = logging.getLogger(__name__)

try:
    from jax._src.lib import _jax as _lib
except ImportError:  # pragma: no cover - another jaxlib
    _lib = None

_collect_garbage = getattr(_lib, "collect_garbage", None)
try:
    from jax._src.config import persistent_cache_min_compile_time_secs as _min_cached_compile_time
except ImportError:  # pragma: no cover - another jax
    _min_cached_compile_time = None
try:
    from jax._src.compiler import get_compile_options as _get_compile_options
    from jax._src.lib import xla_client as _xc
except ImportError:  # pragma: no cover - another jax
    _get_compile_options = _xc = None
try:
    from jax._src import distributed as _distributed
    from jax._src import xla_bridge as _xla_bridge
except ImportError:  # pragma: no cover - another jax
    _distributed = _xla_bridge = None

_FALLBACKS = {
    "dlpack_import": "jaxlib's dlpack_managed_tensor_to_buffer -> jax.dlpack.from_dlpack "
    "(~100 us more per tensor handed to JAX)",
    "dlpack_export": "jaxlib's buffer_to_dlpack_managed_tensor -> torch.from_dlpack "
    "(~30 us more per result block)",
    "execute": "the loaded executable's execute -> Compiled.__call__ on global arrays "
    "(~120 us more per collective)",
    "collect_garbage": "jaxlib's collect_garbage -> Python's garbage collector (result blocks "
    "are freed at the next collection, not after each call)",
    "uncached": "a thread-local JAX cache setting -> none (compile-only executables are "
    "written to JAX's persistent cache, and every later read of one warns that it cannot load)",
    "load_onto": "loading a program compiled for other devices of the same layout (JAX's "
    "get_compile_options, a client's deserialize_executable with compile options) -> "
    "compiling the program for each group's devices (35-320 ms per new group instead of "
    "~2 ms on CPU)",
}
"""Name of each private call -> what replaces it and what that costs."""


def x64_scope() -> contextlib.AbstractContextManager:
    """A thread-local scope in which JAX keeps 64-bit dtypes: JAX truncates int64/float64
    unless ``jax_enable_x64`` is on, and that flag is the user's; every JAX call of the package
    runs inside this scope instead, leaving the user's configuration as it was."""
    return jax.enable_x64(True)


def fell_back(name: str, reason: object = None) -> None:
    """Log, once per process, that private call ``name`` is replaced by its public fallback."""
    if not _process.first_time(f"{__name__}:{name}"):
        return
    why = f" ({reason})" if reason is not None else " (not in this jaxlib)"
    logger.warning("tpu_dist: using a public fallback%s: %s.", why, _FALLBACKS[name])


def collect_garbage() -> None:
    """Free result blocks whose tensors are gone.

    A block handed to torch through DLPack is released by the tensor's deleter, which jaxlib
    defers to a queue it drains only in Python's garbage collection (a gc callback, jax issue
    14882): until the next collection every result block stays allocated, so two 1.5 GiB
    all_reduces held 4.9 GiB. Draining the queue after each call frees it at once.
    """
    private = _collect_garbage
    if private is not None:
        private()
    else:
        fell_back("collect_garbage")


class JaxlibCalls:
    """The private calls that change state as they are used: one object per runtime
    (``Runtime.jaxlib``, handed to its ``ProgramCache``), holding which of them still work.

    Each starts as this jaxlib offers it; one that raises ``TypeError`` (its signature changed)
    is replaced by its public fallback from then on, logged once per process
    (:func:`fell_back`).
    """

    def __init__(self) -> None:
        self.import_call = getattr(_lib, "dlpack_managed_tensor_to_buffer", None)
        """jaxlib's DLPack import, or None once it failed (or this jaxlib lacks it)."""
        self.export_call = getattr(_lib, "buffer_to_dlpack_managed_tensor", None)
        """jaxlib's DLPack export, or None once it failed (or this jaxlib lacks it)."""
        self.execute_usable = True
        """Whether a loaded executable's own ``execute`` is used (False after
        :meth:`execute_failed`)."""

    def dlpack_import(self, flat: torch.Tensor, device: jax.Device) -> jax.Array:
        """A 1-D CPU tensor as a JAX array on ``device``, zero-copy (DLPack)."""
        private = self.import_call
        if private is not None:
            try:
                return private(flat.__dlpack__(), device, None)
            except TypeError as err:  # the private signature changed: the public call from now on
                self.import_call = None
                fell_back("dlpack_import", err)
        else:
            fell_back("dlpack_import")
        with jax.enable_x64(True):
            return jax.dlpack.from_dlpack(flat)

    def dlpack_export(self, array: jax.Array) -> torch.Tensor:
        """A single-device JAX array as a CPU tensor, zero-copy (DLPack)."""
        private = self.export_call
        if private is not None:
            # Export the buffer directly instead of through jax.Array.__dlpack__'s checks.
            try:
                return torch.utils.dlpack.from_dlpack(private(array, stream=None))
            except TypeError as err:
                self.export_call = None
                fell_back("dlpack_export", err)
        else:
            fell_back("dlpack_export")
        return torch.from_dlpack(array)

    def loaded_execute(self, compiled: jax.stages.Compiled) -> Callable[[list], list] | None:
        """``compiled``'s loaded executable's ``execute`` on this process's single-device
        blocks.

        None when the program has more than one device in this process (the public call is
        the way then), or when the private call is not there (logged once: :func:`fell_back`).
        After :meth:`execute_failed`, always None.
        """
        if not self.execute_usable:
            return None
        try:
            executable = compiled._executable.xla_executable
            devices = executable.local_devices()
            execute = executable.execute
        except AttributeError as err:
            fell_back("execute", err)
            return None
        return execute if len(devices) == 1 else None

    def execute_failed(self, err: BaseException) -> None:
        """A call of :meth:`loaded_execute`'s result raised ``TypeError``: the public call from
        now on (logged once)."""
        self.execute_usable = False
        fell_back("execute", err)


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Programs compiled in this block (this thread) are not written to JAX's persistent cache.

    For compile-only (libtpu) executables: JAX writes them like any other, but cannot load one
    back ("PjRtCompiler must be constructed with a Client"), so every later compile of the same
    program would read the entry, warn and compile anyway. A minimum compile time no program
    reaches keeps them out.
    """
    if _min_cached_compile_time is None:
        fell_back("uncached")
        yield
        return
    try:
        scope = _min_cached_compile_time(float("inf"))
    except TypeError as err:
        fell_back("uncached", err)
        scope = contextlib.nullcontext()
    with scope:
        yield


class _OntoUnpickler(pickle.Unpickler):
    """Reads what ``jax.experimental.serialize_executable.serialize`` wrote, onto other devices:
    device ``written_for[i]`` becomes ``devices[i]`` (in the shardings and the device list),
    and the executable is loaded with ``devices`` as its device assignment."""

    def __init__(self, blob: bytes, written_for: Sequence[int], devices: Sequence[jax.Device]):
        super().__init__(io.BytesIO(blob))
        self._client = devices[0].client
        self._by_id = dict(zip(written_for, devices, strict=True))
        self._devices = _xc.DeviceList(tuple(devices))
        self._options = _get_compile_options(
            num_replicas=1, num_partitions=len(devices),
            device_assignment=np.array([list(devices)], dtype=object), backend=self._client,
        )
        self._options.executable_build_options.use_spmd_partitioning = True

    def persistent_load(self, pid: tuple) -> object:
        if pid[0] == "exec":
            return self._client.deserialize_executable(pid[1], self._devices, self._options)
        if pid[0] == "device":
            return self._by_id[pid[1]]  # KeyError: a device outside the group
        if pid[0] == "client":
            return self._client
        raise pickle.UnpicklingError(f"unknown persistent id {pid[0]!r}")


def load_onto(
    blob: bytes, in_tree: object, out_tree: object, written_for: Sequence[int],
    devices: Sequence[jax.Device],
) -> jax.stages.Compiled | None:
    """A program ``serialize_executable.serialize`` wrote for the devices with ids
    ``written_for`` (in group-rank order), loaded to run on ``devices`` instead: partition
    ``i`` (group rank ``i``) runs on ``devices[i]``, so the process that owns ``devices[i]``
    runs it, and XLA's collectives (gloo on CPU) take their peers from this assignment.

    For programs whose code does not depend on which devices run them (the CPU platform; the
    caller decides). ``jax.experimental.serialize_executable.deserialize_and_load`` cannot do
    this: it looks the written device ids up among the new devices (``KeyError``), and with
    the ids remapped the executable keeps the assignment it was compiled with.

    None when this jax lacks the private calls or they fail (logged once: :func:`fell_back`);
    the caller compiles then.
    """
    if _get_compile_options is None or _xc is None:
        fell_back("load_onto")
        return None
    try:
        unloaded, args_info_flat, no_kwargs = _OntoUnpickler(blob, written_for, devices).load()
        return jax.stages.Compiled(
            unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree, no_kwargs=no_kwargs
        )
    except Exception as err:  # noqa: BLE001 - whatever failed, compiling is the way
        fell_back("load_onto", f"{type(err).__name__}: {err}")
        return None


def backends_started() -> bool:
    """Whether this process started a JAX backend (its runtime threads then run, and a fork
    would copy locks they may hold); True when this jax cannot tell."""
    if _xla_bridge is None or not hasattr(_xla_bridge, "backends_are_initialized"):
        return True
    return bool(_xla_bridge.backends_are_initialized())


def connect_to_service(
    address: str,
    process_id: int,
    num_processes: int,
    *,
    init_timeout_s: int,
    heartbeat_timeout_s: int,
) -> None:
    """Make this process JAX process ``process_id`` of ``num_processes``, a client of the
    coordination service at ``address`` that some other process hosts (process 0 included).

    Does what ``jax.distributed.initialize`` does, less starting a service in process 0 and
    the preemption notifier (tpu_dist turns it off anyway): the client is made, connected, and
    put in JAX's ``distributed.global_state``, where JAX's backends find it (so
    ``jax.distributed.is_initialized()`` and ``jax.distributed.shutdown()`` work as usual).

    Raises:
        RuntimeError: a JAX backend is already initialized (the message says "must be called
            before", as JAX's), distributed JAX is already initialized, or this jax's private
            API differs.
    """
    make = getattr(_lib, "get_distributed_runtime_client", None)
    state = getattr(_distributed, "global_state", None)
    if make is None or state is None or _xla_bridge is None:
        raise no_service_api(
            "connect to a coordination service", "no get_distributed_runtime_client or global_state"
        )
    if _xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "jax.distributed.initialize() must be called before any JAX calls that might "
            "initialise the XLA backend (tpu_dist connects to the coordination service in its "
            "place)."
        )
    if state.client is not None:
        raise RuntimeError("JAX's distributed runtime is already initialized in this process.")
    try:
        client = make(
            address,
            process_id,
            init_timeout=init_timeout_s,
            use_compression=True,
            heartbeat_timeout=heartbeat_timeout_s,
        )
    except TypeError as err:
        raise no_service_api("connect to a coordination service", err) from err
    client.connect()
    state.client = client
    state.process_id = process_id
    state.num_processes = num_processes
    state.coordinator_address = address
