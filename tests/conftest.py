"""Fixtures shared by the test suite.

``world`` is a module-scoped :class:`tests.harness.World`: started on first use in a module,
shared by the module's tests that use the same parameter, and closed when the module is done
(or when pytest moves on to the next parameter). Parametrise it indirectly::

    @pytest.mark.parametrize("world", [2, 3], indirect=True)  # 2 ranks, then 3 ranks of gloo
    def test_x(world: World) -> None:
        results = world.run(_body, 1.0)

    TPU4 = pytest.param({"world_size": 4, "backend": "tpu", "env": {"X": "1"}}, id="tpu4")

    @pytest.mark.parametrize("world", [TPU4], indirect=True)
    def test_y(world: World) -> None: ...

An ``int`` parameter is the world size (gloo); a ``dict`` parameter holds ``World``'s arguments.
Without parametrisation ``world`` is 2 ranks of gloo. For a world per class, or several worlds
in one test, write a fixture of the scope you need around ``with World(...) as world``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from tests.harness import World, close_all_worlds


def pytest_configure(config: pytest.Config) -> None:
    """Let every world of the session share compiled XLA programs (JAX's persistent cache).

    Each new world would otherwise compile the same collective programs again, which is most
    of the suite's time on a small machine. Workers inherit these variables; a value the user
    set wins.
    """
    cache = os.path.join(tempfile.gettempdir(), "tpu_dist_test_jax_cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    """A World shared by a module's tests; see the module docstring for its parameters."""
    param = getattr(request, "param", 2)
    if isinstance(param, int):
        kwargs = {"world_size": param}
    elif isinstance(param, dict):
        kwargs = dict(param)
    else:
        raise TypeError(
            f"the world fixture takes a world size (int) or World arguments (dict), got {param!r}"
        )
    with World(**kwargs) as started:
        yield started


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close any World a test left open, so that no worker outlives the session."""
    close_all_worlds()
