"""Fixtures shared by the test suite: module-scoped worlds of worker processes.

``worlds`` returns a World for the given arguments, starting it on first use and sharing it
with every later request of the module's tests for the same arguments; all of them are closed
when the module is done::

    @pytest.mark.parametrize("n", [2, 3])
    def test_x(worlds: Callable[..., World], n: int) -> None:
        results = worlds(n).run(_body, 1.0)             # 2, then 3 ranks of gloo

    def test_y(worlds: Callable[..., World]) -> None:
        world = worlds(4, backend="tpu", env={"TPU_DIST_PLATFORM": "cpu"})

``world`` is the same thing as a fixture: 2 ranks of gloo, or what an indirect parameter says
(an ``int`` world size, or a ``dict`` of ``World`` arguments)::

    @pytest.mark.parametrize("world", [2, {"world_size": 4, "backend": "tpu"}], indirect=True)
    def test_z(world: World) -> None: ...

Because both go through the module's cache, tests of one module may ask for their worlds in
any order: a world is never restarted just because pytest moved between parameters. Several
worlds of a module may be running at once; for a world per class, or one you want to close
early, use ``with World(...) as world`` in a fixture of your own.
"""

from __future__ import annotations

import atexit
import gc
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness import World, close_all_worlds

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config: pytest.Config) -> None:
    """Let every world share compiled XLA programs, within a session and across sessions.

    Each new world would otherwise compile the same collective programs again, which is most
    of the suite's time on a small machine. Two caches, both in the temp directory and both the
    suite's own (never the user's): JAX's persistent cache (rank 0's programs, and any other
    jit program) and tpu_dist's compile cache (every rank's collective programs; measured in
    docs/decisions/0009-on-disk-compile-cache.md: three collectives files 76 s with an empty
    cache, 27 s warm).
    Kept across sessions: an entry is found only under the digest of the code that builds it
    (a changed ``_lowering.py`` misses), damaged entries are recompiled with a warning, and
    ``tests/test_compile_cache.py`` uses directories of its own. Workers of ``pytest -n`` and
    the worlds' processes inherit the variables. JAX reads its variables when it is imported,
    so they are set here, before the forkserver that workers come from imports it; a value the
    user set wins (``TPU_DIST_COMPILE_CACHE=0`` runs the suite without tpu_dist's cache).

    One thread for torch's ops in every process of the suite (``OMP_NUM_THREADS=1``, unless the
    user set it), as torchrun gives each of several workers on a host: ``pytest -n 2`` already
    keeps every core busy, and with a pool of one thread a core per process, the pools of
    concurrent processes (test processes, their worlds' ranks, launched jobs) spun against each
    other (docs/decisions/0030-test-suite-time.md). Set before anything here imports torch,
    which reads it then.

    tpu_dist's bytecode is written once, before any test starts (Python's own ``__pycache__``,
    as every import writes it unless ``PYTHONDONTWRITEBYTECODE`` is set, as it is on the CI
    machine): else each of the suite's few hundred processes that import tpu_dist (launchers,
    ranks, compile-only jobs) compiles its sources again, about 0.15 CPU-s each (the same record).

    Also keeps pytest-xdist from reordering the modules (see :data:`_LONGEST_FIRST`).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not hasattr(config, "workerinput"):  # once: the pytest-xdist workers find it written
        import compileall

        compileall.compile_dir(os.path.join(_ROOT, "tpu_dist"), quiet=2)
    tmp = tempfile.gettempdir()
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tmp, "tpu_dist_test_jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("TPU_DIST_COMPILE_CACHE", os.path.join(tmp, "tpu_dist_test_xla_cache"))
    # libtpu's log files (its default folder, /tmp/tpu_logs, is every user's): the suite's own.
    os.environ.setdefault("TPU_LOG_DIR", os.path.join(tmp, "tpu_dist_test_libtpu_logs"))
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep _LONGEST_FIRST's order
        config.option.loadscopereorder = False


@pytest.fixture(scope="module")
def worlds() -> Iterator[Callable[..., World]]:
    """``worlds(world_size, backend="gloo", **kwargs)``: this module's World for those arguments.

    The arguments are :class:`tests.harness.World`'s. Worlds are started on first request and
    closed at the end of the module.
    """
    cache: dict[str, World] = {}

    def get(world_size: int, backend: str = "gloo", **kwargs: Any) -> World:
        key = repr((world_size, backend, sorted(kwargs.items())))
        if key not in cache:
            world = World(world_size, backend, **kwargs)
            world.start()
            cache[key] = world
        return cache[key]

    try:
        yield get
    finally:
        for world in cache.values():
            world.close()


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest, worlds: Callable[..., World]) -> World:
    """A World of this module: 2 ranks of gloo, or as the indirect parameter says."""
    param = getattr(request, "param", 2)
    if isinstance(param, int):
        return worlds(param)
    if isinstance(param, dict):
        return worlds(**param)
    raise TypeError(
        f"the world fixture takes a world size (int) or World arguments (dict), got {param!r}"
    )


_LONGEST_FIRST = (
    "test_examples", "test_compile_only", "test_dtensor", "test_launch_failures",
    "test_collectives_reduce", "test_fsdp_tp_ddp", "test_launch_faults", "test_step_report",
    "test_torch_suite", "test_pipelining", "test_launch_restart", "test_frameworks",
    "test_backend_lifecycle", "test_torch_compile", "test_collectives_faults", "test_paused_rank",
    "test_collectives_movement", "test_bench", "test_tpu_compile", "test_launch_e2e",
    "test_reliability", "test_settings_init", "test_launch_zygote", "test_launch_signals",
    "test_tpu_block_align", "test_collectives_semantics", "test_jaxlib", "test_compile_cache",
    "test_launch_tpu_backend", "test_launch_netns", "test_mesh_device_mesh",
)
"""The modules that take longest, longest first (each module's wall time in a ``pytest -n 2
--dist loadfile`` run, docs/decisions/0030-test-suite-time.md: the modules
of 7 s or more). ``--dist loadfile``
hands whole modules to the two workers in the order of this list, then the rest in
collection order: a long module handed out last (such as test_examples, with few tests)
would leave the other worker idle while it runs. pytest-xdist would instead order the modules by how many *tests* each has
(``--loadscope-reorder``, its default), which puts the long few-test modules last; so
:func:`pytest_configure` turns that off."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection created (torch, JAX, every test module) to the collector's
    permanent generation (``gc.freeze``), so that the full collections the tests set off in this
    process (each pytest-xdist worker runs a few hundred tests in-process) do not scan it again
    each time: 6.8 of the two workers' 58 CPU-s were the collector's before
    (docs/decisions/0030-test-suite-time.md). Nothing collection made becomes garbage while
    tests run. At exit it goes back to the collector (``gc.unfreeze``), so that the
    interpreter's teardown frees it: frozen, triton's classes (collection imports
    ``torch._dynamo``, which imports triton on torch's CUDA builds) outlived it, and triton
    3.9's nanobind bindings (torch 2.15) printed their ``nanobind: leaked ...`` report at the
    end of every worker's run (docs/decisions/0032-torch-2.14-and-2.15.md)."""
    gc.freeze()
    atexit.register(gc.unfreeze)


TIERS: dict[str, tuple[str, ...]] = {
    # One process, no worker processes, no TPU compilation: the logic (seconds in all).
    "unit": (
        "test_plan", "test_settings", "test_dtensor_spec", "test_mesh_plan", "test_mesh_topology",
        "test_mesh_cli", "test_estimate", "test_layers", "test_launch_config",
        "test_launch_discovery", "test_compile_options", "test_jaxlib", "test_watchdog",
        "test_work", "test_predict", "test_dispatch",
    ),
    # Ranks of tests/harness.py's World (spawned once per module), each test a body on them.
    "world": (
        "test_backend_lifecycle", "test_collectives_faults", "test_collectives_movement",
        "test_collectives_reduce", "test_collectives_semantics", "test_collectives_vs_gloo",
        "test_compile_cache", "test_dtensor", "test_families", "test_fsdp_tp_ddp",
        "test_harness", "test_local_security", "test_mesh_device_mesh", "test_paused_rank",
        "test_pipelining",
        "test_program_reuse", "test_rejected_calls", "test_reliability", "test_settings_init",
        "test_torch_compile", "test_torchtpu_coexistence",
    ),
    # Whole processes started as a user would: tpu-launch, torchrun, python -c, tpu-dist-bench.
    "launch": (
        "test_launch_e2e", "test_launch_failures", "test_launch_faults", "test_launch_netns",
        "test_launch_restart", "test_launch_signals", "test_launch_torchtpu",
        "test_launch_tpu_backend", "test_launch_zygote", "test_bench", "test_frameworks",
        "test_rejected_by_torch",
        "test_torch_suite",
    ),
    # libtpu's TPU compiler (compile-only devices, no TPU): programs and dry runs.
    "libtpu": (
        "test_tpu_compile", "test_tpu_compile_families", "test_tpu_block_align",
        "test_libtpu_topology", "test_mesh_torchtpu", "test_compile_only",
        "test_compile_only_faults", "test_launch_compile_only", "test_step_report", "test_torchtitan",
    ),
    # The examples as the README runs them.
    "e2e": ("test_examples",),
}
"""Each test module's tier (CONTRIBUTING.md: where a new test goes, and how to run a tier:
``pytest -m unit``). A module is in the tier of its most costly kind of test. A test module in
no tier fails collection."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its module's tier (:data:`TIERS`); runs :data:`_LONGEST_FIRST`
    modules first, in that order, the rest keep theirs."""
    tier_of = {module: tier for tier, modules in TIERS.items() for module in modules}
    missing = sorted({item.path.stem for item in items if item.path.stem not in tier_of})
    if missing:
        raise pytest.UsageError(
            f"test module(s) {', '.join(missing)} are in no tier: add each to TIERS in "
            "tests/conftest.py (CONTRIBUTING.md says which tier a test belongs to)."
        )
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of[item.path.stem]))
    first = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close any World a test left open, so that no worker outlives the session."""
    close_all_worlds()
