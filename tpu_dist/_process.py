"""Every piece of state tpu_dist keeps for the whole process, declared once.

Most per-process state belongs to the process's JAX runtime and lives in objects the
``Runtime`` owns and hands down (``tpu_dist.collectives._runtime``: the program cache, the
on-disk compile cache's open directories, which private jaxlib calls still work, ...). What is
here cannot live there, because what it mirrors is process-wide itself: torch's backend
registry, the creator torch calls for every new group, the runtime object itself, a compile-only
run, a message printed once per process. ``docs/architecture.md`` ("Per-process state")
has the rule; ``tests/test_layers.py`` fails on a ``global`` statement or a module-level
container that is mutated anywhere else in the package.

Each slot below says why it is process-wide, who writes it and who reads it. Only the functions
of this module write the slots (but :data:`compile_events`, a thread-local whose attributes its
one writer sets); the modules named read them through these functions. Like
:mod:`tpu_dist._settings`, this module imports nothing of tpu_dist, torch or JAX, and every
layer may import it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.RLock()  # re-entrant: a runtime being made may ask first_time()

# -- the slots -----------------------------------------------------------------------------

_runtime: Any = None
"""This process's ``collectives._runtime.Runtime``: the composition root, one per process
because JAX allows one distributed initialization per process. Written once by
:func:`runtime_or_create` (``_runtime.get``, on the first "tpu" group); read by
``_runtime`` (:func:`runtime`) and nowhere else: everything below it gets its parts handed
down."""

_pipeline_source: Any = None
"""What every "tpu" group created from now on runs its calls with instead of the runtime's
pipeline (``collectives.pipelines.PipelineSource``), or None: process-wide because torch's
creator of "tpu" groups is. Written by ``collectives._registry.set_pipeline_source``
(compile-only mode's ``Session.activate`` / ``deactivate``); read by the creator,
``_registry._create_process_group``."""

_backend_name: str | None = None
"""The name tpu_dist's backend is registered under in torch's backend registry (process-wide),
or None before it is. Written once by ``collectives._registry.register_backend``; read by it
and by ``_registry.registered_name``."""

_compile_only_session: Any = None
"""This process's compile-only run (``compile_job._session.Session``), or None: one per process
because it is the pipeline source of every group the script creates. Written once by
``compile_job._session.activate`` (``tpu-launch --compile-only``'s process, or ``import
tpu_dist`` with ``TPU_DIST_COMPILE_ONLY=1``); read by ``_session.active_session``."""

_said: set[str] = set()
"""Keys of the things done once per process (:func:`first_time`): warnings and log lines that
say something once per process (``_jaxlib.fell_back``, ``_compile_cache``'s warnings,
``compile_only``'s libtpu variables, the backend name being taken), and JAX's monitoring
listener ``_compile_cache.watch_compile`` registers (JAX's listener list is process-wide)."""

compile_events = threading.local()
"""Per thread: the JAX monitoring events seen during the ``lowered.compile()`` this thread is
in (``seen``, a set, or None outside one). Process-wide because JAX's monitoring listeners
are: written by ``_compile_cache``'s listener and ``watch_compile``, read by
``watch_compile``."""


# -- writers and readers --------------------------------------------------------------------


def runtime() -> Any:
    """The process's runtime, or None before :func:`runtime_or_create` made it."""
    return _runtime


def runtime_or_create(make: Callable[[], T]) -> T:
    """The process's runtime, made with ``make()`` on the first call (once, whichever thread
    asks first)."""
    global _runtime
    found = _runtime
    if found is None:
        with _lock:
            if _runtime is None:
                _runtime = make()
            found = _runtime
    return found


def pipeline_source() -> Any:
    """The pipeline source of new "tpu" groups, or None (the runtime's own pipeline)."""
    return _pipeline_source


def set_pipeline_source(source: Any) -> None:
    """Make ``source`` (or None: the runtime's own) the pipeline source of new groups."""
    global _pipeline_source
    _pipeline_source = source


def backend_name() -> str | None:
    """The name tpu_dist's backend is registered under, or None before it is."""
    return _backend_name


def set_backend_name(name: str) -> None:
    """Note that tpu_dist's backend is registered under ``name``."""
    global _backend_name
    _backend_name = name


def compile_only_session() -> Any:
    """The process's compile-only session, or None."""
    return _compile_only_session


def compile_only_session_or_create(make: Callable[[], T]) -> T:
    """The process's compile-only session, made with ``make()`` on the first call."""
    global _compile_only_session
    with _lock:
        if _compile_only_session is None:
            _compile_only_session = make()
        return _compile_only_session


def do_once(key: str, action: Callable[[], object]) -> None:
    """Run ``action()`` the first time this process asks for ``key`` (a thread asking while it
    runs waits until it has run)."""
    if key in _said:
        return
    with _lock:
        if key not in _said:
            action()
            _said.add(key)


def first_time(key: str) -> bool:
    """True the first time this process asks for ``key``, False ever after (thread-safe).

    For whatever is done once per process: ``if _process.first_time("module:what"):
    logger.warning(...)``. Prefix the key with the asking module's name.
    """
    if key in _said:
        return False
    with _lock:
        if key in _said:
            return False
        _said.add(key)
        return True


# -- the cyclic garbage collector ----------------------------------------------------------


@contextlib.contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """Pause the cyclic garbage collector (if on) for the block; restore it after. It is the
    process's: other threads' allocations are not collected meanwhile either.

    With ``freeze``, every object the process holds when the block ends goes to the
    collector's permanent generation first (:func:`gc.freeze`), where no collection scans it
    again: for a block that imports modules whose objects live as long as the process."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
