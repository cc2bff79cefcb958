"""Compiled collective programs kept on disk, so a new process does not compile them again.

Every new (op, group, sizes, dtype) costs one XLA compilation, 0.01-0.3 s on an idle CPU
core and 0.4-0.7 s when four ranks compile at once on two cores
(docs/decisions/0009-on-disk-compile-cache.md).
Tests that start many worlds, restarted jobs and repeated ``--emulate`` runs compile the same
programs over and over. This cache stores each compiled program (``jax.experimental.
serialize_executable``) under a digest of everything that decides its code, and loads it in
a few milliseconds the next time any process needs it.

Why not JAX's own persistent cache (``JAX_COMPILATION_CACHE_DIR``)? On the CPU platform it
helps rank 0 only: its key hashes the process's own CPU topology, which differs from rank to
rank, and only JAX process 0 writes entries (measured with jax 0.10.2: a warm cache gave rank
0 a 4 ms load and ranks 1-3 a full compile). The key here is the program's
:class:`~tpu_dist.collectives._lowering.ProgramKey` and the group's :func:`placement_key` (on
CPU: the key without its device ids, and each group rank's process, numbered by first
appearance, and device kind), the same on every rank of the group: the group's ranks, and on
CPU the ranks of every group of the same size and layout, share one entry, whichever rank
wrote it (each loads it onto its own group's devices).

**Only programs this process really compiled are stored.** XLA:CPU (jaxlib 0.10.2) cannot
serialize an executable that was itself loaded from a serialized one: the copy keeps the
program's thunks, which name their kernels (``concatenate_bitcast_fusion``, ...), but not the
kernels' object code, and nothing fails until the copy is loaded again and run:
``NOT_FOUND: Function concatenate_bitcast_fusion not found (type id: 1)``, in the middle of a
collective, on one rank. ``lowered.compile()`` returns such a loaded executable when JAX's
persistent cache serves it (or when ``jax_share_binary_between_hosts`` sends it from another
process), so :func:`watch_compile` tells a real compilation from a load by JAX's own
monitoring events, and only real ones are serialized (:func:`serialize`), kept and stored.
When it cannot tell (a JAX that no longer reports those events), nothing is stored: the cache
is then off, not wrong.

**One compilation per host.** The ranks of a group on one host (every rank, under CPU
emulation) all need a new program at the same moment; without coordination each compiles it,
so four ranks on two cores take about twice one compilation and four times its CPU. So the
first rank to need a program takes its *compile turn* (:meth:`CompileCache.compile_turn`, an
``flock`` on one of :data:`LOCK_STRIPES` lock files, which the kernel releases if the process
dies), compiles and stores it; the others wait for the turn to end and load the stored
program. A waiter that finds nothing stored (the compiler was not allowed to store, see below)
compiles it itself, without holding the turn, so compilations never queue behind each other.

One program serves every group of the same size and layout on CPU. XLA:CPU's code does not
depend on which devices run it: its collectives name group ranks (partitions), and the device
assignment it is loaded with maps them to devices, which decides both which process runs
which group rank and who its gloo peers are. So an entry written for ``new_group([0, 1])`` is
loaded for ``new_group([2, 3])`` (or ``[1, 0]``) with that group's assignment
(:func:`deserialize`, through :func:`tpu_dist.collectives._jaxlib.load_onto`), and within a
process :class:`~tpu_dist.collectives._lowering.ProgramCache` does the same with the programs
it compiled, without the disk (docs/decisions/0010-one-cpu-program-per-group-size.md); a
compile turn is per entry, so it
covers every group of the same size and layout too. JAX's public loader cannot: it
looks the written device ids up among the new devices (``KeyError``), and with the ids
remapped the executable keeps its old assignment (XLA: "replica is assigned to device cpu:0").
On TPU the compiled code may depend on the physical devices and the ICI links between them,
so there each device set keeps entries (and programs) of its own, named by device ids too.

Ranks never disagree on a program: an entry is found only under the digest of the code that
builds the program (:data:`_PROGRAM_CODE`), the program's key and placement, the
JAX/jaxlib versions, the platform version and ``XLA_FLAGS``/``LIBTPU_INIT_ARGS``; XLA compiles
the same program to the same code, so a rank that loads runs what a rank that compiles runs.

Where (``TPU_DIST_COMPILE_CACHE``, :data:`tpu_dist._settings.COMPILE_CACHE`):

* ``auto`` (default): on for the CPU platform, in ``$XDG_CACHE_HOME/tpu_dist/xla`` (or
  ``~/.cache/tpu_dist/xla``); off on TPU and GPU, where it is not yet checked on hardware.
* ``0`` / ``off``: off.
* ``1`` / ``on``: the default directory, on every platform.
* an absolute path: that directory, on every platform.

Loading an executable runs code from the file, so only files the user wrote and only the user
can change are ever loaded (:meth:`CompileCache.private_directory`):

* The directory is opened once a process, one path component at a time from ``/``, never
  following a symbolic link by accident (``O_DIRECTORY | O_NOFOLLOW`` on each component, each
  opened relative to the one before), and every entry, lock and temporary file is then reached
  through that open directory (``dir_fd``), never by its path again: replacing the directory
  (or a parent) by a link to another one after the check changes nothing for this process.
* The directory must be owned by the user and writable by no one else; missing components are
  created with mode 0700.
* Every directory above it must be owned by root or the user and writable by no one else, as
  ssh requires of ``~/.ssh``: whoever can write a parent can rename the cache away and put a
  directory of their own in its place. Two exceptions: a *sticky* directory such as ``/tmp``
  (mode 1777), where others can add entries but cannot rename or remove the user's, so below
  it only the components themselves must be trusted; and a parent writable by the user's
  private group (same name as the user, no other member), as Debian's ssh allows, since with
  Ubuntu's default umask 002 ``~/.cache`` is group-writable.
* A symbolic link on the way is followed only when the directory holding it is writable by no
  one else, or when the link belongs to root or the user (in a sticky ``/tmp``, a link another
  user planted is refused); what it points to is checked like the rest.
* Each entry is opened with ``O_NOFOLLOW`` and checked after it is opened (``fstat``): a regular
  file owned by the user and writable by no one else, or it is not loaded.

Whatever fails a check is not used, with one warning that names the path, the owner and mode
found and what to do: a directory turns the cache off for the process, an entry is compiled
again and replaced; a collective never fails for it. Each entry is written whole (a temporary
file created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and renamed into place) and carries a SHA-256
of its contents, so a truncated or damaged entry is found when it is read, before XLA sees it,
and is compiled again (with a warning) and replaced. The directory is trimmed to
:data:`MAX_BYTES`, least recently used entries first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import grp
import hashlib
import logging
import os
import pwd
import secrets
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jaxlib

from tpu_dist import _process, _settings
from tpu_dist.collectives import _jaxlib

if TYPE_CHECKING:
    from tpu_dist.collectives._types import ProgramKey

logger = logging.getLogger(__name__)

MAX_BYTES = 1 << 30
"""The directory's size cap: past it, the least recently used entries are removed (checked once
a process, at its first write)."""
LOCK_STRIPES = 256
"""How many lock files (``.locks/000`` .. ``.locks/255``) the compile turns of all programs share:
two programs on one stripe only wait for each other, they never compile wrongly."""
TURN_WAIT_SECONDS = 120.0
"""The longest a rank waits for another process's compile turn before compiling the program
itself (a CPU collective compiles in well under a second; the holder dying ends its turn)."""
_MAGIC = b"tpu_dist-xla-entry-3\n"
"""Every entry starts with this line, then the SHA-256 of the rest, then the device ids the
program was compiled for (``0,2``) on a line, then the serialized program."""
_DIGEST_BYTES = 32
_SUFFIX = ".xla"

# JAX's monitoring events around a persistent-cache lookup (jax/_src/compiler.py).
_JAX_CACHE_LOOKUP_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
_JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # symbolic links followed while opening the directory, as the kernel allows



def _warn_once(what: str, message: str, *args: object) -> None:
    """Warn about ``what`` once per process."""
    if _process.first_time(f"{__name__}:{what}"):
        logger.warning(message, *args)


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/tpu_dist/xla``, or ``~/.cache/tpu_dist/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpu_dist" / "xla"


def choose_directory(choice: str, platform: str) -> Path | None:
    """Where ``choice`` (a parsed ``TPU_DIST_COMPILE_CACHE``) puts ``platform``'s programs.

    Returns the directory, unchecked, or None when the cache is off for that platform.
    """
    if choice == "off" or (choice == "auto" and platform != "cpu"):
        return None
    if choice in ("auto", "on"):
        return default_directory()
    return Path(choice)


class _Untrusted(Exception):
    """A directory on the way to the cache, or a link in one, that others could change."""


def _problem(info: os.stat_result, uid: int) -> str | None:
    """Why a file or directory the cache would use is not the user's own, or None if it is."""
    if info.st_uid != uid or info.st_mode & 0o022:
        mode = info.st_mode & 0o777
        return f"it is owned by uid {info.st_uid} (you are {uid}) with mode {mode:o}"
    return None


