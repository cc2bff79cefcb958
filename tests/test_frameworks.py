"""Frameworks that pick the backend themselves, and change timeouts after start-up (issue 19).

* Opt-in default: with ``TPU_DIST_DEFAULT_FOR_CPU=1`` at ``import tpu_dist``, torch's own ways
  of choosing a backend for CPU tensors give tpu_dist's group; without it, gloo stays.
* No code change (issue 35): torch's device-backend autoload (the ``torch.backends`` entry
  point, ``_tpu_dist_autoload``) registers "tpu" inside ``import torch`` in a process that never
  imports tpu_dist, without importing tpu_dist or JAX; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` leaves
  it out; with ``TPU_DIST_DEFAULT_FOR_CPU=1`` a group created with no backend is tpu_dist's. The
  hook beside TorchTPU's registration, in either order, ends as ``import tpu_dist`` did before.
* ``tpu_dist.collectives.set_timeout`` moves the watchdog's deadline for later collectives, and
  so does torch's public ``dist.set_timeout`` where torch has it (2.14+; issue 49): a shortened
  timeout fires on "tpu" as on gloo beside it. torch 2.13's private ``_set_pg_timeout`` does
  not reach Python process groups (it warns and changes nothing); from 2.14 it is a deprecated
  alias of ``dist.set_timeout``.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.harness import World

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = {"TPU_DIST_HEARTBEAT_TIMEOUT": "4", "TPU_DIST_TIMEOUT_POLICY": "raise"}
TORCH_SET_TIMEOUT = hasattr(dist, "set_timeout")
"""torch 2.14 added ``torch.distributed.set_timeout(timeout, group)``; 2.13 has only the private
``distributed_c10d._set_pg_timeout``, which reaches gloo and NCCL alone."""


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": REPO, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env=full_env,
    )


def test_default_for_cpu_is_off_unless_asked() -> None:
    code = """
        import torch.distributed as dist
        import tpu_dist
        print(dist.Backend.default_device_backend_map["cpu"],
              dist.get_default_backend_for_device("cpu"))
    """
    off = _python(code, {"TPU_DIST_DEFAULT_FOR_CPU": "0"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["gloo", "gloo"]
    on = _python(code, {"TPU_DIST_DEFAULT_FOR_CPU": "1"})
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == ["tpu", "tpu"]
    assert "default_device_backend_map['cpu'] = 'tpu' (was 'gloo')" in on.stderr  # logged
    bad = _python(code, {"TPU_DIST_DEFAULT_FOR_CPU": "maybe"})
    assert bad.returncode != 0 and "TPU_DIST_DEFAULT_FOR_CPU='maybe'" in bad.stderr


def _framework_init(rank: int, world_size: int) -> dict:
    """What frameworks do: no backend named, or one read from torch's device -> backend map."""
    from tpu_dist.collectives import ProcessGroupTPU

    out = {}
    init = {"rank": rank, "world_size": world_size}
    dist.init_process_group(**init)  # no backend: torch picks one for the CPU
    t = torch.tensor([1.0 + rank])
    dist.all_reduce(t)
    out["none"] = (type(dist.group.WORLD).__name__, dist.get_backend(),
                   dist.get_backend_config(), t.item())
    # A subgroup inherits the default group's backend.
    sub = dist.new_group([0, 1])
    out["subgroup"] = isinstance(sub, ProcessGroupTPU)
    dist.destroy_process_group()
    backend = dist.get_default_backend_for_device("cpu")
    dist.init_process_group(backend=backend, **init)
    out["named"] = (type(dist.group.WORLD).__name__, dist.get_backend())
    dist.destroy_process_group()
    backend = f"cpu:{dist.Backend.default_device_backend_map['cpu']}"
    dist.init_process_group(backend=backend, **init)
    t = torch.tensor([2.0 * rank])
    dist.all_reduce(t)
    out["device_syntax"] = (type(dist.group.WORLD).__name__, dist.get_backend(), t.item())
    return out


