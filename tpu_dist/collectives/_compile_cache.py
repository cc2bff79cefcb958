"""Compiled collective programs kept on disk, so a new process does not compile them again.

Every new (op, group, sizes, dtype) costs one XLA compilation, 0.01-0.3 s on an idle CPU
core and 0.4-0.7 s when four ranks compile at once on two cores (benchmarks/README.md, E25).
Tests that start many worlds, restarted jobs and repeated ``--emulate`` runs compile the same
programs over and over. This cache stores each compiled program (``jax.experimental.
serialize_executable``) under a digest of everything that decides its code, and loads it in
~3 ms the next time any rank of any process needs it.

Why not JAX's own persistent cache (``JAX_COMPILATION_CACHE_DIR``)? On the CPU platform it
helps rank 0 only: its key hashes the process's own CPU topology, which differs from rank to
rank, and only JAX process 0 writes entries (measured with jax 0.10.2: a warm cache gave rank
0 a 4 ms load and ranks 1-3 a full compile). The key here is the program's
:class:`~tpu_dist.collectives._lowering.ProgramKey` (which includes the group's device ids),
so every rank shares one entry.

A program is bound to its devices: an executable compiled for devices (0, 1) does not run on
(2, 3) (XLA: "local device count is 0"), so ``new_group([2, 3])`` compiles its own programs
even when ``new_group([0, 1])`` has the same shapes; the cache then serves each group's
programs to later processes.

Where (``TPU_DIST_COMPILE_CACHE``):

* unset (default): on for the CPU platform, in ``$XDG_CACHE_HOME/tpu_dist/xla`` (or
  ``~/.cache/tpu_dist/xla``); off on TPU and GPU, where it is not yet checked on hardware.
* ``0`` / ``off``: off.
* ``1`` / ``on``: the default directory, on every platform.
* a path: that directory, on every platform.

Loading an executable runs code from the file, so the directory must be the user's own: it is
created with mode 0700, and a directory owned by another user or writable by group or others
is not used (with a warning once). Entries are written whole (a temporary file renamed into
place), so ranks that compile the same program at once never read half an entry. The
directory is trimmed to :data:`MAX_BYTES`, least recently used entries first.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jaxlib

if TYPE_CHECKING:
    from tpu_dist.collectives._lowering import ProgramKey

logger = logging.getLogger(__name__)

CACHE_ENV = "TPU_DIST_COMPILE_CACHE"
MAX_BYTES = 1 << 30
"""The directory's size cap: past it, the least recently used entries are removed (checked once a process,
at its first write)."""
_FORMAT = "1"
_SUFFIX = ".xla"
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")

_lock = threading.Lock()
_resolved: tuple[str | None, Path | None] | None = None  # (platform it was resolved for, dir)
_trimmed = False
_warned: set[str] = set()


def _warn_once(what: str, message: str, *args: object) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(message, *args)


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/tpu_dist/xla``, or ``~/.cache/tpu_dist/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpu_dist" / "xla"


def directory(platform: str) -> Path | None:
    """The cache directory for programs of ``platform``, or None when the cache is off.

    Raises:
        ValueError: ``TPU_DIST_COMPILE_CACHE`` is empty.
    """
    global _resolved
    if _resolved is not None and _resolved[0] == platform:
        return _resolved[1]
    raw = os.environ.get(CACHE_ENV)
    choice = None if raw is None else raw.strip()
    if choice == "":
        raise ValueError(
            f"{CACHE_ENV} is set but empty: use 0 (off), 1 (the default directory, "
            f"{default_directory()}) or a directory path."
        )
    if choice is None:
        path = default_directory() if platform == "cpu" else None
    elif choice.lower() in _OFF:
        path = None
    elif choice.lower() in _ON:
        path = default_directory()
    else:
        path = Path(choice).expanduser()
    if path is not None:
        path = _usable(path)
    _resolved = (platform, path)
    return path


def _usable(path: Path) -> Path | None:
    """``path``, created private to this user; None (warned once) if it cannot be trusted."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as err:
        _warn_once(
            "mkdir", "tpu_dist: cannot use %s=%s (%s); collective programs are compiled "
            "without it.", CACHE_ENV, path, err,
        )
        return None
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
        _warn_once(
            "unsafe", "tpu_dist: not using the compile cache %s: it is owned by uid %d or "
            "writable by others (mode %o), and loading a program from it runs its code. Point "
            "%s at a directory of your own (mode 0700), or set it to 0.",
            path, info.st_uid, info.st_mode & 0o777, CACHE_ENV,
        )
        return None
    return path


