"""Command line: torchrun's flags plus the TPU ones -> :func:`tpu_dist.launch._config.resolve`.

torchrun's own parser (``torch.distributed.run.get_args_parser``) is reused, so every torchrun
flag and its ``PET_*`` environment default behave as under torchrun. The values discovery may
supply (``--nnodes``, ``--nproc-per-node``, ``--node-rank``, ``--master-addr``,
``--rdzv-backend``) and ``--tee`` default to "not given" instead of torchrun's constants, unless
their ``PET_*`` variable is set, so that :func:`~tpu_dist.launch._config.resolve` can tell an
explicit choice from a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tpu_dist import _settings
from tpu_dist.collectives import DEFAULT_FOR_CPU_ENV
from tpu_dist.launch._config import DEFAULT_TPU_BASE_PORT

__all__ = ["TPU_KNOBS", "Knob", "build_parser", "main", "parse_args"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Knob:
    """One TPU flag: its spellings, environment variable, type, default and help, declared once."""

    flags: tuple[str, ...]
    dest: str
    env: str | None
    type: Callable[[str], Any] | None
    default: Any
    help: str
    metavar: str | None = None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError(f"must be a TCP port (1..65535), got {value}")
    return value


def _runtime(text: str) -> str:
    value = text.strip().lower()
    if value not in ("auto", "tpu_dist", "torchtpu"):
        raise ValueError(f"must be auto, tpu_dist or torchtpu, got {text!r}")
    return value


TPU_KNOBS: tuple[Knob, ...] = (
    Knob(
        flags=("--emulate",),
        dest="emulate",
        env=_settings.TOPOLOGY.env,
        type=str,
        default=None,
        metavar="TYPE",
        help="Run CPU workers emulating this TPU topology, one worker per chip: an accelerator "
        "type (v5litepod-8, v4-16) or GENERATION:TOPOLOGY (v5p:2x2x2). Workers get "
        "TPU_DIST_TOPOLOGY, TPU_DIST_NUM_SLICES and TPU_DIST_PLATFORM=cpu. Without a TPU and "
        "without this flag, workers are plain CPU processes.",
    ),
    Knob(
        flags=("--num-slices", "--num_slices"),
        dest="num_slices",
        env=_settings.NUM_SLICES.env,
        type=_positive_int,
        default=None,
        metavar="N",
        help="Slices in the job (multislice). Default: MEGASCALE_NUM_SLICES, else 1.",
    ),
    Knob(
        flags=("--runtime",),
        dest="runtime",
        env="TPU_DIST_LAUNCH_RUNTIME",
        type=_runtime,
        default="auto",
        metavar="{auto,tpu_dist,torchtpu}",
        help="Which TPU runtime the workers use. torchtpu: TorchTPU (torch-tpu), whose workers "
        "get TORCH_TPU_SLICEBUILDER_ADDRESSES, TORCH_TPU_TOPOLOGY and TORCH_TPU_DEVICES_PER_HOST, "
        "one worker per TPU device (per TensorCore on TPU7x). tpu_dist: tpu_dist's JAX runtime "
        "(TPU_PROCESS_* variables). auto: torchtpu on a TPU host where torch_tpu is installed, "
        "else tpu_dist.",
    ),
    Knob(
        flags=("--tpu-base-port", "--tpu_base_port"),
        dest="tpu_base_port",
        env="TPU_DIST_TPU_BASE_PORT",
        type=_port,
        default=DEFAULT_TPU_BASE_PORT,
        metavar="PORT",
        help="First TPU_PROCESS_PORT on each host; local rank i uses PORT+i (TPU only).",
    ),
)


class _KnobAction(argparse.Action):
    """Takes its default from the knob's environment variable, parsed strictly."""

    def __init__(self, *args: Any, knob: Knob, environ: Mapping[str, str], **kwargs: Any) -> None:
        default, source = knob.default, "default"
        if knob.env and knob.env in environ:
            raw = environ[knob.env]
            try:
                default = knob.type(raw) if knob.type else raw
            except ValueError as err:
                raise ValueError(
                    f"{knob.env}={raw!r} is invalid for {knob.flags[0]}: {err}"
                ) from err
            source = knob.env
        super().__init__(*args, default=default, **kwargs)
        self.knob, self.source = knob, source

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_source", option_string)