def test_frameworks_choosing_the_backend_get_tpu() -> None:
    env = {"TPU_DIST_DEFAULT_FOR_CPU": "1", "TPU_DIST_PLATFORM": "cpu"}
    with World(2, backend="tpu", init=False, env=env, timeout=120) as world:
        results = world.run(_framework_init)
    for out in results:
        # torch records "undefined" as the backend of a group made without one, on gloo too.
        assert out["none"] == ("ProcessGroupTPU", "undefined", "cpu:tpu", 3.0), out
        assert out["subgroup"], out
        assert out["named"] == ("ProcessGroupTPU", "tpu"), out
        assert out["device_syntax"] == ("ProcessGroupTPU", "cpu:tpu", 2.0), out


def _timeouts(rank: int, world_size: int) -> dict:
    """Lengthen (3 s -> 30 s) and tolerate a 6 s late peer; shorten (30 s -> 2 s), see it fire."""
    from tpu_dist.collectives import set_timeout

    out = {}
    group = dist.group.WORLD
    t = torch.arange(4.0) + rank
    dist.all_reduce(t.clone())  # compiled and connected: later calls only wait for the peer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # torch 2.13's own helper cannot reach a Python process group: it warns, changes
        # nothing. From 2.14 it warns that it is deprecated and calls dist.set_timeout.
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=30), group)
    out["torch_warning"] = [str(w.message) for w in caught]
    out["after_torch_helper"] = group.timeout.total_seconds()
    set_timeout(datetime.timedelta(seconds=30))
    out["lengthened"] = group.timeout.total_seconds()
    if rank == 1:
        time.sleep(6)
    x = t.clone()
    dist.all_reduce(x)
    out["slow_peer_result"] = x.tolist()
    set_timeout(datetime.timedelta(seconds=2), group)
    if rank == 1:
        return out  # never joins: rank 0 must give up at 2 s, not wait for it
    try:
        dist.all_reduce(t.clone())
        out["late_peer"] = "no error"
    except dist.DistBackendError as err:
        out["late_peer"] = str(err)
    return out


def test_timeout_changed_after_start_is_honoured() -> None:
    with World(2, backend="tpu", env=FAST, timeout=90, failure_grace=20,
               init_kwargs={"timeout": datetime.timedelta(seconds=3)}) as world:
        r0, r1 = world.run(_timeouts)
    for out in (r0, r1):
        if TORCH_SET_TIMEOUT:  # 2.14+: a deprecated alias of dist.set_timeout, which reaches us
            assert len(out["torch_warning"]) == 1, out["torch_warning"]
            assert "_set_pg_timeout` is deprecated" in out["torch_warning"][0], out
            assert out["after_torch_helper"] == 30.0
        else:
            assert out["torch_warning"] == [
                "Set timeout is now only supported for either nccl or gloo."]
            assert out["after_torch_helper"] == 3.0
        assert out["lengthened"] == 30.0
        # 6 s late under a 3 s start-up timeout: tolerated because the deadline is now 30 s.
        assert out["slow_peer_result"] == [1.0, 3.0, 5.0, 7.0]
    # Rank 1 never joins; with the deadline shortened to 2 s rank 0 gives up at 2 s.
    assert "timed out after 2 s" in r0["late_peer"] and "did not arrive: [1]" in r0["late_peer"]


def _shortened_timeout(rank: int, world_size: int) -> dict:
    """torch's ``dist.set_timeout`` (tpu_dist's ``set_timeout`` where torch has none) shortens
    the group's 60 s timeout to 2 s; rank 1 never joins the next all_reduce."""
    from tpu_dist.collectives import set_timeout

    out = {}
    group = dist.group.WORLD
    if dist.get_backend(group) == "tpu":
        # What torch 2.14+ asks a group for, by device (batch_isend_irecv, get_backend_impl).
        out["own_backend"] = group._get_backend(torch.device("cpu")) is group
        with pytest.raises(ValueError, match="timeout must be positive"):
            group.set_timeout(datetime.timedelta(seconds=0))
    t = torch.arange(4.0) + rank
    dist.all_reduce(t)  # compiled and connected: the next call only waits for the peer
    out["first"] = t.tolist()
    (dist.set_timeout if TORCH_SET_TIMEOUT else set_timeout)(datetime.timedelta(seconds=2), group)
    if rank == 1:
        return out
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        out["error"] = None
    except RuntimeError as err:  # gloo: DistBackendError or RuntimeError; "tpu": DistBackendError
        out["error"] = str(err)
    out["seconds"] = time.monotonic() - start
    return out