def _private_group(gid: int, uid: int) -> bool:
    """Whether group ``gid`` is ``uid``'s own private group (same name as the user, the user's
    primary group, no other member listed), as Debian's ssh allows for the parents of
    ``~/.ssh``: with the user-private-group scheme (and umask 002, Ubuntu's default for users),
    directories such as ``~/.cache`` are group-writable by that group only."""
    try:
        user = pwd.getpwuid(uid)
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return (
        gid == user.pw_gid and group.gr_name == user.pw_name
        and set(group.gr_mem) <= {user.pw_name}
    )


def _check_parent(fd: int, where: str, path: Path, uid: int) -> os.stat_result:
    """Check directory ``fd`` (at ``where``), a parent of the cache ``path``, as ssh checks
    the parents of ``~/.ssh``: owned by root or the user, and writable by no one else (its
    group may write if it is the user's private group, :func:`_private_group`) unless it is
    sticky (``/tmp``: others cannot rename or remove what is not theirs)."""
    info = os.fstat(fd)
    writable = info.st_mode & (0o002 if _private_group(info.st_gid, uid) else 0o022)
    if info.st_uid not in (0, uid) or (writable and not info.st_mode & stat.S_ISVTX):
        raise _Untrusted(
            f"not using the compile cache {path}: its parent directory {where} is owned by uid "
            f"{info.st_uid} (you are {uid}) with mode {info.st_mode & 0o7777:o}, so whoever can "
            "write to it can put a directory of their own in the cache's place, and loading a "
            f"program runs its code. Point {_settings.COMPILE_CACHE.env} at a directory whose "
            "every parent is owned by root or you and writable by no one else (a sticky one "
            "such as /tmp is fine), or set it to 0."
        )
    return info