def _type_for(knob: Knob) -> Callable[[str], Any] | None:
    if knob.type is None:
        return None

    def convert(text: str) -> Any:
        try:
            return knob.type(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    convert.__name__ = getattr(knob.type, "__name__", "value")
    return convert


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """torchrun's parser with tpu_dist's flags and defaults (see the module docstring)."""
    from torch.distributed.run import get_args_parser

    env = os.environ if environ is None else environ
    parser = get_args_parser()
    _adapt_torchrun_flags(parser, env)
    group = parser.add_argument_group("TPU")
    _add_knob_flags(group, env)
    _add_plan_flags(group)
    _add_compile_only_flags(group)
    _add_output_flags(group)
    return parser


def _adapt_torchrun_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """torchrun's own flags as tpu-launch takes them: its name, no abbreviations, defaults that
    discovery resolves, ``--nproc-per-host``, and tpu-launch's words in their help."""
    parser.prog = "tpu-launch"
    # No prefix matching of the launcher's flags: argparse applies it to every "--x" of argv,
    # the script's own arguments included, so a script's --tp (tensor parallelism) was taken
    # for an abbreviation of --tpu-base-port ("ambiguous option") before it reached the script.
    parser.allow_abbrev = False
    parser.description = (
        "Start the workers of one host of a torch.distributed job on TPU (or CPU emulation). "
        "See `python -c 'import tpu_dist.launch; help(tpu_dist.launch)'` for the manual."
    )
    # Not given -> None (resolved from discovery), unless the PET_* variable gives it.
    parser.set_defaults(
        **{
            dest: None
            for dest in (
                "nnodes",
                "nproc_per_node",
                "node_rank",
                "master_addr",
                "rdzv_backend",
                "tee",
            )
            if f"PET_{dest.upper()}" not in env
        }
    )
    parser.add_argument(
        "--nproc-per-host",
        "--nproc_per_host",
        dest="nproc_per_node",
        default=argparse.SUPPRESS,
        help="Alias of --nproc-per-node. Default (auto): one worker per local TPU chip; with "
        "--emulate, one per emulated chip of this node; otherwise 1.",
    )
    for action in parser._actions:  # argparse keeps no public way to edit a flag's help
        if action.dest in _TORCHRUN_HELP:
            action.help = _TORCHRUN_HELP[action.dest]


def _add_knob_flags(group: argparse._ArgumentGroup, env: Mapping[str, str]) -> None:
    """A flag for each launch knob of the TPU group (:data:`TPU_KNOBS`; each also read from its
    env var)."""
    for knob in TPU_KNOBS:
        group.add_argument(
            *knob.flags,
            dest=knob.dest,
            type=_type_for(knob),
            metavar=knob.metavar,
            help=knob.help + (f" Env: {knob.env}." if knob.env else ""),
            action=_KnobAction,
            knob=knob,
            environ=env,
        )


def _add_plan_flags(group: argparse._ArgumentGroup) -> None:
    """What tpu-launch resolves, shown or handed on: --dry-run, --plan-json,
    --default-for-cpu."""
    group.add_argument(
        "--dry-run",
        "--dry_run",
        action="store_true",
        help="Print the resolved launch, and for every host and rank the environment each worker "
        "would get, then exit without starting anything.",
    )
    group.add_argument(
        "--plan-json",
        "--plan_json",
        metavar="FILE",
        default=None,
        help="Write the resolved launch as JSON to FILE ('-' for stdout): every node and "
        "worker with every variable tpu-launch sets for it ({world_size, runtime, nodes: [{node_rank, "
        "host, workers: [{rank, local_rank, env}]}], shared_env}). With --dry-run nothing is "
        "started.",
    )
    group.add_argument(
        "--default-for-cpu",
        "--default_for_cpu",
        action="store_true",
        help=f"Workers get {DEFAULT_FOR_CPU_ENV}=1: tpu_dist becomes torch's default backend for "
        "CPU tensors in them, for programs (training frameworks) that call init_process_group() "
        "without naming a backend.",
    )


def _add_compile_only_flags(group: argparse._ArgumentGroup) -> None:
    """The dry run that compiles a job's collectives for TPU: --compile-only and its options."""
    group.add_argument(
        "--compile-only",
        "--compile_only",
        action="store_true",
        help="Do not start the job: run the script once, in one process, as one rank "
        "(--compile-rank) of the whole --emulate topology's world, with 'tpu' groups that record "
        "collectives instead of running them (outputs have the right shapes, their values are "
        "not meaningful), then compile every recorded collective with libtpu's TPU compiler for "
        "the topology's devices and print a report. Needs libtpu (pip install "
        "'tpu-dist[tpu-compile]'); no TPU. Exit 0 only if the script finished and every "
        "collective compiled.",
    )
    group.add_argument(
        "--compile-rank",
        "--compile_rank",
        type=int,
        default=0,
        metavar="R",
        help="With --compile-only: the global rank the script runs as (default 0).",
    )
    group.add_argument(
        "--tensors",
        choices=("fake", "real"),
        default="fake",
        help="With --compile-only: 'fake' (default) makes the script's large tensors fake "
        "tensors (shape and dtype, no data: a model of any size and sequence length costs no "
        "memory; values read back, such as loss.item(), are 0); 'real' runs it with real "
        "tensors (needs their memory).",
    )
    group.add_argument(
        "--tpu-device",
        "--tpu_device",
        choices=("emulate", "none"),
        default="emulate",
        help="With --compile-only: 'emulate' (default) gives the script TorchTPU's 'tpu' device, "
        "as on a pod where TorchTPU is installed: 'tpu' tensors (fake: no data), the torch.tpu "
        "module, torch's accelerator and c10d backend for 'tpu' (the recording group), without "
        "TorchTPU (not loaded even if installed) and without a TPU; a script that never uses "
        "it runs as before. 'none': no such device (a pod without TorchTPU).",
    )
    group.add_argument(
        "--compile-report",
        "--compile_report",
        default=None,
        metavar="FILE",
        help="With --compile-only: also write the report as JSON to FILE.",
    )


def _add_output_flags(group: argparse._ArgumentGroup) -> None:
    """How much tpu-launch says, and what it checks first: --verbose, --skip-preflight."""
    group.add_argument(
        "--verbose",
        action="store_true",
        help="Also print each variable tpu-launch sets for the workers, elastic's per-worker stop "
        "messages, torchrun's full failure table, and the '[Gloo] Rank N is connected to ...' "
        "lines XLA's CPU collectives print (all hidden by default; a failure is always reported).",
    )
    group.add_argument(
        "--skip-preflight",
        "--skip_preflight",
        action="store_true",
        help="Skip the pre-flight checks (ports, TPU devices held by other processes, host count).",
    )


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parses ``argv``; each TPU knob's ``<dest>_source`` says whether a flag or env var set it."""
    env = os.environ if environ is None else environ
    args = build_parser(env).parse_args(argv)
    for knob in TPU_KNOBS:
        if not hasattr(args, f"{knob.dest}_source"):
            setattr(args, f"{knob.dest}_source", knob.env if knob.env in env else "default")
    return args


_TORCHRUN_HELP = {
    "training_script": "The program each worker runs: a Python script (with -m a module, with "
    "--no-python any executable), followed by its own arguments.",
    "nnodes": "Hosts in the job, or MIN:MAX for an elastic range. Default: discovered on Cloud "
    "TPU and GKE (hosts per slice x slices); 1 otherwise.",
    "nproc_per_node": "Workers on this host: a number, or auto (the default): one per local TPU "
    "chip; with --emulate, one per emulated chip of this host; otherwise 1. torchrun's cpu "
    "(one per CPU core), gpu and xpu (one per such device) keep their torchrun meaning.",
    "node_rank": "This host's index in the job (static rendezvous). Default: discovered on Cloud "
    "TPU and GKE (slice id x hosts per slice + TPU worker id); 0 otherwise.",
    "master_addr": "Address of node 0 (static rendezvous). Default: discovered (the multislice "
    "coordinator, else the first of TPU_WORKER_HOSTNAMES); 127.0.0.1 otherwise.",
    "numa_binding": "torchrun's binding of each worker to the CPUs near its GPU; it needs CUDA "
    "GPUs and is not for TPU or CPU-emulated workers.",
    "virtual_local_rank": "CUDA only: LOCAL_RANK=0 for every worker and CUDA_VISIBLE_DEVICES "
    "narrowed to its GPU. On TPU each worker gets its chip through TPU_VISIBLE_CHIPS instead "
    "(refused there with several workers per host).",
}
"""torchrun help texts that speak of GPUs or ignore discovery, rewritten for tpu-launch."""


def _setup_logging() -> None:
    logger = logging.getLogger("tpu_dist.launch")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _write_plan(spec: Any, environ: Mapping[str, str]) -> None:
    import json

    from tpu_dist.launch._launch_json import launch_plan

    text = json.dumps(launch_plan(spec, environ), indent=2) + "\n"
    if spec.plan_json == "-":
        sys.stdout.write(text)
        return
    try:
        with open(spec.plan_json, "w") as f:
            f.write(text)
    except OSError as err:
        sys.stderr.write(f"tpu-launch: error: cannot write --plan-json {spec.plan_json}: {err}\n")
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """``tpu-launch``: parse, discover, resolve, check, then launch (or print, with --dry-run).

    Exits with the code documented in :mod:`tpu_dist.launch._run`.
    """
    from tpu_dist.launch._config import resolve
    from tpu_dist.launch._discovery import discover
    from tpu_dist.launch._env import compute_worker_env
    from tpu_dist.launch._preflight import Problem, preflight
    from tpu_dist.launch._run import format_dry_run, launch

    from tpu_dist.launch._zygote import open_standard_fds

    open_standard_fds()  # tpu-launch's entry did it already; python -m tpu_dist.launch here
    _setup_logging()
    environ = dict(os.environ)  # the user's environment, before the launcher exports anything
    try:
        args = parse_args(argv, environ)
        spec = resolve(args, discover(environ), environ)
        worker_env = compute_worker_env(spec, environ)
        _settings.LAUNCH_PRELOAD.get(environ)  # a malformed switch: exit 2, nothing started
    except ValueError as err:
        sys.stderr.write(f"tpu-launch: error: {err}\n")
        sys.exit(2)
    if args.compile_only:
        from tpu_dist.launch._compile_only import run_compile_only

        try:
            code = run_compile_only(
                spec, environ, rank=args.compile_rank, report=args.compile_report,
                tensors=args.tensors, tpu_device=args.tpu_device,
            )
        except ValueError as err:
            sys.stderr.write(f"tpu-launch: error: {err}\n")
            sys.exit(2)
        sys.exit(code)
    if spec.preflight:
        problems = preflight(spec, worker_env)
    else:
        problems = [Problem("warning", n) for n in (*spec.notes, *worker_env.notes)]
    errors = [p for p in problems if p.severity == "error"]
    if spec.plan_json:
        _write_plan(spec, environ)
    if spec.dry_run and spec.plan_json == "-":
        sys.exit(2 if errors else 0)
    if spec.dry_run:
        sys.stdout.write(format_dry_run(spec, environ, problems))
        sys.exit(2 if errors else 0)
    for problem in problems:
        sys.stderr.write(f"tpu-launch: {problem.severity}: {problem.message}\n")
    if errors:
        sys.stderr.write(
            f"tpu-launch: {len(errors)} pre-flight error(s); nothing was started "
            "(--skip-preflight skips the checks)\n"
        )
        sys.exit(2)
    _leave(launch(spec, worker_env, verbose=args.verbose))


def _leave(code: int) -> None:
    """End the launcher with ``code`` once the job is over, without the interpreter's teardown:
    ``atexit`` handlers run and the streams are flushed, then ``os._exit``.

    Why: torch.distributed.elastic's threads (the c10d rendezvous's keep-alive, the store
    clients) may still be inside a TCPStore call when the job ends, for example because another
    node's launcher, which hosts the rendezvous's store, has already exited. A thread inside a
    C++ call when Python 3.11 finalizes is ended by force, and the launcher of a job that
    succeeded then dies of ``terminate called without an active exception`` (SIGABRT, exit -6;
    seen in ``tests/test_launch_restart.py``'s two-host case).
    """
    import atexit

    from tpu_dist.launch._worker import exit_without_teardown

    atexit._run_exitfuncs()
    exit_without_teardown(code)