@pytest.mark.parametrize("backend", ["tpu", "gloo"])
def test_torch_set_timeout_shortens_as_on_gloo(backend: str) -> None:
    with World(2, backend=backend, env=FAST, timeout=150, failure_grace=20,
               init_kwargs={"timeout": datetime.timedelta(seconds=60)}) as world:
        r0, r1 = world.run(_shortened_timeout)
    assert r0["first"] == r1["first"] == [1.0, 3.0, 5.0, 7.0]
    if backend == "tpu":
        assert r0["own_backend"] and r1["own_backend"]
    # The 2 s deadline fired, not the 60 s one the group was created with (loose upper bound:
    # the machine is loaded; the "tpu" watchdog looks once a heartbeat interval).
    assert r0["error"] is not None, r0
    assert 1.9 <= r0["seconds"] < 30, r0
    if backend == "tpu":
        assert "timed out after 2 s" in r0["error"] and "did not arrive: [1]" in r0["error"], r0


def test_set_timeout_rejects_bad_input() -> None:
    from tpu_dist.collectives import set_timeout

    with pytest.raises(TypeError, match="datetime.timedelta"):
        set_timeout(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        set_timeout(datetime.timedelta(seconds=0))


def test_launcher_flag_sets_the_variable_for_workers() -> None:
    from tpu_dist.launch import Discovery, compute_worker_env, parse_args, resolve

    def shared(argv: list[str]) -> dict[str, str]:
        spec = resolve(parse_args([*argv, "train.py"], {}), Discovery(on_tpu=False), {})
        return dict(compute_worker_env(spec, {}).shared)

    assert shared(["--nproc-per-node", "2", "--default-for-cpu"])["TPU_DIST_DEFAULT_FOR_CPU"] == "1"
    assert "TPU_DIST_DEFAULT_FOR_CPU" not in shared(["--nproc-per-node", "2"])


# -- torch's device-backend autoload (issue 35, item 5) -------------------------------------------

_ONE_RANK = """
    import sys
    import torch
    import torch.distributed as dist
    print("after import torch:", "tpu" in dist.Backend.backend_list, "jax" in sys.modules,
          "tpu_dist" in sys.modules, dist.Backend.default_device_backend_map["cpu"])
    if "tpu" in dist.Backend.backend_list:
        dist.init_process_group(BACKEND, init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        print("group:", type(dist.group.WORLD).__name__, dist.get_backend_config(), t.item())
        dist.destroy_process_group()
"""


def _autoload_installed() -> None:
    """Skip unless the installed tpu-dist has the entry point pyproject.toml declares (an
    editable install made before it was added lacks it: ``pip install -e .`` again); fail if
    pyproject.toml does not declare it."""
    import importlib.metadata
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["torch.backends"]
    assert declared == {"tpu_dist": "_tpu_dist_autoload:register"}, declared
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch.backends")}
    if installed.get("tpu_dist") != declared["tpu_dist"]:
        pytest.skip("the installed tpu-dist predates its torch.backends entry point: "
                    "pip install -e . to register it")


def _fresh(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A process that never imports tpu_dist itself: the repository is on the path only so that
    the entry point's module and tpu_dist resolve to this tree."""
    from tests.launch_worker import free_port

    port = free_port()
    return _python(code.replace("PORT", str(port)), {"TPU_DIST_PLATFORM": "cpu", **env})


def test_import_torch_registers_tpu_without_importing_tpu_dist_or_jax() -> None:
    _autoload_installed()
    for var in ("TPU_DIST_DEFAULT_FOR_CPU", "TPU_DIST_BACKEND_NAME", "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        assert var not in os.environ, f"{var} is set in the test's environment"
    on = _fresh(_ONE_RANK.replace("BACKEND", '"tpu"'), {})
    assert on.returncode == 0, on.stderr
    lines = on.stdout.splitlines()
    # Registered inside `import torch`; nothing of tpu_dist or JAX imported, gloo still the default.
    assert lines[0] == "after import torch: True False False gloo", on.stdout
    # The first group imports tpu_dist and is its process group; the sum is the one rank's value.
    assert lines[1] == "group: ProcessGroupTPU cpu:tpu 3.0", on.stdout
    off = _fresh(_ONE_RANK.replace("BACKEND", '"tpu"'), {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines() == ["after import torch: False False False gloo"], off.stdout


def test_default_for_cpu_reaches_a_framework_that_never_imports_tpu_dist() -> None:
    """``TPU_DIST_DEFAULT_FOR_CPU=1 torchrun -m trainer``: the trainer's ``init_process_group()``
    (no backend) gets tpu_dist, with nothing imported by the trainer but torch."""
    _autoload_installed()
    proc = _fresh(_ONE_RANK.replace("BACKEND", "None"), {"TPU_DIST_DEFAULT_FOR_CPU": "1"})
    assert proc.returncode == 0, proc.stderr
    # tpu_dist is imported by the hook (it applies the variable), JAX is not.
    assert proc.stdout.splitlines() == [
        "after import torch: True False True tpu", "group: ProcessGroupTPU cpu:tpu 3.0"], proc.stdout
    assert "default_device_backend_map['cpu'] = 'tpu' (was 'gloo')" in proc.stderr  # logged


_TORCHTPU = """
    import warnings
    import torch.distributed as dist
    def torchtpu_creator(store, rank, size, timeout):
        raise AssertionError("not called")
    torchtpu_creator.__module__ = "torch_tpu._internal.distributed.torchcomm_tpu"
    def torchtpu_registers():  # what TorchTPU's own torch.backends hook does (tests/torchtpu_sim.py)
        for name in ("tpu", "tpu_dist"):
            dist.Backend.register_backend(name, torchtpu_creator, devices=["tpu"])
"""


@pytest.mark.parametrize("torchtpu_first", [True, False])
def test_hook_beside_torchtpu_in_either_order(torchtpu_first: bool) -> None:
    """torch runs the torch.backends hooks in an order it does not define. Either way the hook
    warns about nothing and imports nothing of JAX, TorchTPU keeps "tpu" and "tpu_dist", and
    ``import tpu_dist`` then takes "tpu_jax" and warns once, as it did with TorchTPU loaded first
    and no hook. (Run by hand with torch's autoload off, so that only the order differs.)"""
    order = ("torchtpu_registers()", "_tpu_dist_autoload.register()")
    proc = _python(_TORCHTPU + f"""
    import sys
    import _tpu_dist_autoload
    with warnings.catch_warnings(record=True) as at_import_torch:
        warnings.simplefilter("always")
        {order[0] if torchtpu_first else order[1]}
        {order[1] if torchtpu_first else order[0]}
    print("warnings:", len(at_import_torch), "jax:", "jax" in sys.modules, "tpu_dist:", "tpu_dist" in sys.modules)
    print("tpu:", dist.Backend._plugins["TPU"].creator_fn is torchtpu_creator,
          "tpu_dist:", dist.Backend._plugins["TPU_DIST"].creator_fn is torchtpu_creator)
    with warnings.catch_warnings(record=True) as at_import_tpu_dist:
        warnings.simplefilter("always")
        import tpu_dist
        from tpu_dist.collectives import _registry
    print("backend:", tpu_dist.BACKEND,
          dist.Backend._plugins["TPU_JAX"].creator_fn is _registry._create_process_group)
    said = [str(w.message) for w in at_import_tpu_dist]
    print("warned:", len(said), all("'tpu' is already registered by torch_tpu" in m for m in said))
    """, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "warnings: 0 jax: False tpu_dist: False",
        "tpu: True tpu_dist: True",
        "backend: tpu_jax True",
        "warned: 1 True",
    ], proc.stdout


def test_hook_names_are_tpu_dist_settings() -> None:
    """The hook cannot import tpu_dist's settings (that would run tpu_dist/__init__.py inside
    ``import torch``), so it spells the names itself: they must be the same."""
    import _tpu_dist_autoload as hook

    from tpu_dist import _settings
    from tpu_dist.collectives import FALLBACK_BACKEND_NAME

    assert hook.DEFAULT_FOR_CPU_ENV == _settings.DEFAULT_FOR_CPU.env
    assert hook.BACKEND_NAME_ENV == _settings.BACKEND_NAME.env
    assert hook.DEFAULT_NAME == _settings.BACKEND_NAME.default
    assert hook.FALLBACK_NAME == FALLBACK_BACKEND_NAME