def _open_private(path: Path) -> int:
    """Open directory ``path``, creating what is missing with mode 0700, one
    component at a time from ``/`` without following links unchecked; returns its descriptor.

    Raises:
        _Untrusted: a parent, a link on the way or the directory itself is not trusted
            (:func:`_check_parent`, :func:`_problem`).
        OSError: a component cannot be opened or created.
    """
    uid = os.getuid()
    full = os.path.join(os.getcwd(), path)  # a relative XDG_CACHE_HOME: from here, as before
    todo = [name for name in reversed(full.split("/")) if name not in ("", ".")]
    stack = [(os.open("/", _DIR_FLAGS), "/")]  # the directories walked, deepest last
    links = 0
    try:
        while todo:
            name = todo.pop()
            parent, where = stack[-1]
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            parent_info = _check_parent(parent, where, path, uid)
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=parent)
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                link = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISLNK(link.st_mode):
                    raise
                here = os.path.join(where, name)
                if parent_info.st_mode & 0o022 and link.st_uid not in (0, uid):
                    raise _Untrusted(
                        f"not using the compile cache {path}: {here} is a symbolic link owned "
                        f"by uid {link.st_uid} (you are {uid}) in {where}, which others can "
                        f"write to (mode {parent_info.st_mode & 0o7777:o}). Point "
                        f"{_settings.COMPILE_CACHE.env} at a directory of your own that only "
                        "you can write (mode 0700), or set it to 0."
                    ) from None
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", here) from None
                target = os.readlink(name, dir_fd=parent)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                todo.extend(n for n in reversed(target.split("/")) if n not in ("", "."))
                continue
            stack.append((fd, os.path.join(where, name)))
        fd, _ = stack.pop()
        try:
            problem = _problem(os.fstat(fd), uid)
        except OSError:
            os.close(fd)
            raise
        if problem is not None:
            os.close(fd)
            raise _Untrusted(
                f"not using the compile cache {path}: {problem}, and loading a program from it "
                f"runs its code. Point {_settings.COMPILE_CACHE.env} at a directory of your own "
                "that only you can write (mode 0700), or set it to 0."
            )
        return fd
    finally:
        for fd, _ in stack:
            os.close(fd)


