"""Registration, platform selection, and destroy/re-init of the default group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from tests.harness import World

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, env=full_env,
    )


def test_import_registers_tpu_once() -> None:
    proc = _python("""
        import gc
        import torch.distributed as dist
        import tpu_dist, tpu_dist.collectives as tc
        assert tc.register_backend() == "tpu" == tpu_dist.BACKEND   # idempotent
        assert "tpu" in dist.Backend.backend_list
        assert dist.Backend._plugins["TPU"].extended_api
        # torch came first: tpu_dist's import leaves the collector as it found it
        assert gc.isenabled() and gc.get_freeze_count() == 0, gc.get_freeze_count()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_existing_tpu_registration_is_not_replaced() -> None:
    proc = _python("""
        import warnings
        import torch.distributed as dist
        def other_creator(*args):
            raise AssertionError("not ours")
        dist.Backend.register_backend("tpu", other_creator, devices=["cpu"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import tpu_dist
        assert tpu_dist.BACKEND == "tpu_jax"   # the documented fallback name
        assert dist.Backend._plugins["TPU"].creator_fn is other_creator
        print([str(w.message) for w in caught if "tpu_dist" in str(w.message)][0])
    """)
    assert proc.returncode == 0, proc.stderr
    assert "already registered" in proc.stdout and "registered as 'tpu_jax'" in proc.stdout


def test_backend_name_from_env() -> None:
    """Also: ``import tpu_dist`` as the import that brings torch in freezes what it imported
    (``gc.freeze``: ~170,000 objects no later collection scans) and turns the collector back
    on; with torch imported first it freezes nothing (test_import_registers_tpu_once)."""
    proc = _python("""
        import gc
        import tpu_dist
        import torch.distributed as dist
        print(tpu_dist.BACKEND, "tpu_dist" in dist.Backend.backend_list, gc.isenabled(),
              gc.get_freeze_count() > 100_000, gc.get_count()[0] < 10_000)
    """, env={"TPU_DIST_BACKEND_NAME": "tpu_dist"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tpu_dist", "True", "True", "True", "True"]


def _init_with_bad_platform(rank: int, world_size: int) -> str:
    try:
        dist.init_process_group("tpu", rank=rank, world_size=world_size)
    except ValueError as err:
        return str(err)
    return "no error"


def test_bad_platform_env_is_a_clear_error() -> None:
    with World(1, backend="tpu", init=False, env={"TPU_DIST_PLATFORM": "quantum"}) as world:
        (message,) = world.run(_init_with_bad_platform)
    assert "TPU_DIST_PLATFORM='quantum'" in message and "cpu" in message


def _destroy_and_reinit(rank: int, world_size: int, rendezvous: str) -> tuple[float, str]:
    dist.destroy_process_group()
    dist.init_process_group("tpu", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    # A world of another size cannot reuse this process's JAX runtime: a clear error.
    try:
        dist.init_process_group("tpu", init_method=f"file://{rendezvous}.solo{rank}", rank=0, world_size=1)
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    if dist.is_initialized():
        dist.destroy_process_group()
    # Leave a working default group behind for the harness's own teardown.
    dist.init_process_group("tpu", init_method=f"file://{rendezvous}.again", rank=rank, world_size=world_size)
    return t.item(), message


def test_destroy_then_init_again(tmp_path: pytest.TempPathFactory) -> None:
    with World(2, backend="tpu") as world:
        results = world.run(_destroy_and_reinit, str(tmp_path / "rdv"))
    for total, message in results:
        assert total == 1.0
        assert "world_size=2" in message and "world_size=1" in message and "new process" in message


_INIT_REDUCE_EXIT = """
    import torch, torch.distributed as dist, tpu_dist
    dist.init_process_group("tpu")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()
"""


def test_exit_is_clean_while_the_heartbeat_thread_is_busy() -> None:
    # Issue 16 item 9 ("terminate called without an active exception" at exit): a daemon
    # thread inside a C++ call (the heartbeat's store request) when the interpreter finalizes is
    # unwound by force through code that may not be unwound, and the process aborts. A short
    # heartbeat timeout keeps the heartbeat thread in store calls most of the time (on ebba644,
    # 1 of 8 processes aborted so). Four two-rank jobs, run at once (each mostly waits).
    from tests.launch_worker import free_port

    jobs = []
    for _ in range(4):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
               "TPU_DIST_HEARTBEAT_TIMEOUT": "0.4", "TPU_DIST_PLATFORM": "cpu"}
        jobs.append([
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(_INIT_REDUCE_EXIT)],
                env={**os.environ, "PYTHONPATH": REPO, **env, "RANK": str(rank)},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for rank in range(2)
        ])
    for job in jobs:
        for rank, proc in enumerate(job):
            _, err = proc.communicate(timeout=120)
            assert "terminate called" not in err and "FATAL" not in err, err
            assert proc.returncode == 0, (rank, err)


def _listening_addresses(rank: int, world_size: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on (Linux /proc)."""
    import socket as socket_module

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/self/net/tcp", socket_module.AF_INET),
                          ("/proc/self/net/tcp6", socket_module.AF_INET6)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((socket_module.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def _master_port(rank: int, world_size: int) -> str:
    return os.environ["MASTER_PORT"]


def test_coordinator_listens_on_loopback_only_when_told_to() -> None:
    # The harness sets MASTER_ADDR=127.0.0.1. Rank 0 listens with the c10d store (torch's,
    # every interface, as on gloo), JAX's coordination service and XLA's gloo pairs: all but
    # the store must be on loopback (issue 15: JAX's default is every interface).
    with World(2, backend="tpu", timeout=90) as world:
        listening = world.run(_listening_addresses)[0]
        store_port = int(world.run(_master_port)[0])
    others = [(a, p) for a, p in listening if p != store_port]
    assert others, listening
    loopback = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
    assert all(address in loopback for address, _ in others), listening
