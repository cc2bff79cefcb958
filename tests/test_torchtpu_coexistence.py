"""tpu_dist beside TorchTPU in one process (issue 14): registration and one combined group.

TorchTPU cannot load here (no TPU), so its registration is simulated in the workers by
:mod:`tests.torchtpu_sim`, done as TorchTPU does it (see that module) before tpu_dist is imported.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist

from tests.harness import World

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHONPATH": REPO},
    )


def test_tpu_taken_registers_fallback_and_warns_once() -> None:
    proc = _python("""
        import warnings
        import tests.torchtpu_sim as sim
        import torch.distributed as dist
        import tpu_dist, tpu_dist.collectives as tc
        assert tpu_dist.BACKEND == tc.registered_name() == tc.FALLBACK_BACKEND_NAME == "tpu_jax"
        assert tc.register_backend() == "tpu_jax"                  # idempotent, no new warning
        assert dist.Backend._plugins["TPU"].creator_fn is sim.create_process_group  # untouched
        assert dist.Backend._plugins["TPU_DIST"].creator_fn is sim.create_process_group
        assert dist.Backend.backend_capability["tpu_jax"] == ["cpu"]
        print(len(sim.WARNINGS)); print(sim.WARNINGS[0])
    """)
    assert proc.returncode == 0, proc.stderr
    count, message = proc.stdout.strip().split("\n", 1)
    assert count == "1", proc.stdout
    assert "'tpu' is already registered by tests.torchtpu_sim" in message
    assert "registered as 'tpu_jax'" in message and "'cpu:tpu_jax,tpu:tpu'" in message


def test_explicit_name_taken_falls_back_too() -> None:
    proc = _python("""
        import os
        os.environ["TPU_DIST_BACKEND_NAME"] = "tpu_dist"   # what the old warning recommended
        import tests.torchtpu_sim as sim
        import tpu_dist
        print(tpu_dist.BACKEND, "'tpu_dist' is already registered" in sim.WARNINGS[0])
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tpu_jax", "True"]


def test_registration_replaced_later_is_a_clear_error() -> None:
    proc = _python("""
        import torch.distributed as dist
        import tpu_dist, tpu_dist.collectives as tc
        assert tc.registered_name() == "tpu"
        def later(store, rank, size, timeout):   # e.g. torch_tpu imported after tpu_dist
            raise AssertionError("not tpu_dist's")
        later.__module__ = "torch_tpu._internal.distributed.torchcomm_tpu"
        dist.Backend.register_backend("tpu", later, devices=["tpu"])
        try:
            tc.registered_name()
        except RuntimeError as err:
            print(err)
        try:
            tc.make_default_for_cpu()
        except RuntimeError as err:
            print("make_default_for_cpu refused")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "'tpu' was registered by torch_tpu._internal.distributed.torchcomm_tpu" in proc.stdout
    assert "TPU_DIST_BACKEND_NAME=tpu_jax" in proc.stdout
    assert "make_default_for_cpu refused" in proc.stdout


def _combined_group(rank: int, world_size: int) -> dict:
    import tests.torchtpu_sim as sim
    from tpu_dist.collectives import ProcessGroupTPU, compile_count

    out: dict = {}
    # TorchTPU for "tpu" tensors, tpu_dist for CPU tensors, in one group.
    dist.init_process_group("cpu:tpu_jax,tpu:tpu", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    out["group"] = (isinstance(group, ProcessGroupTPU), dist.get_backend_config())
    before = compile_count()
    t = torch.tensor([1.0, 2.0]) * (rank + 1)
    dist.all_reduce(t)
    out["cpu_all_reduce"] = (t.tolist(), compile_count() - before)
    out["torchtpu_created"] = list(sim.CREATED)  # not before a "tpu" tensor needs it
    dist.destroy_process_group()
    # A device whose tensors exist on this machine stands in for "tpu": its collectives go to
    # the backend the config names for it, created on first use and registered on the group.
    importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers "fake"

    dist.init_process_group("cpu:tpu_jax,meta:fake", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    try:
        group._get_backend(torch.device("meta"))
        out["meta_before"] = "present"
    except RuntimeError:
        out["meta_before"] = "absent"
    m = torch.ones(3, device="meta")
    dist.all_reduce(m)
    out["meta_backend"] = type(group._get_backend(torch.device("meta"))).__name__
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["cpu_after"] = t.item()
    return out


def test_one_group_with_torchtpu_for_tpu_and_tpu_dist_for_cpu() -> None:
    with World(2, backend="tpu_jax", backend_module="tests.torchtpu_sim", init=False,
               env={"TPU_DIST_PLATFORM": "cpu"}, timeout=120) as world:
        results = world.run(_combined_group)
    for out in results:
        assert out["group"] == (True, "cpu:tpu_jax,tpu:tpu"), out
        assert out["cpu_all_reduce"] == ([3.0, 6.0], 1), out  # ran as a tpu_dist program
        assert out["torchtpu_created"] == [], out
        assert out["meta_before"] == "absent" and out["meta_backend"] == "FakeProcessGroup", out
        assert out["cpu_after"] == 1.0, out