def _open_entry(root_fd: int, name: str, flags: int, path: Path, mode: int = 0o600) -> int:
    """Open file ``name`` of the cache directory without following a link and check it is a
    regular file of this user's that no one else can write.

    Raises:
        _Untrusted: it is not (the message says what it is and what to do).
        OSError: it cannot be opened (FileNotFoundError: it is not there).
    """
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=root_fd)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise _Untrusted(
            f"not using {path}: it is a symbolic link, and only files the compile cache wrote "
            "itself are loaded. Remove it; the program is compiled again and stored in its place."
        ) from None
    try:
        info = os.fstat(fd)
        problem = _problem(info, os.getuid())
        if problem is None and not stat.S_ISREG(info.st_mode):
            problem = f"it is not a regular file (mode {info.st_mode:o})"
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise _Untrusted(
            f"not using {path}: {problem}, and loading a program runs its code. Only files you "
            "own and only you can write are used; remove it (or the whole directory) and the "
            "program is compiled again and stored in its place."
        )
    return fd


_PROGRAM_CODE = ("_lowering.py", "_types.py", "_jaxlib.py")
"""The modules (beside this one) whose code builds programs: bodies, keys, the 64-bit scope."""


@functools.cache
def _code_fingerprint() -> str:
    """A digest of the code that builds programs (:data:`_PROGRAM_CODE`): a fact of the
    installed files, computed once."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _PROGRAM_CODE:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def layout(devices: Sequence[jax.Device]) -> tuple[tuple[int, str], ...]:
    """What of a group's devices a CPU program's code depends on: for each group rank, its
    device's kind and its process, numbered in order of first appearance (so ranks [0, 2] and
    [3, 1] of a world with one device per process both read ``((0, "cpu"), (1, "cpu"))``)."""
    first: dict[int, int] = {}
    return tuple(
        (first.setdefault(d.process_index, len(first)), d.device_kind) for d in devices
    )


def placement_key(key: ProgramKey, devices: Sequence[jax.Device]) -> tuple:
    """What names ``key``'s program over ``devices`` apart from the program itself.

    On the CPU platform, the program's :func:`layout`, not its device ids: XLA:CPU's code does
    not depend on which devices run it (its collectives name group ranks, and the device
    assignment given when it is loaded maps them to devices), so one compiled program serves
    every group of the same size and layout (:func:`deserialize`). Elsewhere the device ids
    too: on TPU the compiled code may depend on the physical devices and the ICI links between
    them, so each device set keeps programs of its own.
    """
    if devices and devices[0].platform == "cpu":
        return dataclasses.replace(key, devices=()), layout(devices)
    return key, tuple((d.id, d.process_index, d.device_kind) for d in devices)


def entry_name(key: ProgramKey, devices: Sequence[jax.Device]) -> str:
    """The file name of ``key``'s program over ``devices``: a digest of all that decides it."""
    client = devices[0].client
    parts = (
        _MAGIC, jax.__version__, jaxlib.__version__, client.platform, client.platform_version,
        _code_fingerprint(), os.environ.get("XLA_FLAGS", ""),
        os.environ.get("LIBTPU_INIT_ARGS", ""), jax.process_count(), placement_key(key, devices),
    )
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()
    return f"{key.kind}-{digest[:40]}{_SUFFIX}"


# -- telling a compilation from a load ---------------------------------------------------------


@dataclass
class CompileWatch:
    """What :func:`watch_compile` saw of one ``lowered.compile()``."""

    compiled: bool | None = None
    """True: XLA compiled the program in this call, so it can be serialized whole. False: JAX
    handed back a loaded copy (its persistent cache, or another process with
    ``jax_share_binary_between_hosts``), or it could not be told; never store it then."""
    reason: str = ""
    """Why ``compiled`` is False."""


def _on_jax_event(event: str, **kwargs: object) -> None:
    seen = getattr(_process.compile_events, "seen", None)
    if seen is not None:
        seen.add(event)