def _code_fingerprint() -> str:
    """A digest of the code that builds programs: the bodies in ``_lowering.py``."""
    from tpu_dist.collectives import _lowering

    return hashlib.sha256(Path(_lowering.__file__).read_bytes()).hexdigest()


_fingerprint: str | None = None


def entry_name(key: ProgramKey, devices: Sequence[jax.Device]) -> str:
    """The file name of ``key``'s program over ``devices``: a digest of all that decides it."""
    global _fingerprint
    if _fingerprint is None:
        _fingerprint = _code_fingerprint()
    client = devices[0].client
    parts = (
        _FORMAT, jax.__version__, jaxlib.__version__, client.platform, client.platform_version,
        _fingerprint, os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
        jax.process_count(), key.kind, key.blocks, key.params,
        tuple((d.id, d.process_index, d.device_kind) for d in devices),
    )
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()
    return f"{key.kind}-{digest[:40]}{_SUFFIX}"


def _trees(n_args: int) -> tuple:
    # Every program takes n 1-D arrays and returns n: its argument and result trees.
    leaves = (0,) * n_args
    return jax.tree_util.tree_structure((leaves, {})), jax.tree_util.tree_structure(leaves)


def load(
    key: ProgramKey, devices: Sequence[jax.Device], platform: str
) -> jax.stages.Compiled | None:
    """``key``'s compiled program from the cache, or None (off, not there, or unreadable)."""
    from jax.experimental import serialize_executable

    root = directory(platform)
    if root is None:
        return None
    path = root / entry_name(key, devices)
    try:
        blob = path.read_bytes()
        os.utime(path)  # trimming removes the least recently used entries first
    except FileNotFoundError:
        return None
    except OSError as err:
        _warn_once("read", "tpu_dist: cannot read the compile cache entry %s: %s", path, err)
        return None
    in_tree, out_tree = _trees(len(key.blocks))
    try:
        return serialize_executable.deserialize_and_load(
            blob, in_tree, out_tree, devices[0].client, list(devices)
        )
    except Exception as err:  # noqa: BLE001 - a bad entry is a miss, recompiled and replaced
        _warn_once(
            "load", "tpu_dist: compile cache entry %s did not load (%s: %s); compiling "
            "instead.", path, type(err).__name__, err,
        )
        return None


def store(
    key: ProgramKey, devices: Sequence[jax.Device], platform: str,
    compiled: jax.stages.Compiled,
) -> None:
    """Put ``key``'s compiled program in the cache (when on); failures only warn."""
    from jax.experimental import serialize_executable

    root = directory(platform)
    if root is None:
        return
    try:
        blob, _, _ = serialize_executable.serialize(compiled)
    except Exception as err:  # noqa: BLE001 - a program that cannot be stored is still usable
        _warn_once("serialize", "tpu_dist: cannot serialize a %s program for the compile "
                   "cache (%s: %s).", key.kind, type(err).__name__, err)
        return
    path = root / entry_name(key, devices)
    try:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as err:
        _warn_once("write", "tpu_dist: cannot write the compile cache entry %s: %s", path, err)
        return
    _trim_once(root)


def _trim_once(root: Path) -> None:
    """Remove the least recently used entries while the directory holds more than :data:`MAX_BYTES`."""
    global _trimmed
    with _lock:
        if _trimmed:
            return
        _trimmed = True
    entries = []
    for entry in os.scandir(root):
        with contextlib.suppress(OSError):
            if entry.name.endswith(_SUFFIX):
                info = entry.stat()
                entries.append((info.st_mtime, info.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= MAX_BYTES:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
        total -= size
