"""``tpu-launch``: run the workers of a torch.distributed job on TPU hosts, or emulate them on CPU.

``tpu-launch`` (also ``python -m tpu_dist.launch``) starts the worker processes of *one host*,
one per TPU chip by default; the same command on every host of the job forms one
``torch.distributed`` world. Process management, rendezvous, restarts, log handling and error
files are torch.distributed.elastic's (the engine behind ``torchrun``), and every torchrun flag
works as under torchrun. What ``tpu-launch`` adds is TPU knowledge: it finds out which host of
which slice it runs on, starts one worker per chip, and gives each worker the TPU runtime
variables for its chip.

Recipes
=======

One machine, CPU emulation (no TPU needed)::

    tpu-launch --emulate v5litepod-8 train.py --lr 3e-4      # 8 workers, one per emulated chip
    tpu-launch --emulate v5p:2x2x2 train.py                  # 8 workers emulating 2 hosts
    tpu-launch --nproc-per-node 4 train.py                   # 4 plain CPU workers

Two emulated hosts on one machine (or on two machines: use the first one's address)::

    tpu-launch --emulate v5p:2x2x2 --nnodes 2 --node-rank 0 --master-port 29500 train.py &
    tpu-launch --emulate v5p:2x2x2 --nnodes 2 --node-rank 1 --master-port 29500 train.py

A Cloud TPU VM pod slice (every host discovers its index, the host count and the master from
the TPU metadata server; nothing to pass)::

    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \\
        --command="tpu-launch train.py"

GKE with JobSet (one indexed Job per slice; GKE's TPU webhook sets ``TPU_WORKER_ID`` and
``TPU_WORKER_HOSTNAMES``, so the container command is just)::

    command: ["tpu-launch", "train.py"]

Multislice (queued resources or a JobSet with several slices): ``MEGASCALE_NUM_SLICES``,
``MEGASCALE_SLICE_ID`` and ``MEGASCALE_COORDINATOR_ADDRESS`` (set by the platform) give the
slice count, this host's slice and the master; node rank = slice id x hosts per slice + worker
id. Emulated: ``tpu-launch --emulate v5e:2x4 --num-slices 2 train.py``.

TorchTPU (``torch-tpu``) workers: ``--runtime torchtpu`` (the default on a TPU host where
``torch_tpu`` is installed; ``--runtime tpu_dist`` forces tpu_dist's runtime) starts one worker
per TPU device (two per TPU7x chip) and gives them TorchTPU's ``TORCH_TPU_*`` variables instead of
the ``TPU_PROCESS_*`` ones (see ``tpu_dist.launch._torchtpu``)::

    tpu-launch --runtime torchtpu train.py

Fault tolerance: ``--max-restarts N`` restarts the worker group up to N times; a script that
resumes from its last checkpoint then completes. With several hosts, tpu-launch switches the
default static rendezvous to c10d so that all hosts restart together. Each attempt's workers get
their own c10d store (torch's own keys, gloo's peer addresses among them, are not per attempt):
the first attempt torch's, each later one a new store rank 0's launcher starts on a free port,
which that attempt's ``MASTER_PORT`` names (``tpu_dist.launch._rendezvous``).

Check a launch without starting anything: ``tpu-launch --dry-run ... train.py`` prints the
resolved launch (and where each value came from), and per host and rank every variable the
worker would get; ``--plan-json FILE`` writes the same for every node and worker as JSON
(``{"world_size", "runtime", "nodes": [{"node_rank", "host", "workers": [{"rank", "local_rank",
"env"}]}], "shared_env"}``). With ``TPU_DIST_PLATFORM=tpu`` and the TPU VM's variables
(``TPU_ACCELERATOR_TYPE``, ``TPU_WORKER_HOSTNAMES``, ``TPU_WORKER_ID``) a TPU host's launch is
planned on any machine.

Compile a job's collectives for its TPU topology without a TPU (libtpu's compile-only devices)::

    tpu-launch --emulate tpu7x:16x16x16 --compile-only --compile-report plan.json train.py

runs the script once, in one process, as rank ``--compile-rank`` (default 0) of the whole
world, with "tpu" groups that record collectives instead of running them (values not
meaningful), then compiles each recorded collective with libtpu's TPU compiler and prints a
report (:mod:`tpu_dist.compile_job`). Exit 0 only if the script finished and every
collective compiled.

How a host finds out where it is
================================

Each value comes from the first of: a flag; its environment variable (``PET_NNODES``,
``PET_NODE_RANK``, ... as torchrun; ``TPU_DIST_TOPOLOGY`` for ``--emulate``,
``TPU_DIST_NUM_SLICES`` for ``--num-slices``); the environment the platform set
(``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``, ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``,
``MEGASCALE_*``, GKE's ``JOB_COMPLETION_INDEX``); the Cloud TPU metadata server (asked only when a
TPU is attached, with a 1 s timeout: ``TPU_DIST_METADATA_TIMEOUT``); single-host defaults.

* **mode**: ``--emulate`` -> CPU emulation; else a TPU attached (PCI) or
  ``TPU_DIST_PLATFORM=tpu`` -> TPU; else plain CPU workers.
* **--nnodes**: hosts per slice x slices on TPU; 1 otherwise.
* **--node-rank**: slice id x hosts per slice + worker id; 0 otherwise.
* **--nproc-per-node** (alias ``--nproc-per-host``, or ``auto``): the host's chips on TPU (or 1:
  one process driving all chips); the emulated chips / nnodes with ``--emulate``; 1 otherwise.
* **--master-addr**: the multislice coordinator, else worker 0 of ``TPU_WORKER_HOSTNAMES``, else
  127.0.0.1. **--master-port**: 29500; a single-host launch uses a c10d rendezvous on a free port
  instead (as torchrun does).

Variables each worker gets
==========================

From torch.distributed.elastic, as under torchrun: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_ERROR_FILE``, ... (``RANK`` = node rank x nproc +
local rank).

From tpu-launch:

=================================  ===========================================================
``TPU_DIST_PLATFORM``               ``cpu`` when emulating or without TPU (unless you set it)
``TPU_DIST_TOPOLOGY``               the ``--emulate`` topology (emulation)
``TPU_DIST_NUM_SLICES``             the slice count (emulation)
``TPU_VISIBLE_CHIPS``               the worker's chip: its local rank (TPU)
``TPU_CHIPS_PER_PROCESS_BOUNDS``    ``1,1,1`` (TPU)
``TPU_PROCESS_BOUNDS``              the slice's chip grid, e.g. ``2,2,2`` for v4-16 (TPU)
``TPU_PROCESS_ADDRESSES``           ``host:port`` of every worker of the slice (TPU)
``TPU_PROCESS_PORT``                ``--tpu-base-port`` (8476) + local rank (TPU)
``CLOUD_TPU_TASK_ID``               worker id x nproc + local rank (TPU)
``OMP_NUM_THREADS``                 1 with several workers per host (as torchrun)
``GLIBC_TUNABLES``                  ``glibc.malloc.hugetlb=1`` for CPU workers: large buffers on
                                    transparent huge pages (~1/3 off a 64 MiB all_reduce)
``JAX_PLATFORMS``                   ``cpu`` for CPU workers (unless you set it): a program's own
                                    JAX calls never probe libtpu's TPU backend
``TPU_DIST_DEFAULT_FOR_CPU``        ``1`` with ``--default-for-cpu``: tpu_dist is torch's default
                                    backend for CPU tensors (``init_process_group()`` unnamed)
``TPU_DIST_LAUNCH_ATTEMPT``         the attempt (0, 1, ...), the same on every node, unlike
                                    ``TORCHELASTIC_RESTART_COUNT`` (per node, failures only)
``TPU_DIST_COORDINATION_SERVICE``   ``host:port`` of the attempt's JAX coordination service,
                                    which node 0's launcher hosts: the "tpu" backend's ranks
                                    connect as clients, so rank 0's death does not end the
                                    others (they see their collective fail, as on gloo)
=================================  ===========================================================

With ``--runtime torchtpu`` the five TPU variables from ``TPU_VISIBLE_CHIPS`` to
``CLOUD_TPU_TASK_ID`` are not set (TorchTPU sets them itself); instead every worker gets
``TORCH_TPU_SLICEBUILDER_ADDRESSES`` (``host:port`` of every TPU device of the slice, ports from
``TORCH_TPU_BASE_PORT``, 8070), ``TORCH_TPU_TOPOLOGY`` (the slice's chip grid, ``x,y,z``;
``x,y,z,2`` on TPU7x), ``TORCH_TPU_DEVICES_PER_HOST``, and on multislice the ``MEGASCALE_*``
variables the platform did not set (slices, this host's slice, the coordinator
``<master>:8080``).

The TPU variables are set only with one worker per chip; with ``--nproc-per-node 1`` the single
worker sees every chip of its host. A variable you set yourself is never silently overwritten:
it wins and the launcher says so at start (and in ``--dry-run``), except ``TPU_DIST_TOPOLOGY`` /
``TPU_DIST_NUM_SLICES`` when you also pass ``--emulate`` / ``--num-slices`` (the flag wins, and
the launcher says so). The elastic variables above are always set per worker.

Start-up
========

Workers do not each import torch and JAX: as soon as it knows the workers' environment, the
launcher starts one *zygote*, a Python that imports torch and JAX (no backend, no thread), and
DTensor and ``torch._dynamo`` too when the script's source imports a DTensor API (FSDP2, TP,
DTensor, DCP), and forks every worker of every attempt from it (``tpu_dist.launch._zygote``). A
forked worker is the launcher's own child, in its own session, with the environment, arguments,
streams and exit codes of the fresh ``python -u`` worker it replaces; it starts in milliseconds
instead of paying 1-3 s of imports (docs/decisions/0016-workers-forked-from-a-zygote.md). Not
for ``--no-python`` or
``--run-path`` workers, nor where a worker's environment differs from the zygote's in a variable
read at import (such workers start fresh). ``TPU_DIST_LAUNCH_PRELOAD=0`` starts every worker as a
fresh interpreter (and a ``--compile-only`` job, which the launcher otherwise runs itself:
``._compile_only``).

The ``tpu-launch`` command does not import torch twice: its entry (the module ``_tpu_dist_launch``)
re-executes the interpreter once with ``OMP_NUM_THREADS=1`` and ``GLIBC_TUNABLES`` set as CPU
workers get them (where unset: both are read at start-up or import, not after a fork), imports
numpy, torch and ``torch.distributed``, and forks the zygote from itself; the launcher then
restores the environment it was started with (its workers see exactly what they would have) and
the zygote imports JAX once the launcher tells it the workers' environment. Where that
environment differs from the one torch was imported in (one worker per host: no
``OMP_NUM_THREADS``; a TPU host: no huge-page tunable; ``--default-for-cpu``), the launcher ends
that zygote and starts one as a new interpreter, as ``python -m tpu_dist.launch`` always does (it
imports ``tpu_dist``, and so torch, before any launcher code runs). A 4-rank job took 2.4 s
instead of 3.5 (torchrun + gloo: 4.8 s; docs/decisions/0017-one-torch-import-per-launch.md).

Output
======

Every worker's stdout and stderr lines reach the console prefixed by the global rank,
``[rank3]:...`` (torchrun's ``--tee 3`` with the prefix template ``[rank${rank}]:``; change it
with ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, or pass ``--tee 0`` for unprefixed output). Logs
and error files go under ``--log-dir`` (a temporary folder by default).

Quiet by default; ``--verbose`` adds: a ``tpu-launch: setting X=V for the workers`` line per
variable (``--dry-run`` lists them all anyway), elastic's own per-worker stop messages,
torchrun's full failure table, and the ``[Gloo] Rank N is connected to K peer ranks ...`` lines.
Those come from the gloo inside jaxlib (XLA's CPU collectives, which the "tpu" backend uses on
CPU): it prints one with ``std::cout`` for every communicator it connects, with no setting to
stop it, so the launcher leaves exactly that line, when both counts agree, out of what it copies
to the console (the workers' log files keep it; with ``--tee 0`` the workers write to the console
themselves and the lines stay); gloo's report of a peer that did not connect is shown. Under
``torchrun`` the lines stay.

Failure modes
=============

* **Bad flags or environment**: exit code 2 with what was expected and the fix; nothing starts.
* **Pre-flight** (skip with ``--skip-preflight``): the master port taken on node 0, a
  ``TPU_PROCESS_PORT`` taken, a TPU device file or ``/tmp/libtpu_lockfile`` held by a live
  process (the pid and command are named), a host count that does not match the topology: exit
  code 2. A stale lockfile and conflicting variables are warnings.
* **A worker exits non-zero or is killed**: elastic stops the host's other workers (SIGTERM,
  then SIGKILL after ``--shutdown-timeout``), restarts the group if restarts are left, else the
  launcher prints a short report, root cause first as torchrun's "Root Cause (first observed
  failure)": ``tpu-launch: worker failed: node N: rank R (...) exited with code C``, the script
  and the last lines of rank R's traceback (from its error file: ``tpu-launch`` records uncaught
  exceptions itself, no ``@record`` needed), one line for the other ranks, and where the error
  file is (``--verbose`` adds torchrun's full table). It then tells the other hosts' launchers
  through the rendezvous store (they stop their workers within about a second), and exits 1.
  A failing worker (uncaught exception, non-zero ``sys.exit``) runs its ``atexit`` handlers,
  joins its non-daemon threads and flushes its open files, then ends without the interpreter's
  teardown (1-2 s for a process that imported torch, on a loaded host), so the job stops or
  restarts that much sooner; of several workers that failed in the same second, the one that
  ended first is the root cause.
* **SIGINT/SIGTERM to the launcher**: every worker is stopped; exit code 128 + signal. Also
  while it waits in the rendezvous (no workers yet): it exits at once, where the wait used to
  hold the signal until the rendezvous timeout (``tpu_dist.launch._rendezvous``).
* **A node that does not come**: while the rendezvous waits, a line after 5 s and then every
  30 s names the nodes it waits for, how many joined, and how long of the rendezvous timeout
  (``--rdzv-conf timeout=SECONDS``, 900 by default) has passed.
* **The launcher itself is killed (SIGKILL)**: the kernel kills its workers
  (``PR_SET_PDEATHSIG``), so nothing is left behind.
"""