@contextlib.contextmanager
def watch_compile() -> Iterator[CompileWatch]:
    """Around one ``lowered.compile()`` in this thread: whether XLA really compiled it.

    JAX's persistent cache reports each lookup and each hit as a monitoring event
    (``jax.monitoring``), in the thread that compiles; this listens for them in this thread
    only, so compilations in other threads do not count.
    """
    _process.do_once(
        f"{__name__}:listener", lambda: jax.monitoring.register_event_listener(_on_jax_event)
    )
    watch = CompileWatch()
    _process.compile_events.seen = seen = set()
    try:
        yield watch
    finally:
        _process.compile_events.seen = None
    watch.compiled, watch.reason = _judge(seen)


def _judge(seen: set[str]) -> tuple[bool, str]:
    if jax.config.jax_share_binary_between_hosts:
        return False, "jax_share_binary_between_hosts is on (the program may be another process's)"
    if _JAX_CACHE_HIT_EVENT in seen:
        return False, "JAX's persistent compilation cache served it"
    jax_cache_on = bool(jax.config.jax_compilation_cache_dir) and bool(
        jax.config.jax_enable_compilation_cache
    )
    if jax_cache_on and _JAX_CACHE_LOOKUP_EVENT not in seen:
        return False, (
            "JAX's persistent compilation cache is on and this JAX did not report its lookup, "
            "so a load cannot be told from a compilation"
        )
    return True, ""


# -- entries -----------------------------------------------------------------------------------


def _trees(n_args: int) -> tuple:
    # Every program takes n 1-D arrays and returns n: its argument and result trees.
    leaves = (0,) * n_args
    return jax.tree_util.tree_structure((leaves, {})), jax.tree_util.tree_structure(leaves)


@dataclass(frozen=True)
class Serialized:
    """A program as XLA compiled it (``serialize_executable.serialize``), never one that was
    loaded (module doc): what the on-disk cache stores and the process keeps to load the
    program onto other groups' devices."""

    blob: bytes
    devices: tuple[int, ...]
    """The JAX device ids it was compiled for, in group-rank order."""


def serialize(
    key: ProgramKey, devices: Sequence[jax.Device], compiled: jax.stages.Compiled
) -> Serialized | None:
    """``compiled`` (which XLA compiled in this process: :func:`watch_compile`), serialized;
    None, warned once, if it cannot be (the program runs all the same)."""
    from jax.experimental import serialize_executable

    try:
        blob, _, _ = serialize_executable.serialize(compiled)
    except Exception as err:  # noqa: BLE001 - a program that cannot be stored is still usable
        _warn_once(f"serialize:{key.kind}", "tpu_dist: cannot serialize a %s program for the "
                   "compile cache (%s: %s).", key.kind, type(err).__name__, err)
        return None
    return Serialized(blob, tuple(d.id for d in devices))


def deserialize(
    serialized: Serialized, devices: Sequence[jax.Device], n_args: int
) -> jax.stages.Compiled | None:
    """``serialized`` loaded to run on ``devices`` (group rank ``i`` on ``devices[i]``), which
    have its :func:`placement_key`; None when it was written for other devices and this jax
    cannot load it onto them (:func:`tpu_dist.collectives._jaxlib.load_onto`).

    Raises:
        Exception: whatever XLA raises for a program it refuses.
    """
    from jax.experimental import serialize_executable

    in_tree, out_tree = _trees(n_args)
    if serialized.devices == tuple(d.id for d in devices):
        return serialize_executable.deserialize_and_load(
            serialized.blob, in_tree, out_tree, devices[0].client, list(devices)
        )
    return _jaxlib.load_onto(serialized.blob, in_tree, out_tree, serialized.devices, devices)


# -- one process's cache: its directories, one compilation per host, entries --------------------


