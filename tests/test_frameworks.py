"""Frameworks that pick the backend themselves, and change timeouts after start-up (issue 19).

* Opt-in default: with ``TPU_DIST_DEFAULT_FOR_CPU=1`` at ``import tpu_dist``, torch's own ways
  of choosing a backend for CPU tensors give tpu_dist's group; without it, gloo stays.
* ``tpu_dist.collectives.set_timeout`` moves the watchdog's deadline for later collectives;
  torch's ``_set_pg_timeout`` does not reach Python process groups (it warns and changes
  nothing), which the first test shows against torch itself.
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


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": REPO, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, env=full_env,
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
        # torch's own helper cannot reach a Python process group: it warns, changes nothing.
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
        time.sleep(4)  # never joins: rank 0 must give up at 2 s, not wait for it
        return out
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
        assert out["torch_warning"] == ["Set timeout is now only supported for either nccl or gloo."]
        assert out["after_torch_helper"] == 3.0
        assert out["lengthened"] == 30.0
        # 6 s late under a 3 s start-up timeout: tolerated because the deadline is now 30 s.
        assert out["slow_peer_result"] == [1.0, 3.0, 5.0, 7.0]
    # Rank 1 never joins; with the deadline shortened to 2 s rank 0 gives up at 2 s.
    assert "timed out after 2 s" in r0["late_peer"] and "did not arrive: [1]" in r0["late_peer"]


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
