"""The launch configuration: parsed flags + discovery -> one frozen, validated :class:`LaunchSpec`.

Precedence for every value that discovery can supply (node rank, node count, master address,
workers per host, slices): an explicit flag, then its environment variable (``PET_*`` for
torchrun's flags, ``TPU_DIST_*`` for ours), then discovery (:mod:`._discovery`), then the
single-host default. Every resolved value records where it came from in
:attr:`LaunchSpec.provenance`; every choice made on the user's behalf is a line in
:attr:`LaunchSpec.notes`, logged at start and printed by ``--dry-run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import uuid
from collections.abc import Mapping
from typing import Literal, NamedTuple

from tpu_dist import _settings
from tpu_dist.launch._chips import SliceShape, parse_slice
from tpu_dist.launch._discovery import Discovery, read_platform

__all__ = ["DEFAULT_MASTER_PORT", "Entrypoint", "LaunchSpec", "Mode", "Runtime", "resolve"]

Mode = Literal["tpu", "emulate", "cpu"]
Runtime = Literal["tpu_dist", "torchtpu"]
EntryKind = Literal["python", "module", "exec", "run_path"]
DEFAULT_MASTER_PORT = 29500
DEFAULT_TPU_BASE_PORT = 8476


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entrypoint:
    """What each worker runs."""

    kind: EntryKind
    """``python`` (``python -u script``), ``module`` (``python -u -m``), ``exec`` (``--no-python``)
    or ``run_path`` (``--run-path``: ``runpy`` inside the spawned worker)."""
    target: str
    """The script, module or executable."""
    args: tuple[str, ...] = ()
    """Its arguments."""
    python: str = sys.executable
    """The interpreter (``PYTHON_EXEC`` overrides, as in torchrun)."""

    def command(self) -> tuple[str, ...]:
        """The command line as the user would type it (for messages and ``--dry-run``)."""
        if self.kind == "exec":
            return (self.target, *self.args)
        if self.kind == "module":
            return (self.python, "-u", "-m", self.target, *self.args)
        return (self.python, "-u", self.target, *self.args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """Everything one ``tpu-launch`` needs, resolved and checked. Built by :func:`resolve`."""

    mode: Mode
    """``tpu``: a TPU is attached; ``emulate``: CPU workers emulating ``topology``; ``cpu``: plain
    CPU workers (no TPU and no ``--emulate``)."""
    slice: SliceShape | None
    """The slice: emulated, or the discovered accelerator type; ``None`` when unknown."""
    runtime: Runtime = "tpu_dist"
    """The workers' TPU runtime: ``tpu_dist`` (JAX; ``TPU_PROCESS_*`` variables) or
    ``torchtpu`` (TorchTPU; ``TORCH_TPU_*`` variables, one worker per TPU device)."""
    topology: str | None
    """``TPU_DIST_TOPOLOGY`` for the workers (emulation only)."""
    num_slices: int
    """Slices in the job."""
    slice_id: int
    """This host's slice (TPU mode)."""
    worker_id: int
    """This host's index within its slice (TPU mode; ``CLOUD_TPU_TASK_ID`` derives from it)."""
    worker_hostnames: tuple[str, ...]
    """Hosts of this slice by worker id, for ``TPU_PROCESS_ADDRESSES`` (TPU mode)."""
    expected_nodes: int | None
    """Hosts the topology implies (TPU mode), checked against ``max_nodes`` by pre-flight."""
    min_nodes: int
    max_nodes: int
    node_rank: int
    """Rank of this launcher among the launchers (static rendezvous)."""
    nproc_per_node: int
    """Workers this launcher starts."""
    master_addr: str
    master_port: int | None
    """``None`` with a c10d rendezvous on a free port (single host)."""
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    max_restarts: int
    tee: str
    """torchrun's ``--tee``; ``"3"`` (both streams, rank-prefixed) unless given."""
    platform: str | None
    """``TPU_DIST_PLATFORM`` to hand to workers; ``None`` leaves the variable alone."""
    tpu_base_port: int
    """First of this host's ``TPU_PROCESS_PORT`` values (one port per local worker)."""
    entry: Entrypoint
    plan_json: str | None = None
    """``--plan-json``: where to write the resolved launch as JSON (``-``: stdout)."""
    default_for_cpu: bool = False
    """``--default-for-cpu``: workers make tpu_dist torch's default backend for CPU tensors."""
    dry_run: bool = False
    preflight: bool = True
    provenance: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Resolved field -> where its value came from."""
    notes: tuple[str, ...] = ()
    """Choices made on the user's behalf, one sentence each."""
    torchrun: argparse.Namespace | None = dataclasses.field(default=None, compare=False)
    """torchrun's parsed flags, passed through unchanged for the ones tpu_dist does not resolve
    (logs, signals, NUMA, ...); see :func:`tpu_dist.launch._run.elastic_config`."""

    def __post_init__(self) -> None:
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got "
                f"{self.min_nodes}:{self.max_nodes}"
            )
        if not 0 <= self.node_rank < self.max_nodes:
            raise ValueError(
                f"node rank {self.node_rank} ({self.provenance.get('node_rank', '?')}) is outside "
                f"0..{self.max_nodes - 1} for {self.max_nodes} nodes"
            )
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.num_slices < 1:
            raise ValueError(f"--num-slices must be >= 1, got {self.num_slices}")

    @property
    def world_size(self) -> int:
        """Ranks in the job when every node has joined."""
        return self.max_nodes * self.nproc_per_node

    @property
    def one_chip_per_process(self) -> bool:
        """TPU mode, tpu_dist runtime, one worker per local chip: the TPU_PROCESS_* variables
        are set."""
        return (
            self.mode == "tpu"
            and self.runtime == "tpu_dist"
            and (self.nproc_per_node > 1 or self._host_chips() == 1)
        )

    @property
    def hosts_per_slice(self) -> int:
        """Hosts in one slice (the topology's, else the node count over the slices)."""
        return max(1, (self.expected_nodes or self.max_nodes) // self.num_slices)

    def _host_chips(self) -> int | None:
        return self.slice.chips_per_host if self.slice else None


def _parse_nnodes(text: str) -> tuple[int, int]:
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValueError(f"--nnodes must be N or MIN:MAX, got {text!r}")


def _flag_label(flag: str, dest: str, environ: Mapping[str, str]) -> str:
    var = f"PET_{dest.upper()}"
    return f"{flag} / {var}" if var in environ else flag


def _entrypoint(args: argparse.Namespace, environ: Mapping[str, str]) -> Entrypoint:
    python = environ.get("PYTHON_EXEC", sys.executable)
    script_args = tuple(args.training_script_args)
    if args.run_path:
        if not os.path.isabs(args.training_script):
            raise ValueError(
                f"--run-path needs an absolute script path, got {args.training_script!r}"
            )
        return Entrypoint(
            kind="run_path", target=args.training_script, args=script_args, python=python
        )
    if args.no_python:
        if args.module:
            raise ValueError("--no-python and -m/--module cannot be used together")
        return Entrypoint(kind="exec", target=args.training_script, args=script_args, python=python)
    kind: EntryKind = "module" if args.module else "python"
    return Entrypoint(kind=kind, target=args.training_script, args=script_args, python=python)


def _tpu_slice(discovery: Discovery, notes: list[str]) -> SliceShape | None:
    names = []
    if discovery.accelerator_type and discovery.topology:
        gen = discovery.accelerator_type.split("-")[0]
        names.append(f"{gen}:{discovery.topology}")
    if discovery.accelerator_type:
        names.append(discovery.accelerator_type)
    for name in names:
        try:
            return parse_slice(name)
        except ValueError as err:
            notes.append(f"could not read the slice {name!r} ({err})")
    return None


def resolve(
    args: argparse.Namespace,
    discovery: Discovery,
    environ: Mapping[str, str] | None = None,
) -> LaunchSpec:
    """Combines flags, their environment defaults and discovery into a :class:`LaunchSpec`.

    One step per part of the launch, in this order (a later step reads what the earlier ones
    resolved; each records where its values came from in ``prov`` and its choices in
    ``notes``): the mode and slice, the runtime, the slice count, the node count, the workers
    per node (then checked against the mode), the node rank, the master address, the
    rendezvous, and what every worker gets.

    Args:
        args: from :func:`tpu_dist.launch._cli.parse_args` (``None`` marks a value not given).
        discovery: from :func:`tpu_dist.launch._discovery.discover`.
        environ: the launcher's environment (default ``os.environ``).

    Raises:
        ValueError: inconsistent or unreadable flags; the message names the flag and the fix.
    """
    env = dict(os.environ if environ is None else environ)
    read_platform(env)  # validates TPU_DIST_PLATFORM early
    notes: list[str] = []
    prov: dict[str, str] = {}

    mode, slice_shape, topology = _mode_and_slice(args, discovery, notes, prov)
    runtime = _runtime(args, discovery, mode, prov)
    num_slices = _num_slices(args, discovery, prov)
    hw = _Hardware(mode, runtime, slice_shape, topology, num_slices)
    slice_id = discovery.slice_id or 0
    worker_id = discovery.worker_id or 0
    nodes = _node_count(args, discovery, hw, env, prov)
    nproc = _nproc_per_node(args, discovery, hw, nodes.max_nodes, env, prov)
    _check_nproc_per_node(args, discovery, hw, nodes.max_nodes, nproc)
    if mode == "tpu" and runtime != "torchtpu":
        hw = hw._replace(slice=_with_counted_chips(hw.slice, discovery))
    node_rank = _node_rank(args, discovery, mode, nodes.hosts_per_slice, env, notes, prov)
    master_addr = _master_addr(args, discovery, num_slices, nodes.max_nodes, env, prov)
    rdzv = _rendezvous(args, master_addr, nodes.max_nodes, env, notes, prov)
    platform = _worker_platform(mode, env, prov)
    tee = args.tee if args.tee is not None else "3"
    if args.tee is None:
        prov["tee"] = "default: both streams, each line prefixed by its rank"

    return LaunchSpec(
        mode=mode,
        slice=hw.slice,
        runtime=runtime,
        topology=topology,
        num_slices=num_slices,
        slice_id=slice_id,
        worker_id=(
            worker_id if discovery.worker_id is not None else node_rank % nodes.hosts_per_slice
        ),
        worker_hostnames=discovery.worker_hostnames,
        expected_nodes=nodes.expected_nodes,
        min_nodes=nodes.min_nodes,
        max_nodes=nodes.max_nodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master_addr,
        master_port=rdzv.master_port,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_id=rdzv.run_id,
        max_restarts=args.max_restarts,
        tee=tee,
        platform=platform,
        tpu_base_port=args.tpu_base_port,
        entry=_entrypoint(args, env),
        plan_json=getattr(args, "plan_json", None),
        default_for_cpu=getattr(args, "default_for_cpu", False),
        dry_run=args.dry_run,
        preflight=not args.skip_preflight,
        provenance=prov,
        notes=tuple(notes),
        torchrun=args,
    )


def _mode_and_slice(
    args: argparse.Namespace, discovery: Discovery, notes: list[str], prov: dict[str, str]
) -> tuple[Mode, SliceShape | None, str | None]:
    """The mode (``--emulate``, else a TPU attached, else plain CPU), the slice and the emulated
    topology (``None`` unless emulating)."""
    if args.emulate:
        slice_shape = parse_slice(args.emulate)
        prov["topology"] = getattr(args, "emulate_source", "--emulate")
        if discovery.on_tpu:
            notes.append("a TPU is attached, but --emulate runs CPU workers emulating the topology")
        return "emulate", slice_shape, args.emulate
    if discovery.on_tpu:
        slice_shape = _tpu_slice(discovery, notes)
        if slice_shape is not None:
            prov["topology"] = discovery.provenance.get("accelerator_type", "discovery")
        return "tpu", slice_shape, None
    return "cpu", None, None


def _runtime(
    args: argparse.Namespace, discovery: Discovery, mode: Mode, prov: dict[str, str]
) -> Runtime:
    """``--runtime``: explicit, else TorchTPU on a TPU host where ``torch_tpu`` is installed."""
    choice = getattr(args, "runtime", None) or "auto"
    if choice == "auto":
        if mode == "tpu" and discovery.torch_tpu:
            prov["runtime"] = "auto: a TPU host with torch_tpu installed"
            return "torchtpu"
        prov["runtime"] = "auto"
        return "tpu_dist"
    prov["runtime"] = getattr(args, "runtime_source", None) or "--runtime"
    if choice == "torchtpu" and mode != "tpu":
        raise ValueError(
            f"--runtime torchtpu needs a TPU host, but this launch is in {mode} mode: TorchTPU "
            "has no CPU emulation. Drop --emulate (or --runtime), or plan a TPU host's launch "
            "without one with TPU_DIST_PLATFORM=tpu and TPU_ACCELERATOR_TYPE, "
            "TPU_WORKER_HOSTNAMES, TPU_WORKER_ID"
        )
    return choice  # type: ignore[return-value]


class _Hardware(NamedTuple):
    """What the workers run on, as :func:`resolve`'s first steps found it."""

    mode: Mode
    runtime: Runtime
    slice: SliceShape | None
    topology: str | None
    """The emulated topology (``--emulate``); ``None`` unless emulating."""
    num_slices: int


def _num_slices(args: argparse.Namespace, discovery: Discovery, prov: dict[str, str]) -> int:
    """Slices in the job: ``--num-slices``, else discovery's, else 1."""
    if args.num_slices is not None:
        prov["num_slices"] = getattr(args, "num_slices_source", "--num-slices")
        return args.num_slices
    if discovery.num_slices is not None:
        prov["num_slices"] = discovery.provenance["num_slices"]
        return discovery.num_slices
    prov["num_slices"] = "default"
    return 1


class _NodeCount(NamedTuple):
    hosts_per_slice: int
    expected_nodes: int | None
    """Hosts the topology implies (TPU mode only)."""
    min_nodes: int
    max_nodes: int


def _node_count(
    args: argparse.Namespace,
    discovery: Discovery,
    hw: _Hardware,
    env: Mapping[str, str],
    prov: dict[str, str],
) -> _NodeCount:
    """Hosts per slice, the hosts the topology implies, and ``--nnodes`` (else hosts per slice
    x slices on a TPU host or where the slice's hostnames are known, else 1)."""
    hostnames = discovery.worker_hostnames
    if hw.mode == "tpu":
        hosts_per_slice = len(hostnames) or (hw.slice.num_hosts if hw.slice else 1)
        expected_nodes: int | None = hosts_per_slice * hw.num_slices
    else:
        hosts_per_slice = len(hostnames) or 1
        expected_nodes = None
    if args.nnodes is not None:
        min_nodes, max_nodes = _parse_nnodes(args.nnodes)
        prov["nnodes"] = _flag_label("--nnodes", "nnodes", env)
    else:
        min_nodes = max_nodes = (
            hosts_per_slice * hw.num_slices if (hw.mode == "tpu" or hostnames) else 1
        )
        if hw.mode == "tpu":
            where = discovery.provenance.get("worker_hostnames", "topology")
            prov["nnodes"] = f"hosts per slice ({where}) x slices"
        elif hostnames:
            prov["nnodes"] = discovery.provenance["worker_hostnames"]
        else:
            prov["nnodes"] = "default"
    return _NodeCount(hosts_per_slice, expected_nodes, min_nodes, max_nodes)


def _nproc_per_node(
    args: argparse.Namespace,
    discovery: Discovery,
    hw: _Hardware,
    max_nodes: int,
    env: Mapping[str, str],
    prov: dict[str, str],
) -> int:
    """``--nproc-per-node`` (a number, or torchrun's ``cpu``/``gpu``/...), else one worker per
    TPU device (TorchTPU), per local chip (tpu_dist on a TPU host) or per emulated device,
    else 1."""
    nproc_text = args.nproc_per_node
    slice_shape = hw.slice
    if nproc_text is not None and str(nproc_text).strip().lower() not in ("auto", ""):
        try:
            nproc = int(nproc_text)
        except ValueError:
            from torch.distributed.run import determine_local_world_size

            nproc = determine_local_world_size(str(nproc_text))
        prov["nproc_per_node"] = _flag_label("--nproc-per-node", "nproc_per_node", env)
    elif hw.mode == "tpu" and hw.runtime == "torchtpu" and slice_shape is not None:
        nproc = slice_shape.chips_per_host * slice_shape.devices_per_chip
        prov["nproc_per_node"] = (
            f"one per TPU device of a {slice_shape.name} host (TorchTPU: "
            f"{slice_shape.devices_per_chip} per chip)"
        )
    elif hw.mode == "tpu":
        if discovery.local_chips:
            nproc = discovery.local_chips
            prov["nproc_per_node"] = "one per local chip (PCI scan)"
        elif slice_shape is not None:
            nproc = slice_shape.chips_per_host
            prov["nproc_per_node"] = f"one per chip of a {slice_shape.name} host"
        else:
            raise ValueError(
                "cannot tell how many TPU chips this host has (no PCI chips found and no "
                "accelerator type known): pass --nproc-per-node or set TPU_ACCELERATOR_TYPE"
            )
    elif hw.mode == "emulate":
        assert slice_shape is not None
        total = slice_shape.num_devices * hw.num_slices
        if total % max_nodes:
            raise ValueError(
                f"--emulate {hw.topology} has {total} devices ({hw.num_slices} slice(s)), which "
                f"do not split evenly over {max_nodes} nodes; pick --nnodes dividing {total}"
            )
        nproc = total // max_nodes
        prov["nproc_per_node"] = f"one per emulated device: {total} / {max_nodes} node(s)"
    else:
        nproc = 1
        prov["nproc_per_node"] = "default (no TPU and no --emulate)"
    return nproc


def _check_nproc_per_node(
    args: argparse.Namespace, discovery: Discovery, hw: _Hardware, max_nodes: int, nproc: int
) -> None:
    """Raises ValueError unless ``nproc`` workers per node fit the mode: one per emulated device
    in all, one per TPU device (TorchTPU), one per chip or one for all chips (tpu_dist on a TPU
    host), and no ``--virtual-local-rank`` with several workers on a TPU host."""
    slice_shape = hw.slice
    if hw.mode == "emulate":
        assert slice_shape is not None
        total = slice_shape.num_devices * hw.num_slices
        if max_nodes * nproc != total:
            raise ValueError(
                f"--emulate {hw.topology} x {hw.num_slices} slice(s) has {total} devices, but "
                f"{max_nodes} node(s) x {nproc} workers = {max_nodes * nproc} workers; emulation "
                f"runs one worker per device: drop --nproc-per-node or make nnodes x nproc = "
                f"{total}"
            )
    if hw.mode == "tpu" and hw.runtime == "torchtpu":
        if slice_shape is None:
            raise ValueError(
                "--runtime torchtpu needs the slice's topology (TORCH_TPU_TOPOLOGY), but the "
                "accelerator type is unknown: set TPU_ACCELERATOR_TYPE (e.g. v5p-16) or "
                "TPU_TOPOLOGY"
            )
        per_host = slice_shape.chips_per_host * slice_shape.devices_per_chip
        if nproc != per_host:
            raise ValueError(
                f"TorchTPU runs one worker per TPU device: a {slice_shape.name} host has "
                f"{per_host}, so --nproc-per-node must be {per_host} (or left out), got {nproc}"
            )
    elif hw.mode == "tpu":
        host_chips = discovery.local_chips or (slice_shape.chips_per_host if slice_shape else None)
        if host_chips and nproc not in (1, host_chips):
            raise ValueError(
                f"this TPU host has {host_chips} chips; --nproc-per-node must be {host_chips} (one "
                f"worker per chip) or 1 (one worker driving all chips), got {nproc}"
            )
        if args.virtual_local_rank and nproc > 1:
            raise ValueError(
                "--virtual-local-rank is a CUDA feature; on TPU each worker gets its chip through "
                "TPU_VISIBLE_CHIPS instead: drop the flag"
            )


def _with_counted_chips(slice_shape: SliceShape | None, discovery: Discovery) -> SliceShape | None:
    """The slice as this TPU host has it: its chips per host as the PCI scan counted them, where
    that count differs from the slice name's."""
    host_chips = discovery.local_chips
    if host_chips and slice_shape is not None and host_chips != slice_shape.chips_per_host:
        return dataclasses.replace(slice_shape, chips_per_host=host_chips)
    return slice_shape


def _node_rank(
    args: argparse.Namespace,
    discovery: Discovery,
    mode: Mode,
    hosts_per_slice: int,
    env: Mapping[str, str],
    notes: list[str],
    prov: dict[str, str],
) -> int:
    """``--node-rank``, else the host's index in the job as discovered (slice x hosts per slice
    + worker id), else 0."""
    slice_id = discovery.slice_id or 0
    discovered_rank: int | None = None
    if discovery.worker_id is not None:
        discovered_rank = slice_id * hosts_per_slice + discovery.worker_id
    if args.node_rank is not None:
        node_rank = args.node_rank
        prov["node_rank"] = _flag_label("--node-rank", "node_rank", env)
        if mode == "tpu" and discovered_rank is not None and discovered_rank != node_rank:
            notes.append(
                f"--node-rank {node_rank} differs from the discovered host index {discovered_rank} "
                f"({discovery.provenance.get('worker_id')}); the TPU runtime variables still "
                "follow "
                "the physical host"
            )
        return node_rank
    if discovered_rank is not None:
        where = discovery.provenance.get("worker_id", "discovery")
        prov["node_rank"] = where if slice_id == 0 else f"{where} and MEGASCALE_SLICE_ID"
        return discovered_rank
    prov["node_rank"] = "default"
    return 0


def _master_addr(
    args: argparse.Namespace,
    discovery: Discovery,
    num_slices: int,
    max_nodes: int,
    env: Mapping[str, str],
    prov: dict[str, str],
) -> str:
    """``--master-addr``, else the multislice coordinator's host, else the slice's worker 0 (on
    several nodes), else 127.0.0.1."""
    hostnames = discovery.worker_hostnames
    if args.master_addr is not None:
        prov["master_addr"] = _flag_label("--master-addr", "master_addr", env)
        return args.master_addr
    if num_slices > 1 and discovery.coordinator_address:
        master_addr = discovery.coordinator_address
        if master_addr.count(":") == 1:  # host:port (an IPv6 address has more colons)
            master_addr = master_addr.split(":")[0]
        prov["master_addr"] = discovery.provenance["coordinator_address"]
        return master_addr
    if hostnames and max_nodes > 1:
        prov["master_addr"] = f"worker 0 of {discovery.provenance['worker_hostnames']}"
        return hostnames[0]
    prov["master_addr"] = "default"
    return "127.0.0.1"


class _Rendezvous(NamedTuple):
    master_port: int | None
    backend: str
    endpoint: str
    run_id: str


def _rendezvous(
    args: argparse.Namespace,
    master_addr: str,
    max_nodes: int,
    env: Mapping[str, str],
    notes: list[str],
    prov: dict[str, str],
) -> _Rendezvous:
    """The rendezvous as torchrun's flags ask, with torchrun's defaults: c10d on a free local
    port for ``--standalone`` and for one node, else static at the master address; c10d when
    several nodes restart (``--max-restarts``) and no backend was chosen."""
    master_port = args.master_port
    if master_port is not None:
        prov["master_port"] = _flag_label("--master-port", "master_port", env)
    backend = args.rdzv_backend or "static"
    endpoint = args.rdzv_endpoint or ""
    rdzv_id = args.rdzv_id or "none"
    if args.standalone:
        backend, endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        notes.append("--standalone: c10d rendezvous on a free local port")
    elif backend == "static" and not endpoint and master_port is None and max_nodes == 1:
        backend, endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        prov["master_port"] = "a free port (single node, as torchrun)"
    else:
        if master_port is None:
            master_port = DEFAULT_MASTER_PORT
            prov["master_port"] = "default"
        if (
            backend == "static"
            and args.rdzv_backend is None
            and args.max_restarts > 0
            and max_nodes > 1
        ):
            backend = "c10d"
            endpoint = endpoint or f"{master_addr}:{master_port}"
            notes.append(
                f"--max-restarts {args.max_restarts} on {max_nodes} nodes: using the c10d "
                f"rendezvous at {endpoint} so that every node restarts together (the static "
                "rendezvous cannot); node ranks are then assigned by the rendezvous"
            )
        elif backend == "static" and args.max_restarts > 0 and max_nodes > 1:
            notes.append(
                f"--rdzv-backend static with --max-restarts {args.max_restarts} on {max_nodes} "
                "nodes: a node restarts only when its own workers fail. Another node's "
                "failure restarts this one only if its workers were in a collective with the "
                "failed ones (theirs then fail too); otherwise the restarted node waits for "
                "the others until the rendezvous timeout. Leave --rdzv-backend unset (c10d) "
                "so that every node restarts together"
            )
    prov["rdzv_backend"] = (
        _flag_label("--rdzv-backend", "rdzv_backend", env) if args.rdzv_backend else "default"
    )
    return _Rendezvous(master_port, backend, endpoint, rdzv_id)


def _worker_platform(mode: Mode, env: Mapping[str, str], prov: dict[str, str]) -> str | None:
    """``TPU_DIST_PLATFORM`` for the workers: the user's own passed through (None), else
    ``cpu`` in the CPU modes, else None (TPU mode: discovered by the workers)."""
    if _settings.PLATFORM.env in env:
        prov["platform"] = "yours, passed through"
        return None
    if mode in ("emulate", "cpu"):
        prov["platform"] = f"{mode} mode"
        return "cpu"
    return None