class CompileCache:
    """The on-disk compile cache as one process uses it: the directory each platform's programs
    go to (``TPU_DIST_COMPILE_CACHE``, read once), the descriptor each checked directory was
    opened through, and whether the directory was trimmed yet.

    One per process: the ``Runtime`` owns it (``Runtime.disk_cache``) and hands it to its
    ``ProgramCache``; a ``ProgramCache`` made on its own (a test) makes its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._resolved: dict[str, Path | None] = {}
        """Platform -> its directory (None: off), once per platform."""
        self._fds: dict[str, int] = {}
        """A checked directory's path -> the descriptor it was opened and checked through, kept
        open for the life of the process: every later access goes through it (``dir_fd``),
        never through the path, which another user may have changed since."""
        self._trimmed = False
        """Whether :meth:`_trim_once` ran (once, at the first write)."""

    def private_directory(self, path: Path) -> Path | None:
        """``path``, created private to this user (mode 0700), opened and checked once
        (:func:`_open_private`; the module doc says what is checked); later accesses go through
        the descriptor it was opened with. None, warned once, if it cannot be created or trusted."""
        try:
            fd = _open_private(path)
        except _Untrusted as err:
            _warn_once(f"unsafe:{path}", "tpu_dist: %s", err)
            return None
        except OSError as err:
            _warn_once(
                f"mkdir:{path}", "tpu_dist: cannot use %s=%s (%s); collective programs are "
                "compiled without the compile cache.", _settings.COMPILE_CACHE.env, path, err,
            )
            return None
        with self._lock:
            # An earlier descriptor of the same path stays open: another thread may be using it.
            self._fds[str(path)] = fd
        return path

    def _root_fd(self, root: Path) -> int | None:
        """The descriptor ``root`` was checked through (:meth:`private_directory`, which is called
        now if it was not yet); None if it is not trusted (warned)."""
        fd = self._fds.get(str(root))
        if fd is None and self.private_directory(root) is not None:
            fd = self._fds.get(str(root))
        return fd

    def directory(self, platform: str) -> Path | None:
        """The cache directory for programs of ``platform``, or None when the cache is off.

        Reads ``TPU_DIST_COMPILE_CACHE`` once per platform (and object: one per process).

        Raises:
            ValueError: ``TPU_DIST_COMPILE_CACHE`` is malformed (the message names it).
        """
        if platform in self._resolved:
            return self._resolved[platform]
        path = choose_directory(_settings.COMPILE_CACHE.get(), platform)
        if path is not None:
            path = self.private_directory(path)
        self._resolved[platform] = path
        return path

    @contextlib.contextmanager
    def compile_turn(self, name: str, root: Path) -> Iterator[bool]:
        """Around building the program of entry ``name`` in ``root``: load it, and compile (and
        store) it only if that finds nothing.

        Yields True when this process holds the compile turn (others wait until the block ends),
        False when another process held it and its turn has ended (the block does not hold it, so
        a compilation there, when the other process stored nothing, does not make others wait).
        A turn that cannot be taken (the lock file cannot be opened) or is held longer than
        :data:`TURN_WAIT_SECONDS` yields True without holding it: compiling is always allowed,
        the turn only saves work.
        """
        locks = root / ".locks"
        stripe = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % LOCK_STRIPES
        try:
            root_fd = self._root_fd(root)
            if root_fd is None:
                raise OSError(errno.EACCES, "the compile cache directory is not trusted (warned)")
            with contextlib.suppress(FileExistsError):
                os.mkdir(".locks", 0o700, dir_fd=root_fd)
            locks_fd = os.open(".locks", _DIR_FLAGS, dir_fd=root_fd)
            try:
                problem = _problem(os.fstat(locks_fd), os.getuid())
                if problem is not None:
                    raise OSError(errno.EACCES, f"{problem}; remove it")
                fd = _open_entry(locks_fd, f"{stripe:03d}", os.O_RDWR | os.O_CREAT,
                                 locks / f"{stripe:03d}")
            finally:
                os.close(locks_fd)
        except (OSError, _Untrusted) as err:
            _warn_once(f"lock:{root}", "tpu_dist: cannot open a compile lock in %s (%s); each "
                       "process compiles its own programs.", locks, err)
            yield True
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                yield True  # the turn is ours until the caller has stored the program
                return
            deadline = time.monotonic() + TURN_WAIT_SECONDS
            pause = 0.001
            while True:
                time.sleep(pause)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break  # the other process's turn ended
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        _warn_once("turn-timeout", "tpu_dist: another process held the compile "
                                   "turn for %s longer than %.0f s; compiling here instead.",
                                   name, TURN_WAIT_SECONDS)
                        yield True
                        return
                    pause = min(pause * 2, 0.01)
            fcntl.flock(fd, fcntl.LOCK_UN)
            yield False
        finally:
            os.close(fd)  # releases the turn if still held

    def load(
        self, key: ProgramKey, devices: Sequence[jax.Device], platform: str
    ) -> tuple[jax.stages.Compiled, Serialized] | None:
        """``key``'s compiled program from the cache, loaded onto ``devices``, and the entry it
        came from (a program of the same :func:`placement_key`, perhaps written for other devices);
        or None (off, not there, or unusable: a damaged entry is warned about and left to be
        replaced by the next :meth:`store`)."""
        root = self.directory(platform)
        root_fd = None if root is None else self._root_fd(root)
        if root is None or root_fd is None:
            return None
        name = entry_name(key, devices)
        path = root / name
        try:
            fd = _open_entry(root_fd, name, os.O_RDONLY | os.O_NONBLOCK, path)  # a FIFO: no wait
        except FileNotFoundError:
            return None
        except _Untrusted as err:
            _warn_once(f"unsafe:{path}", "tpu_dist: %s", err)
            return None
        except OSError as err:
            _warn_once(f"read:{path}", "tpu_dist: cannot read the compile cache entry %s (%s); "
                       "compiling the program instead.", path, err)
            return None
        try:
            with os.fdopen(fd, "rb") as entry:
                data = entry.read()
                with contextlib.suppress(OSError):
                    os.utime(entry.fileno())  # trimming removes the least recently used first
        except OSError as err:
            _warn_once(f"read:{path}", "tpu_dist: cannot read the compile cache entry %s (%s); "
                       "compiling the program instead.", path, err)
            return None
        header = len(_MAGIC) + _DIGEST_BYTES
        body = data[header:]
        ids, newline, blob = body.partition(b"\n")
        if (
            not data.startswith(_MAGIC)
            or not newline
            or not blob
            or hashlib.sha256(body).digest() != data[len(_MAGIC):header]
        ):
            _warn_once(
                f"damaged:{path}", "tpu_dist: the compile cache entry %s is damaged or truncated "
                "(%d bytes, its checksum does not match); compiling the program again and "
                "replacing it.", path, len(data),
            )
            return None
        serialized = Serialized(blob, tuple(int(i) for i in ids.split(b",")))
        try:
            compiled = deserialize(serialized, devices, len(key.blocks))
        except Exception as err:  # noqa: BLE001 - an entry XLA refuses is a miss, compiled again
            _warn_once(
                f"load:{path}", "tpu_dist: the compile cache entry %s did not load (%s: %s); "
                "compiling the program again and replacing it.", path, type(err).__name__, err,
            )
            return None
        if compiled is None:
            return None
        return compiled, serialized


    def store(
        self, key: ProgramKey, devices: Sequence[jax.Device], platform: str, serialized: Serialized
    ) -> None:
        """Put ``key``'s program over ``devices``, as :func:`serialize` gave it, in the cache (when
        on). Failures only warn: the program runs all the same."""
        root = self.directory(platform)
        root_fd = None if root is None else self._root_fd(root)
        if root is None or root_fd is None:
            return
        name = entry_name(key, devices)
        path = root / name
        body = b",".join(b"%d" % i for i in serialized.devices) + b"\n" + serialized.blob
        try:
            # A new name, created here (O_EXCL) and never through a link; renamed into place.
            tmp = f".tmp-{secrets.token_hex(8)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=root_fd)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(_MAGIC)
                    out.write(hashlib.sha256(body).digest())
                    out.write(body)
                os.replace(tmp, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=root_fd)
                raise
        except OSError as err:
            _warn_once(f"write:{root}", "tpu_dist: cannot write the compile cache entry %s: %s",
                       path, err)
            return
        self._trim_once(root_fd)


    def _trim_once(self, root_fd: int) -> None:
        """Remove the least recently used entries while the directory (open as ``root_fd``)
        holds more than :data:`MAX_BYTES`."""
        with self._lock:
            if self._trimmed:
                return
            self._trimmed = True
        entries = []
        try:
            # A descriptor of its own: a listing moves its offset, and ``root_fd`` is shared with
            # the processes forked from this one.
            listing = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return
        try:
            with os.scandir(listing) as scan:
                for entry in scan:
                    with contextlib.suppress(OSError):
                        if entry.name.endswith(_SUFFIX):
                            info = entry.stat(follow_symlinks=False)
                            entries.append((info.st_mtime, info.st_size, entry.name))
        finally:
            os.close(listing)
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= MAX_BYTES:
                break
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=root_fd)
            total -= size
