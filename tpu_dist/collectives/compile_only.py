"""Compile the backend's collective programs for TPU without a TPU (libtpu compile-only devices).

libtpu (``pip install tpu-dist[tpu-compile]``) describes any TPU topology as *compile-only*
devices: real ``device_kind``, chip ``coords``, ``core_on_chip``, host and slice, and the real
TPU compiler behind them, on a machine with no TPU. This module builds the exact program the
"tpu" backend would run for a :class:`ProgramKey` and compiles it over such devices, so a
collective can be checked for thousands of chips before a job is started::

    from tpu_dist.collectives import ProgramKey
    from tpu_dist.collectives.compile_only import compile_collective, topology_devices
    from tpu_dist.mesh import Topology

    devices = topology_devices(Topology.create("v5p", "4x4x4", num_slices=2))   # 128
    key = ProgramKey("allreduce", tuple(d.id for d in devices), ((1024, "bfloat16"),), ("SUM",))
    result = compile_collective(key, devices)
    result.collectives    # [HloCollective(op='all-reduce', replica_groups=((0, ..., 63),), ...)]
    result.temp_bytes     # scratch memory the program needs on each device

Nothing here runs a program or needs a JAX backend of the process: it works next to a CPU
runtime, in any process. Without libtpu, :func:`topology_devices` raises ``ImportError`` naming
the extra to install; the rest of tpu_dist never imports this module.

How XLA:TPU writes collectives (libtpu: docs/reference/libtpu.md): op names are rewritten (a
reduce-scatter becomes an ``all-reduce`` + ``dynamic-slice``; on a v5p cube an all-gather may become
an ``all-reduce``), asynchronous pairs appear as ``*-start``/``*-done``, and between slices the ICI
collective is followed by a ``send``/``recv`` pair handled by the multi-slice (MegaScale) runtime,
whose ``_xla_megascale_target`` names the slices and the program devices it joins. Replica groups
are positions in the program's device list (``devices[i]``), within one slice for multi-slice
programs.

Limits seen with libtpu (docs/reference/libtpu.md; for whoever compiles whole jobs this way):

* A group spanning *some* slices of a larger multi-slice topology (slices 0 and 1 of 4) kills
  the process in libtpu's cross-slice pass (SIGILL in ``ConstructLocalOffsetTable``), and
  slices 1 and 3 of 4 fail with ``INVALID_ARGUMENT: Slice is empty``. Describe a topology with
  exactly the slices the group spans (a group over slices {a, b} of a job compiles over
  ``Topology.create(gen, shape, num_slices=2)``).
* complex128 programs crash the TPU compiler; :func:`compile_collective` refuses them first.
* JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) cannot load compile-only
  executables back (it warns, then compiles afresh), so :func:`compile_collective` never writes
  them to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tpu_dist import _process
from tpu_dist.collectives import _jaxlib, _lowering, _plan_algorithms
from tpu_dist.collectives._lowering import ProgramKey, part_of_slice_hint

if TYPE_CHECKING:
    import jax

    from tpu_dist.mesh import Topology

__all__ = [
    "CompiledCollective",
    "HloCollective",
    "can_fork",
    "compile_collective",
    "hlo_collectives",
    "part_of_slice_hint",
    "topology_devices",
]

_COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)
# "%name = type op(" or "%name = type op-start(" ; the type may contain spaces inside tuples.
_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\s(?P<op>" + "|".join(map(re.escape, _COLLECTIVE_OPS))
    + r")(?P<start>-start)?\("
)
_EXPLICIT_GROUPS_RE = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS_RE = re.compile(
    r"replica_groups=\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_MEGASCALE_RE = re.compile(
    r'_xla_megascale_target=(?:"(?P<quoted>[^"]*)"|(?P<braced>\{(?:\{[^}]*\},?)+\}))'
    r'.*?_xla_megascale_transfer_type="(?P<type>[^"]*)"'
)
_MEGASCALE_SLICE_STRIDE = 100_000
"""libtpu's multi-slice device ids: ``(slice_index + 1) * 100000 + id within the slice``."""
_SEND_RE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\ssend\(")

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective operation of a compiled program, as the HLO text states it."""

    op: str
    """The HLO op: ``"all-reduce"``, ``"all-gather"``, ``"all-to-all"``, ``"collective-permute"``,
    ..., or ``"megascale-send"`` for a transfer between slices."""
    replica_groups: tuple[tuple[int, ...], ...] = ()
    """The groups of program device positions that communicate (``devices[i]`` is position i);
    for a collective-permute, the (source, target) pairs; empty for a transfer between slices."""
    megascale_target: str | None = None
    """Between slices: the MegaScale target as printed. Three spellings seen (libtpu:
    docs/reference/libtpu.md): ``{1,2}x{0:3}`` (slices counted from 1 x in-slice device ids, for
    reductions and gathers), ``{{100000,...,200008}}`` (device ids, all-to-all) and
    ``{{100000->200000}}`` (one-to-one, permutes). :meth:`megascale_devices` reads all three."""
    megascale_transfer: str | None = None
    """Between slices: the transfer type, e.g. ``"ALL_REDUCE"``, ``"ALL_TO_ALL"``."""

    def megascale_devices(self) -> tuple[int, ...]:
        """The device ids (``jax.Device.id`` of libtpu's multi-slice devices) a transfer between
        slices joins, in the order printed (every group's, for a target of several groups).

        Raises:
            ValueError: not a transfer between slices, or a target this parser does not know.
        """
        return tuple(d for group in self.megascale_groups() for d in group)

    def megascale_groups(self) -> tuple[tuple[int, ...], ...]:
        """The device ids of each group a transfer between slices joins: one group, or several
        for a family program's all-to-all (``{{100000,100016},{100004,100020}}``).

        Raises:
            ValueError: not a transfer between slices, or a target this parser does not know.
        """
        target = self.megascale_target or ""
        m = re.fullmatch(r"\{([\d,:]*)\}x\{([\d,:]*)\}", target)
        if m is not None:
            return (tuple(
                s * _MEGASCALE_SLICE_STRIDE + i
                for s in _id_list(m.group(1))
                for i in _id_list(m.group(2))
            ),)
        if re.fullmatch(r"\{(?:\{[\d,:\->]*\},?)+\}", target):
            return tuple(
                _id_list(group.replace("->", ","))
                for group in re.findall(r"\{([\d,:\->]*)\}", target[1:-1])
            )
        raise ValueError(f"cannot read MegaScale target {target!r}")


@dataclasses.dataclass(frozen=True)
class CompiledCollective:
    """A collective program compiled for TPU, and what the compiler made of it."""

    compiled: Any
    """The ``jax.stages.Compiled`` (compile-only: it cannot run)."""
    hlo_text: str
    """The optimized TPU HLO (``compiled.as_text()``)."""
    collectives: tuple[HloCollective, ...]
    """The program's collective operations, in HLO order (:func:`hlo_collectives`)."""
    temp_bytes: int | None
    """Scratch memory per device (``memory_analysis().temp_size_in_bytes``), if reported."""


def can_fork() -> bool:
    """Whether this process may fork a child that compiles (Linux, no Python thread but this
    one, no JAX backend started): such a child starts without importing torch, JAX and
    tpu_dist again. Once a backend or another thread runs, a fork could copy a lock one of
    them holds; start a fresh process (``spawn``) then."""
    import sys
    import threading

    return (
        sys.platform.startswith("linux")
        and threading.active_count() == 1
        and not _jaxlib.backends_started()
    )


def topology_devices(topology: Topology) -> list[jax.Device]:
    """libtpu's compile-only devices for ``topology``, in rank order (``devices[r]`` is rank r).

    Each rank gets the device with its chip coordinates, core and slice. The topology is
    described once per call (about 0.2 s for 8,192 devices); keep the list to reuse it.

    Raises:
        ImportError: libtpu is not installed (``pip install tpu-dist[tpu-compile]``).
        ValueError: the generation is one libtpu cannot describe, or libtpu's devices do not
            match the topology (a fact in :mod:`tpu_dist.mesh` disagrees with libtpu).
    """
    try:
        import libtpu  # noqa: F401  (only to say clearly what is missing)
    except ImportError as err:
        raise ImportError(
            "compile-only TPU devices need libtpu: pip install 'tpu-dist[tpu-compile]' "
            "(or pip install libtpu)"
        ) from err
    from jax.experimental import topologies

    gen = topology.generation
    if gen.libtpu_name is None:
        raise ValueError(f"libtpu cannot describe {gen.name} topologies (no libtpu name)")
    # Two processes that load libtpu would otherwise fight over /tmp/libtpu_lockfile; compile-only
    # use never touches a chip. Set only if the user has not chosen.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs: dict[str, Any] = {}
    if topology.hosts_per_slice == 1:
        # One host holds the whole slice (v5litepod-8 is one 2x4 host); libtpu would split it.
        bounds = tuple(topology.shape) + (1,) * (3 - len(topology.shape))
        kwargs["chips_per_host_bounds"] = bounds
    if gen.name == "v4":
        kwargs["chip_config_name"] = "megacore"  # one device per chip, as tpu_dist models v4
    if topology.num_slices > 1:
        kwargs["num_slices"] = topology.num_slices
    with _host_described_to_libtpu(topology):
        desc = topologies.get_topology_desc(
            topology_name=f"{gen.libtpu_name}:{topology.topology}", platform="tpu", **kwargs
        )
    devices = list(desc.devices)
    if len(devices) != topology.num_devices:
        raise ValueError(
            f"libtpu describes {len(devices)} devices for {topology!r}, tpu_dist "
            f"{topology.num_devices}"
        )
    grid = topology.rank_grid()
    ordered: list[Any] = [None] * len(devices)
    nd = len(topology.shape)
    for d in devices:
        where = (getattr(d, "slice_index", 0) or 0, *tuple(d.coords)[:nd], d.core_on_chip)
        ordered[int(grid[where])] = d
    return ordered



@contextlib.contextmanager
def _host_described_to_libtpu(topology: Topology) -> Iterator[None]:
    """While libtpu loads, give it the TPU VM description it reads, on a machine without a TPU.

    With ``TPU_SKIP_MDS_QUERY`` set (``import jax`` sets it where no TPU chip is attached) libtpu
    does not ask the metadata server, and without ``TPU_ACCELERATOR_TYPE`` and
    ``TPU_WORKER_HOSTNAMES`` libtpu (docs/reference/libtpu.md) prints lines that read like errors
    when it loads: "Failed to find host bounds for accelerator type", "E0000 ... INVALID_ARGUMENT:
    Error: unexpected worker hostname", a source location trace. They are not errors: compile-only
    devices describe the topology they are asked for whatever these variables say (the same devices,
    ids, coordinates, cores, hosts and slices with and without them, v4 to TPU7x). So they are set
    to ``topology``'s accelerator type and this host for the call that loads libtpu, and removed
    again afterwards (libtpu reads them once, when it loads; nothing of the process or its children
    sees them), only there (not on a TPU VM, where libtpu reads its metadata) and only when the user
    has not set them; logged at INFO, once.
    """
    chosen: dict[str, str] = {}
    if os.environ.get("TPU_SKIP_MDS_QUERY"):  # else: a TPU VM, libtpu asks its metadata server
        wanted = {"TPU_ACCELERATOR_TYPE": topology.accelerator_type,
                  "TPU_WORKER_HOSTNAMES": "localhost"}
        chosen = {k: v for k, v in wanted.items() if k not in os.environ}
    if chosen and _process.first_time(f"{__name__}:libtpu variables"):
        logger.info(
            "tpu_dist: set %s while libtpu loads its compile-only devices (no TPU attached; "
            "libtpu reads them when it loads)", ", ".join(f"{k}={v}" for k, v in chosen.items())
        )
    os.environ.update(chosen)
    try:
        yield
    finally:
        for name, value in chosen.items():
            if os.environ.get(name) == value:
                del os.environ[name]


def compile_collective(key: ProgramKey, devices: Sequence[jax.Device]) -> CompiledCollective:
    """Compile the backend's program for ``key`` over ``devices`` and read the TPU HLO back.

    Args:
        key: What the "tpu" backend records for a collective: kind, block sizes and dtypes,
            reduce op / root / permutation (``key.devices`` is not used here: ``devices`` are).
        devices: The program's devices: the group's in group-rank order, e.g. a slice of
            :func:`topology_devices`; for a family program (``key.groups > 1``) every group's,
            group after group. Real TPU devices work too.

    Returns:
        The compiled program, its HLO text, its collectives and its scratch memory. The program
        is the one the backend would run on these devices: ``key.algorithm`` if set, else the
        one the backend chooses for these devices (on TPU, XLA's own collectives except where
        XLA:TPU lacks them; see ``_plan_algorithms.choose_algorithm``); it is not cached and does not count
        in :func:`tpu_dist.collectives.compile_count`.

    Raises:
        TypeError: a dtype the TPU cannot compile collectives for (complex128).
        jax.errors.JaxRuntimeError: the TPU compiler rejected the program (a lowering bug).
    """
    if key.algorithm is None:
        platform = devices[0].platform if devices else "tpu"
        algorithm = _plan_algorithms.choose_algorithm(
            key.kind, key.blocks, key.params, platform, len(devices) // key.groups
        )
        key = dataclasses.replace(key, algorithm=algorithm)
    lowered = _lowering.lower(key, devices)
    with _jaxlib.x64_scope(), _jaxlib.uncached():
        compiled = _lowering.compile_lowered(lowered, devices, key)
    text = compiled.as_text()
    try:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except (AttributeError, TypeError):
        temp = None
    return CompiledCollective(compiled, text, tuple(hlo_collectives(text)), temp)


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """The collective operations in an HLO module's text, in order (``*-done`` halves skipped).

    Replica groups are read in both spellings XLA prints: explicit (``{{0,1},{2,3}}``) and iota
    (``[2,2]<=[4]``, optionally transposed ``[2,2]<=[2,2]T(1,0)``). Sends to the multi-slice
    runtime are reported as ``"megascale-send"`` with their target and transfer type.
    """
    found = []
    for line in hlo_text.splitlines():
        m = _OP_RE.match(line)
        if m is not None:
            found.append(HloCollective(m["op"], _groups(line)))
            continue
        if _SEND_RE.match(line):
            ms = _MEGASCALE_RE.search(line)
            if ms is not None:
                found.append(HloCollective(
                    "megascale-send", megascale_target=ms["quoted"] or ms["braced"],
                    megascale_transfer=ms["type"],
                ))
    return found


def _id_list(text: str) -> tuple[int, ...]:
    """``"0,3:5,9"`` -> ``(0, 3, 4, 5, 9)`` (``a:b`` is inclusive)."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition(":")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    m = _EXPLICIT_GROUPS_RE.search(line)
    if m is not None:
        return tuple(
            tuple(int(v) for v in g.split(",") if v)
            for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        )
    m = _IOTA_GROUPS_RE.search(line)
    if m is not None:
        dims = [int(v) for v in m["dims"].split(",")]
        reshape = [int(v) for v in m["reshape"].split(",")]
        ids = np.arange(int(np.prod(reshape))).reshape(reshape)
        if m["perm"]:
            ids = ids.transpose([int(v) for v in m["perm"].split(",")])
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(dims[0], -1))
    m = _PAIRS_RE.search(line)
    if m is not None:
        return tuple(
            (int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))
        )
    return ()
