"""``tpu-launch``'s entry point: the launcher imports torch once, for itself and its zygote.

``python -m tpu_dist.launch`` imports the ``tpu_dist`` package (and with it torch) before any
launcher code runs; its workers fork from a zygote that imports torch, ``torch.distributed``
and JAX again in a new interpreter (``tpu_dist/launch/_zygote.py``), about 1 CPU-s and 1 s of
start-up per launch after the launcher's own import. This entry (``tpu-launch``, or ``python -m
_tpu_dist_launch``) runs first, imports only the standard library, and:

1. adds what every CPU worker's environment has and what is read while torch is imported or
   the interpreter starts (:data:`EARLY_VARS`, each only when unset) and re-executes this
   interpreter with it, once (the same pid, arguments and flags);
2. imports numpy, torch and ``torch.distributed`` (the garbage collector paused, the objects
   then frozen, as ``import tpu_dist`` does) and forks: the child is the zygote, which waits
   for the launcher to send the workers' environment before it imports JAX and serves
   (``_zygote.serve_forked``); the launcher restores the environment it was started with and
   runs ``tpu_dist.launch.main``.

The launcher uses the forked zygote only where the workers' environment agrees with the one
torch was imported in (``tpu_dist.launch._run``; otherwise it starts the zygote as a new
interpreter, as ``python -m tpu_dist.launch`` does, and this one ends). Nothing here runs for
``--compile-only`` (the job runs in the launcher, whose thread count must stay its own), with
``TPU_DIST_LAUNCH_PRELOAD=0``, off Linux, or with TorchTPU's backend loaded by torch (it may
read the TPU variables the launcher sets only later).

This module lives outside the ``tpu_dist`` package for the same reason as ``_tpu_dist_autoload``:
importing anything of ``tpu_dist`` runs ``tpu_dist/__init__.py``, which imports torch.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import socket
import sys
from typing import Any, NamedTuple

__all__ = [
    "EARLY_VARS", "PRELOAD_ENV", "PRELOAD_OFF", "EarlyZygote", "interpreter_options", "main",
    "take_early_zygote",
]

EARLY_VARS = {"OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
"""Set for the workers by tpu-launch (``tpu_dist.launch._env``: several CPU workers per host,
CPU workers) and read too early to set after a fork: by OpenMP and numpy's BLAS when torch and
numpy load (and numpy's BLAS starts a thread unless it is 1, which makes a fork unsafe), and by
glibc when the interpreter starts."""

PRELOAD_ENV = "TPU_DIST_LAUNCH_PRELOAD"
"""tpu_dist's switch for the zygote (``tpu_dist._settings.LAUNCH_PRELOAD``; this module cannot
import it, ``tests/test_launch_zygote.py`` checks they agree): off (:data:`PRELOAD_OFF`), no
early fork either."""
PRELOAD_OFF = ("0", "false", "no", "off")
"""The values (stripped, lower case) that turn :data:`PRELOAD_ENV` off, as tpu_dist reads it."""

_ADDED_VAR = "_TPU_DIST_LAUNCH_ADDED"
"""Set only across the re-exec: the names of :data:`EARLY_VARS` this entry added (JSON)."""


class EarlyZygote(NamedTuple):
    """The zygote this launcher forked after importing torch (``tpu_dist.launch._run`` takes it)."""

    pid: int
    sock: socket.socket
    env: dict[str, str]
    """The environment torch was imported in (the launcher's, with the added variables)."""


_early: EarlyZygote | None = None


def take_early_zygote() -> EarlyZygote | None:
    """The zygote this process forked, once (None after the first call, or if there is none)."""
    global _early
    early, _early = _early, None
    return early


def _wanted(argv: list[str]) -> bool:
    if not sys.platform.startswith("linux") or "torch" in sys.modules:
        return False
    if os.environ.get(PRELOAD_ENV, "").strip().lower() in PRELOAD_OFF:
        return False
    if interpreter_options():  # a forked worker would run the script with them
        return False
    # A false match (the user's script takes a flag of that name) only costs the early fork.
    return not any(arg == "--compile-only" for arg in argv)


def interpreter_options(
    orig_argv: list[str] | None = None, argv: list[str] | None = None
) -> list[str]:
    """The options this interpreter was started with, before its script or ``-m module``
    (``python -O -m _tpu_dist_launch ...``: ``["-O"]``; the ``tpu-launch`` command: ``[]``).

    A worker runs as ``python -u _worker.py ...``, so a zygote forked from a launcher started
    with options (``-O`` turns asserts off, ``-I``, ``-X ...``, ``-W ...``) would run the
    script with them where a fresh worker would not: then there is no early fork (the
    launcher starts its zygote as a new ``python -u``, as the workers are started)."""
    orig = sys.orig_argv if orig_argv is None else orig_argv
    args = sys.argv if argv is None else argv
    head = orig[1 : len(orig) - (len(args) - 1)]  # options, then "-m module" or the script
    if len(head) >= 2 and head[-2] == "-m":
        return head[:-2]
    if head and head[-1].startswith("-m") and len(head[-1]) > 2:  # -mmodule
        return head[:-1]
    return head[:-1]


def _load_zygote() -> Any:
    """``tpu_dist/launch/_zygote.py`` as a module of its own, loaded by path as the zygote's own
    interpreter runs it (it imports only the standard library), or None."""
    spec = importlib.util.find_spec("tpu_dist")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "launch", "_zygote.py")
    spec = importlib.util.spec_from_file_location("_tpu_dist_launch_zygote", path)
    zygote = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(zygote)  # type: ignore[union-attr]
    return zygote


def _fork_zygote(zygote: Any) -> EarlyZygote | None:
    added = json.loads(os.environ.pop(_ADDED_VAR, "null"))
    if added is None:
        missing = [name for name in EARLY_VARS if name not in os.environ]
        if missing:
            env = dict(os.environ, **{name: EARLY_VARS[name] for name in missing})
            env[_ADDED_VAR] = json.dumps(missing)
            try:
                os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
            except OSError:
                return None
        added = []
    env = dict(os.environ)
    try:
        return _import_and_fork(zygote, env)
    finally:
        for name in added:  # the launcher and its workers see the environment it started with
            os.environ.pop(name, None)


def _import_and_fork(zygote: Any, env: dict[str, str]) -> EarlyZygote | None:
    inherited = zygote.open_fds()  # the caller's (a shell's exec 7>file), before torch's own
    gc.disable()
    try:
        try:
            import numpy  # noqa: F401
        except ImportError:
            pass
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()
    if "torch_tpu" in sys.modules or zygote._threads() != 1:
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    launcher = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid == 0:  # the zygote: out of the launcher's session first (a Ctrl-C is the launcher's)
        os.setsid()
        ours.close()
        zygote.close_fds(inherited)  # a fresh worker never sees them
        sys.modules.pop("_tpu_dist_launch", None)
        zygote.serve_forked(theirs.detach(), launcher)  # returns when its worker's program did
        sys.exit(0)
    theirs.close()
    return EarlyZygote(pid, ours, env)


def main() -> None:
    """``tpu-launch``: :func:`tpu_dist.launch.main`, after the early fork (module doc)."""
    global _early
    zygote = _load_zygote()
    if zygote is not None:
        zygote.open_standard_fds()
        if _wanted(sys.argv[1:]):
            _early = _fork_zygote(zygote)
    from tpu_dist.launch import main as launch

    launch()


if __name__ == "__main__":  # python -m _tpu_dist_launch: run as the module tpu-launch imports
    import _tpu_dist_launch

    _tpu_dist_launch.main()
