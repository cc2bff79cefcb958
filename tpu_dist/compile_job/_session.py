"""One compile-only run: the target world's devices and everything the script recorded."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tpu_dist import _process
from tpu_dist.collectives import pipelines
from tpu_dist.compile_job._compile import CompileReport, Compiler, compile_calls, libtpu_topology
from tpu_dist.compile_job._recording import RecordedCall, Recorder, RecordingPipeline
from tpu_dist.compile_job._step import StepMeter, step_report
from tpu_dist.compile_job._tpu_device import DEVICE_TYPE, DeviceMemory, EmulatedTpu, install
from tpu_dist.mesh import Topology


class Session:
    """A compile-only run of one process: installed as the pipeline source of every "tpu"
    group created while it is active (:meth:`activate`), it gives each group the compile-only
    TPU devices of its ranks and a :class:`~._recording.RecordingPipeline`; :meth:`compile`
    then compiles what was recorded.

    The world's topology is read when the first group is created (``TPU_DIST_TOPOLOGY`` /
    ``TPU_DIST_NUM_SLICES``, :func:`tpu_dist.mesh.current_topology`), and libtpu describes its
    devices then, once.
    """

    def __init__(self) -> None:
        self.recorder = Recorder()
        self._world: tuple[Topology, list[Any]] | None = None
        self._lock = threading.Lock()
        self._previous: pipelines.PipelineSource | None = None
        self._compiler: Compiler | None = None
        self.meter: StepMeter | None = None
        """The step meter around the script's run, if one ran (:meth:`measure_steps`)."""
        self.tpu_device: EmulatedTpu | None = None
        """TorchTPU's ``"tpu"`` device as this run emulates it (:meth:`emulate_tpu_device`)."""

    # -- the pipeline source ---------------------------------------------------------------

    def activate(self) -> Session:
        """Make every "tpu" group created from now on a recording one (returns ``self``)."""
        self._previous = pipelines.pipeline_source()
        pipelines.set_pipeline_source(self._group)
        return self

    def deactivate(self) -> None:
        """Groups created from now on run again as before :meth:`activate`."""
        pipelines.set_pipeline_source(self._previous)

    def _group(
        self, rank: int, size: int, global_ranks: list[int], world_size: int
    ) -> tuple[list[Any], RecordingPipeline]:
        _, devices = self.world(world_size)
        types = ("cpu", DEVICE_TYPE) if self.tpu_device is not None else ("cpu",)
        pipeline = RecordingPipeline(self.recorder, tensor_device_types=types)
        return [devices[r] for r in global_ranks], pipeline

    # -- TorchTPU's device ---------------------------------------------------------------------

    def emulate_tpu_device(self, rank: int) -> EmulatedTpu:
        """Make ``"tpu"`` a device of this process as TorchTPU does on a host of the world's
        topology (:mod:`._tpu_device`), for global ``rank``: ``torch.tpu`` reports the host's
        devices and this rank's (``rank`` modulo the devices of a host, its ``LOCAL_RANK``),
        its memory statistics read the step meter, and "tpu" groups take fake tensors on
        ``"tpu"``. Once per process, before the script runs; it cannot be undone.

        Raises:
            RuntimeError: :meth:`world` was not read yet, tpu_dist's backend is not
                registered, or another package owns torch's PrivateUse1 device (TorchTPU).
        """
        from tpu_dist.collectives import registered_name

        if self._world is None:
            raise RuntimeError("emulate_tpu_device: call world() first (the topology is not known)")
        if self.tpu_device is not None:
            return self.tpu_device
        name = registered_name()
        if not name:
            raise RuntimeError("emulate_tpu_device: tpu_dist's backend is not registered")
        topology, _ = self._world
        per_host = topology.num_devices // topology.num_hosts
        emulation = EmulatedTpu(
            generation=topology.generation.name,
            devices_per_host=per_host,
            local_index=rank % per_host,
            hbm_bytes=topology.generation.hbm_bytes_per_device,
            memory=self._device_memory,
            reset_peak=self._restart_device_peak,
        )
        install(emulation, name)
        self.tpu_device = emulation
        return emulation

    def _device_memory(self) -> DeviceMemory:
        if self.meter is None:
            return DeviceMemory()
        current, peak = self.meter.device_memory()
        return DeviceMemory(current=current, peak=peak)

    def _restart_device_peak(self) -> None:
        if self.meter is not None:
            self.meter.restart_device_peak()

    # -- the world ---------------------------------------------------------------------------

    def world(self, world_size: int) -> tuple[Topology, list[Any]]:
        """The emulated topology and the compile-only TPU device of each global rank (read
        once, on the first call).

        Rank ``r`` gets the libtpu device on the slice, chip coordinates and core that
        :class:`~tpu_dist.mesh.Topology` gives rank ``r`` (the chip ``tpu-launch`` gives it;
        see :func:`tpu_dist.collectives.compile_only.topology_devices`).

        Raises:
            RuntimeError: libtpu is not installed, or it cannot describe the topology.
            ValueError: no topology is set, or it does not have ``world_size`` devices.
        """
        with self._lock:
            if self._world is not None:
                return self._world
            from tpu_dist.collectives.compile_only import topology_devices
            from tpu_dist.mesh import current_topology

            topology = current_topology(world_size)
            try:
                devices = topology_devices(topology)
            except ImportError as err:
                raise RuntimeError(f"compile-only mode: {err}") from err
            except Exception as err:
                raise RuntimeError(
                    f"libtpu could not describe {libtpu_topology(topology)} x "
                    f"{topology.num_slices} slice(s): {err}"
                ) from err
            self._world = (topology, devices)
            return self._world

    # -- after the script ----------------------------------------------------------------

    def start_compiler(self, topology: Topology | None = None) -> None:
        """Start the crash-isolating compiler process now, so that its start overlaps the
        script's run; :meth:`compile` uses it. For ``topology`` (the world's, before
        :meth:`world` reads it: the compiler is then forked from this process, about 2 CPU-s
        less than a fresh one, while libtpu has started no thread here), or for the world
        :meth:`world` read.

        Raises:
            RuntimeError: no ``topology`` given and :meth:`world` was not called yet.
        """
        if self._compiler is not None:
            return
        if self._world is not None:
            self._compiler = Compiler(self._world[0])
        elif topology is not None:
            self._compiler = Compiler(topology, fork=True)
        else:
            raise RuntimeError(
                "start_compiler: pass the topology or call world() first (it is not known)"
            )
        self._compiler.start()

    def stop_compiler(self) -> None:
        """Stop the compiler process, if one was started and :meth:`compile` did not use it
        (the run ends before compiling)."""
        compiler, self._compiler = self._compiler, None
        if compiler is not None:
            compiler.close()

    def measure_steps(self, *, track_memory: bool = True) -> StepMeter:
        """A :class:`~._step.StepMeter` for the script's run (enter it around the run, inside
        the fake-tensor mode); :meth:`compile` then reports its last step. With the emulated
        ``"tpu"`` device the step's memory is the bytes on it, if the script puts any there."""
        device_type = DEVICE_TYPE if self.tpu_device is not None else None
        self.meter = StepMeter(self.recorder, track_memory=track_memory, device_type=device_type)
        return self.meter

    def recorded(self) -> list[RecordedCall]:
        """The distinct calls recorded so far, in the order first issued."""
        return self.recorder.recorded()

    def compile(
        self,
        rank: int,
        script_seconds: float = 0.0,
        progress: Callable[[str], None] | None = None,
        assumptions: Sequence[str] = (),
    ) -> CompileReport:
        """Compile every distinct recorded program for the world's TPU devices and report
        (:func:`~._compile.compile_calls`), with the ``assumptions`` the recorded sizes rest on.

        Raises:
            RuntimeError: no "tpu" group was created while the session was active.
        """
        if self._world is None:
            raise RuntimeError(
                "compile-only: no 'tpu' process group was created while the session was active "
                "(call init_process_group('tpu') in the script)"
            )
        topology, _ = self._world
        compiler, self._compiler = self._compiler, None
        calls = self.recorded()
        report = compile_calls(calls, topology, rank, script_seconds, progress, compiler)
        report = dataclasses.replace(report, assumptions=tuple(assumptions))
        if self.meter is not None and self.meter.error is not None:
            return dataclasses.replace(report, step_error=self.meter.error)
        record = self.meter.chosen() if self.meter is not None else None
        if record is None:
            return report
        step = step_report(
            record, self.meter.steps_run, list(report.collectives),
            [c.per_step.get(record.index, 0) for c in calls], topology,
        )
        return dataclasses.replace(report, step=step)


def activate() -> Session:
    """This process's compile-only session, created and activated on the first call.

    ``tpu-launch --compile-only``'s process calls it before running the script; ``import
    tpu_dist`` calls it when ``TPU_DIST_COMPILE_ONLY=1``. The one session is kept in
    :mod:`tpu_dist._process` (process-wide state, declared once).
    """
    return _process.compile_only_session_or_create(lambda: Session().activate())


def active_session() -> Session | None:
    """The session :func:`activate` made, if any."""
    return _process.compile_only_session()


def world_devices(world_size: int) -> tuple[Topology, Sequence[Any]]:
    """:meth:`Session.world` of this process's session (activated if need be)."""
    return activate().world(world_size)
