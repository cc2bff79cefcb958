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

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness import World, close_all_worlds


_OWN_COMPILE_CACHE: str | None = None
"""The session's tpu_dist compile cache, when this process made it (removed at the end)."""


def pytest_configure(config: pytest.Config) -> None:
    """Let every world of the session share compiled XLA programs.

    Each new world would otherwise compile the same collective programs again, which is most
    of the suite's time on a small machine. Two caches: JAX's persistent cache (rank 0's
    programs, and any other jit program; kept across sessions in the temp directory) and
    tpu_dist's compile cache (every rank's collective programs), in a directory of this
    session only, so that no test depends on the user's own cache or on an earlier session.
    Workers of ``pytest -n`` inherit the session's directory from the controller. JAX reads its
    variables when it is imported, so they are set here, before the forkserver that workers
    come from imports it; a value the user set wins.
    """
    global _OWN_COMPILE_CACHE
    cache = os.path.join(tempfile.gettempdir(), "tpu_dist_test_jax_cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "TPU_DIST_COMPILE_CACHE" not in os.environ:
        _OWN_COMPILE_CACHE = tempfile.mkdtemp(prefix="tpu_dist_test_xla_")  # mode 0700
        os.environ["TPU_DIST_COMPILE_CACHE"] = _OWN_COMPILE_CACHE


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's compile cache (only in the process that made it)."""
    if _OWN_COMPILE_CACHE is not None:
        shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close any World a test left open, so that no worker outlives the session."""
    close_all_worlds()
