"""Workers forked from tpu-launch's zygote (``tpu_dist.launch._zygote``) are the workers a fresh
interpreter would have been: the same environment, arguments, paths, streams, session, parent
and signal dispositions, garbage collector, the same exit codes and signals as seen by the
launcher; only torch and JAX are imported already (and their objects frozen, ``gc.freeze``).

Each job runs three times: through ``tpu-launch``'s entry (the zygote forked from the launcher
after its torch import, ``_tpu_dist_launch``), through ``python -m tpu_dist.launch`` (the zygote a
new interpreter) and with ``TPU_DIST_LAUNCH_PRELOAD=0`` (every worker a fresh ``python -u
_worker.py``, as before), and they are compared. Timing is in
``benchmarks/startup.py --felt``, not here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.launch_worker import REPO, clean_env, run_launcher
from tpu_dist import _settings
from tpu_dist.launch import _zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

_STATE = textwrap.dedent(
    """
    import faulthandler, gc, json, os, random, signal, sys
    import numpy
    main = sys.modules["__main__"]

    def torch_draw():  # as the script's first use of torch would (imported only here)
        import torch
        return float(torch.rand(1))

    state = {
        "argv": sys.argv,
        "path0": sys.path[0],
        "path_rest": [p for p in sys.path[1:] if p != os.devnull],
        "cwd": os.getcwd(),
        "name": __name__,
        "main_file": getattr(main, "__file__", None),
        "env": dict(os.environ),
        "parent_is_launcher": os.getppid() == int(os.environ["TPU_DIST_LAUNCH_PID"]),
        "own_session": os.getsid(0) == os.getpid() == os.getpgid(0),
        "stdin": os.fstat(0).st_ino,
        "streams": [type(sys.stdout.buffer).__name__, sys.stdout.write_through,
                    type(sys.stderr.buffer).__name__, sys.stderr.write_through],
        "signals": {s: str(signal.getsignal(getattr(signal, s)))
                    for s in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD", "SIGHUP")},
        "umask": os.umask(0o22),
        "faulthandler": faulthandler.is_enabled(),
        "gc": [gc.isenabled(), gc.get_threshold()],  # on, as fresh (the preload only frozen)
        "tpu_dist_modules": sorted(m for m in sys.modules if m.startswith("tpu_dist")),
        "torch_preloaded": "torch" in sys.modules,
        "started_as": sys.orig_argv[1:3],  # the interpreter the zygote (or worker) began as
        "dtensor_preloaded": "torch.distributed.tensor" in sys.modules,  # not for this script
        "draws": [random.random(), float(numpy.random.random()), torch_draw()],
    }
    with open(os.path.join(sys.argv[1], os.environ["LOCAL_RANK"] + ".json"), "w") as f:
        json.dump(state, f)
    print("OUT rank", os.environ["RANK"])
    print("ERR rank", os.environ["RANK"], file=sys.stderr)
    """
)

_RUN_SPECIFIC = (
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TPU_DIST_LAUNCH_PID",
    "TPU_DIST_LAUNCH_EXIT_TIMES",
    "TPU_DIST_COORDINATION_SERVICE",
    "TPU_DIST_LAUNCH_PRELOAD",
)
"""Variables whose values differ between any two launches (ports, run ids, temporary paths)."""


def _job(tmp_path: Path, name: str, preload: bool, module: str = "_tpu_dist_launch",
         extra_env: dict[str, str] | None = None) -> dict[int, dict]:
    script, out = tmp_path / "state.py", tmp_path / name
    script.write_text(_STATE)
    out.mkdir()
    env = {} if preload else {_settings.LAUNCH_PRELOAD.env: "0"}
    env.update(extra_env or {})
    code, stdout, stderr = run_launcher(
        ["--nproc-per-node", "2", str(script), str(out)], env=env, timeout=240, module=module
    )
    assert code == 0, stderr
    for rank in (0, 1):
        assert f"[rank{rank}]:OUT rank {rank}" in stdout, stdout
        assert f"[rank{rank}]:ERR rank {rank}" in stderr, stderr
    states = {r: json.loads((out / f"{r}.json").read_text()) for r in (0, 1)}
    for state in states.values():
        for var in _RUN_SPECIFIC:
            state["env"].pop(var, None)
        assert state["argv"][1] == str(out)
        state["argv"][1] = "OUT"
    return states


_ZYGOTE_FILE = os.path.join(REPO, "tpu_dist", "launch", "_zygote.py")
_WORKER_FILE = os.path.join(REPO, "tpu_dist", "launch", "_worker.py")


def test_forked_workers_see_what_fresh_workers_see(tmp_path: Path) -> None:
    """Three ways to start the same workers: ``tpu-launch`` forks them from the zygote it forked
    itself after its torch import (``_tpu_dist_launch``); ``python -m tpu_dist.launch``, which
    imports tpu_dist before any launcher code runs, from a zygote started as a new interpreter;
    with ``TPU_DIST_LAUNCH_PRELOAD=0`` each is a new interpreter. The launchers' own streams are
    buffered (no ``PYTHONUNBUFFERED``): a worker's are as ``python -u`` makes them all the same."""
    buffered = {"PYTHONUNBUFFERED": ""}
    jobs = {
        "early": _job(tmp_path, "early", preload=True, extra_env=buffered),
        "zygote": _job(tmp_path, "zygote", preload=True, module="tpu_dist.launch",
                       extra_env=buffered),
        "fresh": _job(tmp_path, "fresh", preload=False, extra_env=buffered),
    }
    began = {"early": ["-m", "_tpu_dist_launch"], "zygote": ["-u", _ZYGOTE_FILE],
             "fresh": ["-u", _WORKER_FILE]}
    for name, job in jobs.items():
        first, second = job[0].pop("draws"), job[1].pop("draws")  # each rank draws its own
        assert all(a != b for a, b in zip(first, second)), (first, second)
        for rank in (0, 1):
            assert job[rank].pop("started_as") == began[name], name
            assert job[rank].pop("torch_preloaded") is (name != "fresh"), name
    fresh = jobs.pop("fresh")
    for name, forked in jobs.items():
        for rank in (0, 1):
            assert forked[rank]["env"] == fresh[rank]["env"], name
            assert forked[rank] == fresh[rank], name
            assert forked[rank]["parent_is_launcher"] and forked[rank]["own_session"]
            assert forked[rank]["tpu_dist_modules"] == []  # nothing of tpu_dist before the script
            assert forked[rank]["dtensor_preloaded"] is False  # it imports no DTensor API


_PROCESS = textwrap.dedent(
    """
    import json, os, sys
    import torch
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own descriptor
    state = {
        "fds": sorted(fd for fd, target in fds.items() if not target.startswith("pipe:")),
        "fd0": fds.get(0),
        "stdin": sys.stdin is not None,
        "optimize": sys.flags.optimize,
        "seed": torch.initial_seed(),
        "draw": float(torch.rand(1)),
    }
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    with open(os.path.join(sys.argv[1], f"{attempt}-{rank}.json"), "w") as f:
        json.dump(state, f)
    if attempt == "0" and rank == "0":  # fail, once the other rank has written its facts
        import time
        other = os.path.join(sys.argv[1], "0-1.json")
        deadline = time.monotonic() + 120
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(1)
    """
)


def _process_facts(tmp_path: Path, name: str, options: list[str], preload: bool) -> dict:
    """A 2-rank job run as a shell would start it with a descriptor of its own open (``exec
    7>file``) and stdin closed (``<&-``): rank 0 fails once, so every fact is read by each rank of
    two attempts."""
    script, out = tmp_path / "process.py", tmp_path / name
    script.write_text(_PROCESS)
    out.mkdir()
    env = clean_env({} if preload else {_settings.LAUNCH_PRELOAD.env: "0"})
    launcher = [sys.executable, *options, "-m", "_tpu_dist_launch", "--nproc-per-node", "2",
                "--max-restarts", "1", str(script), str(out)]
    proc = subprocess.run(
        ["sh", "-c", 'exec 7>"$0"; exec "$@" <&-', str(tmp_path / f"{name}.fd7"), *launcher],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    return {f.stem: json.loads(f.read_text()) for f in out.iterdir()}


def test_forked_workers_are_fresh_processes_of_their_own(tmp_path: Path) -> None:
    """Issue 48, items 2 and 7: a worker forked from a zygote draws its own random numbers (each
    rank, each restart), and inherits neither the launcher's other descriptors, nor its
    interpreter options, nor a closed stdin's stand-in: the same process a fresh worker is."""
    jobs = {
        "early": _process_facts(tmp_path, "early", [], preload=True),
        "zygote": _process_facts(tmp_path, "zygote", ["-O"], preload=True),  # no early fork
        "fresh": _process_facts(tmp_path, "fresh", ["-O"], preload=False),
    }
    seeds = [f["seed"] for job in jobs.values() for f in job.values()]
    draws = [f["draw"] for job in jobs.values() for f in job.values()]
    assert len(seeds) == 12 and len(set(seeds)) == 12 and len(set(draws)) == 12, jobs
    for name, job in jobs.items():
        assert sorted(job) == ["0-0", "0-1", "1-0", "1-1"], (name, job)  # both attempts ran
        for facts in job.values():
            facts.pop("seed"), facts.pop("draw")
    for name, job in jobs.items():
        for facts in job.values():
            assert facts == jobs["fresh"]["0-0"], (name, facts, jobs["fresh"]["0-0"])
    assert jobs["fresh"]["0-0"] == {
        "fds": [0, 1, 2], "fd0": "/dev/null", "stdin": True, "optimize": 0
    }


_DTENSOR_SCRIPT = """
import sys
preloaded = [m for m in ("torch.distributed.tensor", "torch._dynamo") if m in sys.modules]
print("PRELOADED", ",".join(preloaded))
if False:
    from torch.distributed.fsdp import fully_shard  # read by the launcher, never run
"""


def test_a_script_that_imports_dtensor_finds_it_imported(tmp_path: Path) -> None:
    """The zygote also imports DTensor and dynamo for a script whose source imports a DTensor
    API (``_zygote.script_preload``): its forked workers start with them imported."""
    script = tmp_path / "uses_fsdp.py"
    script.write_text(_DTENSOR_SCRIPT)
    code, stdout, stderr = run_launcher(["--nproc-per-node", "2", str(script)], timeout=240)
    assert code == 0, stderr
    for rank in (0, 1):
        assert f"[rank{rank}]:PRELOADED torch.distributed.tensor,torch._dynamo" in stdout, stdout


@pytest.mark.parametrize("source, expected", [
    ("import torch.distributed.tensor", True),
    ("from torch.distributed.fsdp import fully_shard", True),
    ("from torch.distributed import fsdp", True),
    ("import torch.distributed.checkpoint as dcp", True),
    ("def f():\n    from tpu_dist.dtensor_ext import to_jax", True),
    ("from torch.distributed.tensor.parallel import parallelize_module", True),
    ("import torch.distributed as dist\nimport torch.nn", False),
    ("from torch.distributed import all_reduce", False),
    ("import torch.distributed.tensorboard_like", False),  # a prefix of a name is not its module
    ("# from torch.distributed.fsdp import fully_shard\nx = 'torch.distributed.tensor'", False),
    ("from . import fsdp", False),  # relative: the script's own package
    ("this is not Python (", False),
])
def test_script_preload_reads_the_scripts_imports(
    tmp_path: Path, source: str, expected: bool
) -> None:
    script = tmp_path / "job.py"
    script.write_text(source + "\n")
    assert _zygote.script_preload(str(script)) == (_zygote.DTENSOR_PRELOAD if expected else ())
    assert _zygote.script_preload(str(tmp_path / "missing.py")) == ()


def _zygote_env() -> dict[str, str]:
    # numpy's BLAS pool: one thread, none started; the launcher's pid, as tpu-launch exports it
    return clean_env({"OMP_NUM_THREADS": "1", "TPU_DIST_LAUNCH_PID": str(os.getpid())})


def test_forked_process_reports_exit_codes_and_signals_as_popen_does(tmp_path: Path) -> None:
    """The launcher waits for, and signals, a forked worker as a child it started itself."""
    zygote = _zygote.Zygote(sys.executable, _zygote_env())
    worker = os.path.join(REPO, "tpu_dist", "launch", "_worker.py")
    script = tmp_path / "body.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "what = sys.argv[1]\n"
        "if what == 'exit': sys.exit(7)\n"
        "if what == 'raise': raise ValueError('deliberate')\n"
        "if what == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    try:
        def start(what: str) -> _zygote.ForkedProcess:
            env = dict(_zygote_env(), LOCAL_RANK="0")
            args = [sys.executable, "-u", worker, "python", str(script), what]
            with open(tmp_path / f"{what}.err", "w") as err:
                proc = zygote.spawn(args, env, None, err)
            assert proc is not None, zygote.why_not
            return proc

        assert start("exit").wait(60) == 7
        assert start("raise").wait(60) == 1
        assert "ValueError: deliberate" in (tmp_path / "raise.err").read_text()
        assert start("kill").wait(60) == -signal.SIGKILL
        sleeper = start("sleep")
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(0.3)
        assert sleeper.poll() is None
        os.killpg(sleeper.pid, signal.SIGTERM)  # how elastic stops a worker
        assert sleeper.wait(60) == -signal.SIGTERM
        # Not a worker command (numactl in front, another interpreter): not forked.
        assert zygote.spawn(["numactl", "-N", "0", sys.executable], {}, None, None) is None
        # A variable the preloaded modules could have read at import differs: not forked.
        env = dict(_zygote_env(), LOCAL_RANK="0", XLA_FLAGS="--xla_dump_to=/tmp/x")
        args = [sys.executable, "-u", worker, "python", str(script), "exit"]
        assert zygote.spawn(args, env, None, None) is None
        assert zygote.why_not == "the worker's environment differs from the zygote's in XLA_FLAGS"
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0  # it ends when the launcher closes the socket


def test_a_zygote_still_importing_is_stopped_at_once() -> None:
    """A launcher stopped before its first worker (Ctrl-C in the rendezvous) does not wait for
    its zygote's imports."""
    zygote = _zygote.Zygote(sys.executable, _zygote_env())
    start = time.monotonic()
    zygote.close()
    assert zygote.proc.returncode is not None and time.monotonic() - start < 3.0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="numpy's BLAS starts no thread on one core")
def test_a_zygote_with_threads_is_not_used() -> None:
    """numpy's BLAS starts its thread pool at import unless OMP_NUM_THREADS=1: forking then is
    not safe, and the zygote says so before it imports torch and JAX."""
    env = {k: v for k, v in _zygote_env().items() if k not in ("OMP_NUM_THREADS",
                                                                "OPENBLAS_NUM_THREADS")}
    zygote = _zygote.Zygote(sys.executable, env)
    worker = os.path.join(REPO, "tpu_dist", "launch", "_worker.py")
    try:
        args = [sys.executable, "-u", worker, "python", "x.py"]
        assert zygote.spawn(args, env, None, None) is None
        assert zygote.why_not is not None and "threads after importing numpy" in zygote.why_not
    finally:
        zygote.close()


_ENV_SCRIPT = """
import os, sys
print("ENV", {k: os.environ.get(k) for k in sys.argv[1:]})
"""


def test_the_launchers_own_variables_do_not_reach_its_workers(tmp_path: Path) -> None:
    """``tpu-launch`` re-executes itself with ``OMP_NUM_THREADS=1`` and the huge-page malloc
    tunable where they are unset, to import torch as its workers will; its workers still get
    the environment the launcher was started with plus what tpu-launch sets for them. One
    worker per host gets no ``OMP_NUM_THREADS`` (as under torchrun), a user's
    ``GLIBC_TUNABLES`` is kept, and the re-exec's marker is gone. (Such a worker is not forked
    from the launcher's zygote: torch was imported there with one OpenMP thread.)"""
    script = tmp_path / "env.py"
    script.write_text(_ENV_SCRIPT)
    names = ["OMP_NUM_THREADS", "GLIBC_TUNABLES", "_TPU_DIST_LAUNCH_ADDED"]
    code, stdout, stderr = run_launcher(
        ["--nproc-per-node", "1", str(script), *names],
        env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, timeout=240,
    )
    assert code == 0, stderr
    expected = {"OMP_NUM_THREADS": None, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2",
                "_TPU_DIST_LAUNCH_ADDED": None}
    assert f"[rank0]:ENV {expected}" in stdout, stdout


def test_a_launcher_that_starts_no_worker_ends_its_early_zygote_at_once() -> None:
    """``--dry-run`` (and any launcher that stops before its workers) ends the zygote its entry
    forked: it holds the launcher's stdout, so a zygote left behind would keep a reader of
    that pipe waiting."""
    start = time.monotonic()
    code, stdout, stderr = run_launcher(
        ["--dry-run", "--nproc-per-node", "2", "-m", "json.tool"], timeout=60
    )
    assert code == 0, stderr
    assert time.monotonic() - start < 30.0


def test_an_early_zygote_is_used_only_where_torch_saw_the_workers_environment() -> None:
    """The variables the launcher sets for its workers after the fork (platform, topology,
    chips, its own bookkeeping) may differ from the environment torch was imported in; any
    other variable, and the two tpu_dist's ``torch.backends`` hook reads inside ``import
    torch``, may not."""
    import _tpu_dist_launch
    from _tpu_dist_launch import EarlyZygote
    from tpu_dist.launch import HUGE_PAGES_TUNABLE

    # The entry's copies of tpu_dist's names and values (it cannot import tpu_dist).
    assert _tpu_dist_launch.PRELOAD_ENV == _settings.LAUNCH_PRELOAD.env
    for off in _tpu_dist_launch.PRELOAD_OFF:
        assert _settings.LAUNCH_PRELOAD.get({_settings.LAUNCH_PRELOAD.env: off}) is False, off
    assert _tpu_dist_launch.EARLY_VARS == {"OMP_NUM_THREADS": "1",
                                           "GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    early = EarlyZygote(pid=0, sock=None, env=base)  # type: ignore[arg-type]
    usable = _zygote.early_usable
    later = {"TPU_DIST_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--x",
             "TPU_VISIBLE_CHIPS": "0", "RANK": "3", "TPU_DIST_LAUNCH_PID": "1"}
    assert usable(early, sys.executable, {**base, **later}) is None
    assert usable(early, "/usr/bin/python3", base) == (
        f"the workers run /usr/bin/python3, not {sys.executable}")
    for name, env in [
        ("OMP_NUM_THREADS", {"PATH": "/bin"}),
        ("GLIBC_TUNABLES", {**base, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}),
        ("TPU_DIST_DEFAULT_FOR_CPU", {**base, "TPU_DIST_DEFAULT_FOR_CPU": "1"}),
        ("TPU_DIST_BACKEND_NAME", {**base, "TPU_DIST_BACKEND_NAME": "tpu_dist"}),
    ]:
        assert usable(early, sys.executable, env) == (
            f"torch was imported with {name} other than the workers have")
