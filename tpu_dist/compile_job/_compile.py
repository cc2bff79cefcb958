"""Compiling a compile-only run's recorded programs for TPU, and the report.

:meth:`Session.compile <tpu_dist.compile_job.Session.compile>` compiles each distinct recorded
program with libtpu's TPU compiler over compile-only TPU devices (``pip install libtpu``; no TPU
needed; every program compiles in a child process, so that a compiler crash, seen there, fails
one program, not the run), rank ``r`` driving the device that ``tpu-launch`` would
give it, and :class:`CompileReport` says, per collective, whether it compiled, the HLO
collectives it became, its scratch memory and an estimated time per call
(:func:`estimate_seconds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tpu_dist.collectives.pipelines import Kind
from tpu_dist.compile_job._estimate import collective_time
from tpu_dist.mesh import Topology

if TYPE_CHECKING:
    from tpu_dist.compile_job._recording import RecordedCall


def libtpu_topology(topology: Topology) -> str:
    """The topology as libtpu names it (``tpu7x:16x16x16``)."""
    return f"{topology.generation.libtpu_name}:{topology.topology}"


# -- compiling and estimating -------------------------------------------------------------------

def estimate_seconds(
    kind: str, topology: Topology, group_ranks: Sequence[int], bytes_per_rank: int
) -> float | None:
    """The modelled time of one call of a ``kind`` program over ``group_ranks``: bandwidth
    plus per-hop latency (:func:`tpu_dist.compile_job._estimate.collective_time`).

    Bandwidth: ``S * factor / busbw``, nccl-tests' bus-bandwidth convention read backwards, with
    ``busbw`` the topology model's bound for the group (:func:`tpu_dist.mesh.expected_busbw`:
    ``L = ici_gbytes_per_s / ici_ports / 2`` GB/s per link and direction, ``2 L`` per spanned
    torus axis that wraps around and ``L`` per one that does not, capped by DCN at
    ``dcn_gbits_per_s / 8`` GB/s per chip when the group spans slices; an all-gather,
    reduce-scatter or all-reduce with several ranks in each slice is priced as XLA compiles it,
    over ICI within each slice and over DCN on ``1/m`` of the message, ``m`` ranks a slice),
    ``factor`` the op's
    (:func:`tpu_dist.mesh.bus_factor`: ``2 (n - 1) / n`` for an all-reduce, ``(n - 1) / n`` for
    an all-gather with ``S`` its output, a reduce-scatter and an all-to-all, 1 for a send) and
    ``S`` the op's message size; an all-to-all over ICI takes a quarter of that (the JAX
    scaling book). Latency: about 1 us per ICI hop, ``k // 2`` hops along a wraparound axis of
    ``k`` chips (``k - 1`` along a line), summed over the spanned axes, one more for the two
    devices of a TPU7x chip, twice for an all-reduce; ``ceil(log2 slices)`` DCN steps of an
    assumed 10 us across slices. A 4-byte all_reduce over 128 TPU7x devices (``4x4x4``) is
    14 us of latency and 0.013 ns of bandwidth. None when the group's devices share one chip
    (TPU7x's two TensorCores): no link is used.

    Checked against the JAX scaling book ("How to Scale Your Model", the chapter on sharded
    matrices): its all-gather of a 33.6 MB bf16[2048, 8192] array over a ring of 8 v5e chips
    takes 373 us at 9e10 B/s per link (both directions); this gives 294 us of bandwidth plus
    4 us of latency over a v5e 2x4 (100 GB/s per link from Cloud's 400 GB/s per chip over 4
    ports, and the (n - 1) / n factor the book drops): 0.80x.
    """
    kind = Kind(kind)
    found = collective_time(
        kind.bench_op, topology, group_ranks, kind.bench_bytes(bytes_per_rank, len(group_ranks))
    )
    return None if found is None else found.seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledCall:
    """One distinct recorded collective and what compiling it for TPU gave."""

    op: str
    """torch's name of the call (``all_reduce``, ``all_gather_into_tensor``, ``send``, ...)."""
    reduce_op: str | None
    group_size: int
    family_groups: int = 1
    """How many groups run the program together: 1 for the group's own program, else the
    number of groups of its family (a mesh dimension's groups, each of ``group_size``: one
    program over all of them, see :attr:`tpu_dist.collectives.ProgramKey.groups`)."""
    mesh_dim: str | None
    """The DeviceMesh dimension of the group, if it came from a DeviceMesh."""
    crosses_dcn: bool
    """Whether the group spans more than one slice."""
    bytes_per_rank: int
    dtype: str
    """The element type of the program's blocks (data-movement programs move raw words)."""
    count: int
    """How many times the script issued it."""
    compiled: bool
    hlo_collectives: tuple[str, ...]
    compile_seconds: float
    temp_bytes: int | None
    """Scratch memory of the compiled program (its memory analysis), None if it did not compile."""
    est_seconds: float | None
    """:func:`estimate_seconds` for one call (None: the group's devices share one chip)."""
    program: str
    """The program kind the backend runs for the call (its lowering)."""
    first_call: str
    """Where the script first issued it (``file:line (code)``)."""
    error: str | None
    """The compiler's message, if it did not compile."""
    origin: str = "script"
    """Who issued it: ``fsdp``, ``ddp``, ``tensor`` (DTensor) or ``script``."""
    overlappable: bool = False
    """Whether it can run under compute (FSDP's, DDP's) or sits on the critical path
    (:data:`tpu_dist.compile_job._recording.OVERLAPPABLE_ORIGINS`)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"hlo_collectives": list(self.hlo_collectives)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileReport:
    """What :func:`compile_calls` found; :meth:`to_json` is the ``--compile-report`` file."""

    topology: str
    num_slices: int
    num_devices: int
    rank: int
    collectives: tuple[CompiledCall, ...]
    script_seconds: float
    compile_seconds: float
    step: Any = None
    """The measured step (:class:`~._step.StepReport`), if the script completed one."""
    step_error: str | None = None
    """Why no step was measured although the script ran (the step meter failed on something
    the script did: where, and the error; :attr:`~._step.StepMeter.error`), else None."""
    assumptions: tuple[str, ...] = ()
    """What the recorded sizes assume where a compile-only run cannot know values (balanced
    routing: :class:`~._fake.LargeTensorsFake`)."""

    @property
    def ok(self) -> bool:
        """Every recorded collective compiled."""
        return all(c.compiled for c in self.collectives)

    def to_json(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "num_slices": self.num_slices,
            "num_devices": self.num_devices,
            "rank": self.rank,
            "script_seconds": round(self.script_seconds, 3),
            "compile_seconds": round(self.compile_seconds, 3),
            "step": None if self.step is None else self.step.to_json(),
            "step_error": self.step_error,
            "assumptions": list(self.assumptions),
            "collectives": [c.to_json() for c in self.collectives],
        }

    def format_table(self) -> str:
        """The report as a table for a terminal."""
        head = (
            f"compile-only report: rank {self.rank} of {self.num_devices} devices, "
            f"{self.topology} x {self.num_slices} slice(s); no TPU was used and no data moved; "
            f"script {self.script_seconds:.1f} s, compiling {self.compile_seconds:.1f} s"
        )
        cols = ("op", "reduce", "group", "dim", "dcn", "bytes/rank", "dtype", "calls",
                "compiled", "HLO", "temp", "est/call")
        rows = []
        for c in self.collectives:
            rows.append((
                c.op, c.reduce_op or "-",
                str(c.group_size) + (f" x{c.family_groups}" if c.family_groups > 1 else ""),
                c.mesh_dim or "-",
                "yes" if c.crosses_dcn else "no", _human_bytes(c.bytes_per_rank), c.dtype,
                str(c.count), "yes" if c.compiled else "NO",
                ",".join(c.hlo_collectives) or "-",
                _human_bytes(c.temp_bytes) if c.temp_bytes is not None else "-",
                _human_seconds(c.est_seconds) if c.est_seconds is not None else "on-chip",
            ))
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
                  for i, h in enumerate(cols)]
        lines = [head, ""]
        lines.append("  ".join(h.ljust(w) for h, w in zip(cols, widths)))
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        if not rows:
            lines.append("(the script issued no collective on a 'tpu' group)")
        for c in self.collectives:
            if not c.compiled:
                lines.append(f"\nFAILED {c.op} over {_over(c.group_size, c.family_groups)}, "
                             "first issued at "
                             f"{c.first_call}:\n  {c.error}")
        if self.step is not None:
            lines += ["", *self.step.format_lines()]
        if self.step_error is not None:
            lines += ["", "step: not measured (the collectives above are complete): the step "
                      f"meter stopped at {self.step_error}"]
        for assumption in self.assumptions:
            lines += ["", f"assumed: {assumption}"]
        lines.append("")
        lines.append("group: the group's size; 'N xG': one program for the G groups of N of its "
                     "mesh dimension (a family program). est/call: message size over the "
                     "topology model's bus-bandwidth bound (ICI/DCN link speeds) plus ~1 us per "
                     "ICI hop (tpu_dist.compile_job.estimate_seconds); temp: the program's "
                     "scratch memory on each device.")
        return "\n".join(lines)


def _over(group_size: int, groups: int) -> str:
    """``8 devices``, or for a family program ``32 groups of 8 (256 devices)``."""
    if groups == 1:
        return f"{group_size} devices"
    return f"{groups} groups of {group_size} ({groups * group_size} devices)"


def _human_bytes(n: int, digits: int = 1) -> str:
    """``n`` bytes in the largest binary unit it reaches, with ``digits`` decimals ("1.5 MiB");
    under a KiB, whole bytes ("12 B"). The report's table uses 1, the step report 2."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


def _human_seconds(s: float) -> str:
    """``s`` seconds with 3 significant digits in s, ms, us or ns ("12.5 ms")."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


_Outcome = tuple  # (compiled, HLO collective ops, seconds, temp bytes, error)


def _compile_one(key: Any, by_id: Mapping[int, Any]) -> _Outcome:
    """Compile ``key``'s program over the devices ``by_id`` names (device id -> libtpu device)."""
    from tpu_dist.collectives.compile_only import compile_collective

    t0 = time.monotonic()
    try:
        result = compile_collective(key, [by_id[d] for d in key.devices])
        ops = tuple(dict.fromkeys(c.op for c in result.collectives))
        return (True, ops, time.monotonic() - t0, result.temp_bytes, None)
    except Exception as err:  # the compiler's own error, reported per program
        from tpu_dist.collectives.compile_only import part_of_slice_hint

        message = " ".join(str(err).split())[:800]
        hint = part_of_slice_hint(key, str(err))
        if hint is not None:
            message = f"{message} ... {hint}"
        return (False, (), time.monotonic() - t0, None, message)


def _die_with(parent: int) -> None:
    """End this process when ``parent`` (the process that started it) ends: Linux's
    ``PR_SET_PDEATHSIG``. A forked child holds both ends of its pipe, so it would never see
    the parent leave: a compile-only run killed mid-way left its compiler alive (200 MB)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PDEATHSIG
    if os.getppid() != parent:  # it ended before the request took effect
        os._exit(0)


def _compile_in_child(conn: Any, spec: str, num_slices: int, parent: int) -> None:
    """The compiler process: describe the topology once, then compile each key it is sent."""
    import resource

    _die_with(parent)
    # A compiler crash is reported by the parent; a core file of libtpu (GBs) helps no one.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from tpu_dist.collectives.compile_only import topology_devices

    try:
        by_id, why_not = {d.id: d for d in topology_devices(Topology.parse(spec, num_slices))}, None
    except Exception as err:  # the parent meets the same error and reports it, or each program
        by_id, why_not = {}, f"libtpu could not describe {spec} x {num_slices} slice(s): {err}"
    while True:
        key = conn.recv()
        if key is None:
            # Leave without the interpreter's teardown: JAX's and libtpu's exit handlers kept
            # the child alive for the parent's whole 10 s join (measured: 9 s of a 18 s run).
            conn.close()
            os._exit(0)
        conn.send((False, (), 0.0, None, why_not) if why_not else _compile_one(key, by_id))


class Compiler:
    """Compiles programs in a child process, so that a crash of libtpu's compiler fails that
    program, not the report; a new child takes the next program.

    Every program goes there: libtpu (docs/reference/libtpu.md) dies of SIGILL on a group over 2 of
    4 slices, and of SIGFPE on a psum over one core of every chip of ``tpu7x:16x16x32`` (8,192 of
    its 16,384 devices, one slice), so no program is safe to compile in the process that holds the
    recorded calls. A fresh child costs about 2 CPU-s (torch, JAX, libtpu), once a run (and once
    more after each crash); a forked one only libtpu's description of the topology: :meth:`start` it
    early (the compile-only process does, before libtpu or the script starts a thread, so that it is
    forked and its start overlaps the script's run)."""

    def __init__(self, topology: Topology, *, timeout: float = 300.0, fork: bool = False) -> None:
        self._spec, self._slices = topology.spec, topology.num_slices
        self._fork = fork
        """Fork the first child (when :func:`~tpu_dist.collectives.compile_only.can_fork`):
        only for a process in which libtpu has not described a topology yet, whose threads
        ``can_fork`` cannot see. Children after a crash are fresh processes."""
        self.timeout = timeout
        """Seconds one program may take to compile; past it the child is killed and the
        program reported as failed (measured: libtpu still compiling an all-gather of
        the Qwen3-32B preset over 4 TPU7x devices after 305 s, where the others take 0.1-2 s)."""
        self._proc: Any = None
        self._conn: Any = None

    def start(self) -> None:
        """Start the child now (else the first :meth:`compile` does); returns at once.

        Forked if made with ``fork=True``, the first time, when this process may fork
        (:func:`~tpu_dist.collectives.compile_only.can_fork`: no JAX backend or other Python
        thread runs yet): the child then has torch, JAX and tpu_dist already (about 2 CPU-s
        less than a fresh process, docs/decisions/0029-compile-only-job-beside-the-launcher.md).
        Else a fresh process
        (``spawn``): never fork a process whose JAX or libtpu runs."""
        if self._proc is not None:
            return
        import multiprocessing

        from tpu_dist.collectives.compile_only import can_fork

        forked, self._fork = self._fork and can_fork(), False
        if forked:  # what this process has buffered must not be written again by the child
            sys.stdout.flush()
            sys.stderr.flush()
        ctx = multiprocessing.get_context("fork" if forked else "spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_compile_in_child, args=(child, self._spec, self._slices, os.getpid()),
            daemon=True,
            name="tpu_dist-compiler",
        )
        self._proc.start()
        child.close()

    def compile(self, key: Any) -> _Outcome:
        self.start()
        t0 = time.monotonic()
        self._conn.send(key)
        timed_out = False
        while not self._conn.poll(max(0.0, min(0.2, self.timeout - (time.monotonic() - t0)))):
            if not self._proc.is_alive():
                break
            if time.monotonic() - t0 >= self.timeout:
                timed_out = True
                self._proc.kill()
                break
        if not timed_out and self._conn.poll():
            try:
                return self._conn.recv()
            except EOFError:
                pass
        self._proc.join(5)
        code = self._proc.exitcode
        self._proc = self._conn = None
        if timed_out:
            return (False, (), time.monotonic() - t0, None,
                    f"libtpu's TPU compiler did not finish this program within {self.timeout:g} "
                    "s (Compiler.timeout); it was stopped and the other programs compiled on")
        how = (
            f"{signal.Signals(-code).name}" if code is not None and code < 0
            else f"exit code {code}"
        )
        return (False, (), time.monotonic() - t0, None,
                f"libtpu's TPU compiler crashed ({how}) while compiling this program; "
                "nothing the backend can catch (see the limits in "
                "tpu_dist.collectives.compile_only)")

    def close(self) -> None:
        if self._proc is not None:
            self._conn.send(None)
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc = self._conn = None


def compile_calls(
    calls: Sequence[RecordedCall],
    topology: Topology,
    rank: int,
    script_seconds: float = 0.0,
    progress: Callable[[str], None] | None = None,
    compiler: Compiler | None = None,
) -> CompileReport:
    """Compile every distinct program of ``calls`` over the compile-only TPU devices of
    ``topology`` (rank ``r`` on the device ``tpu-launch`` gives it: the ids in each key are
    those devices'); identical programs compile once, each in a
    crash-isolating child (:class:`Compiler`): a program that crashes libtpu's compiler is
    reported as failed, with the signal, and the others still compile.

    Args:
        calls: The recorded calls, in the order first issued.
        topology: The target world's topology.
        rank: The global rank the script ran as.
        script_seconds: How long the script ran (for the report).
        progress: Called with one line per program compiled (default: stderr).
        compiler: A :class:`Compiler` for ``topology`` already started (closed here);
            default: a new one.
    """
    if progress is None:
        def progress(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

    programs: dict[Any, tuple[bool, tuple[str, ...], float, int | None, str | None]] = {}
    started = time.monotonic()
    distinct = list(dict.fromkeys(c.key for c in calls))
    compiler = compiler if compiler is not None else Compiler(topology)
    try:
        for i, key in enumerate(distinct, 1):
            programs[key] = outcome = compiler.compile(key)
            state = "ok" if outcome[0] else "FAILED"
            progress(
                f"tpu-launch --compile-only: [{i}/{len(distinct)}] {key.kind} over "
                f"{_over(key.group_size, key.groups)}: {state} in {outcome[2]:.2f} s"
            )
    finally:
        compiler.close()
    compile_seconds = time.monotonic() - started
    rows = []
    for call in calls:
        ok, hlo, seconds, temp, error = programs[call.key]
        slices = {int(topology.slice_of(r)) for r in call.group_ranks}
        rows.append(CompiledCall(
            op=call.op,
            reduce_op=call.reduce_op,
            group_size=len(call.group_ranks),
            family_groups=call.key.groups,
            mesh_dim=call.mesh_dim,
            crosses_dcn=len(slices) > 1,
            bytes_per_rank=call.bytes_per_rank,
            dtype=call.dtype,
            count=call.count,
            compiled=ok,
            hlo_collectives=hlo,
            compile_seconds=round(seconds, 3),
            temp_bytes=temp,
            est_seconds=estimate_seconds(
                call.key.kind, topology, call.group_ranks, call.bytes_per_rank
            ),
            program=call.key.kind,
            first_call=str(call.first_site) if call.first_site else "?",
            error=error,
            origin=call.origin,
            overlappable=call.overlappable,
        ))
    return CompileReport(
        topology=libtpu_topology(topology),
        num_slices=topology.num_slices,
        num_devices=topology.num_devices,
        rank=rank,
        collectives=tuple(rows),
        script_seconds=script_seconds,
        compile_seconds=compile_seconds,
    )


def write_report(report: CompileReport, path: str) -> None:
    """Write ``report`` as JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=1)
        f.write("\n")