from __future__ import annotations

# The programmatic pipeline behind the command, in order: parse_args -> discover -> resolve ->
# compute_worker_env -> preflight -> format_dry_run (or launch). Only discover and preflight look
# at the machine (env, sysfs, /proc, the metadata server); the other steps are pure.
from tpu_dist.launch._chips import SliceShape, parse_slice
from tpu_dist.launch._cli import main, parse_args
from tpu_dist.launch._config import Entrypoint, LaunchSpec, resolve
from tpu_dist.launch._discovery import Discovery, MetadataClient, discover
from tpu_dist.launch._env import HUGE_PAGES_TUNABLE, WorkerEnv, compute_worker_env
from tpu_dist.launch._preflight import Problem, preflight
from tpu_dist.launch._run import format_dry_run
from tpu_dist.launch._gloo_lines import quiet_gloo_lines
from tpu_dist.launch._worker import EXIT_CODE_VAR

__all__ = [
    "EXIT_CODE_VAR",
    "HUGE_PAGES_TUNABLE",
    "Discovery",
    "Entrypoint",
    "LaunchSpec",
    "MetadataClient",
    "Problem",
    "SliceShape",
    "WorkerEnv",
    "compute_worker_env",
    "discover",
    "format_dry_run",
    "main",
    "parse_args",
    "parse_slice",
    "preflight",
    "quiet_gloo_lines",
    "resolve",
]
