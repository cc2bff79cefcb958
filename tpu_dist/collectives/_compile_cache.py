"""Compiled collective programs kept on disk, so a new process does not compile them again.

Every new (op, group, sizes, dtype) costs one XLA compilation, 0.01-0.3 s on an idle CPU
core and 0.4-0.7 s when four ranks compile at once on two cores (benchmarks/README.md, E25).
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
first rank to need a program takes its *compile turn* (:func:`compile_turn`, an ``flock`` on
one of :data:`LOCK_STRIPES` lock files, which the kernel releases if the process dies),
compiles and stores it; the others wait for the turn to end and load the stored program. A
waiter that finds nothing stored (the compiler was not allowed to store, see below) compiles
it itself, without holding the turn, so compilations never queue behind each other.

One program serves every group of the same size and layout on CPU. XLA:CPU's code does not
depend on which devices run it: its collectives name group ranks (partitions), and the device
assignment it is loaded with maps them to devices, which decides both which process runs
which group rank and who its gloo peers are. So an entry written for ``new_group([0, 1])`` is
loaded for ``new_group([2, 3])`` (or ``[1, 0]``) with that group's assignment
(:func:`deserialize`, through :func:`tpu_dist.collectives._jaxlib.load_onto`), and within a
process :class:`~tpu_dist.collectives._lowering.ProgramCache` does the same with the programs
it compiled, without the disk (benchmarks/README.md, E30); a compile turn is per entry, so it
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

Loading an executable runs code from the file, so the directory must be the user's own: it is
created with mode 0700, and a directory owned by another user or writable by group or others
is not used (with a warning once). Each entry is written whole (a temporary file renamed into
place) and carries a SHA-256 of its contents, so a truncated or damaged entry is found when it
is read, before XLA sees it, and is compiled again (with a warning) and replaced. The
directory is trimmed to :data:`MAX_BYTES`, least recently used entries first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jaxlib

from tpu_dist import _settings
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

_lock = threading.Lock()
_resolved: dict[str, Path | None] = {}  # platform -> directory (None: off), once a process
_trimmed = False
_warned: set[str] = set()
_fingerprint: str | None = None
_events = threading.local()
_listening = False


def _warn_once(what: str, message: str, *args: object) -> None:
    if what not in _warned:
        _warned.add(what)
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


def private_directory(path: Path) -> Path | None:
    """``path``, created private to this user (mode 0700); None, warned once, if it cannot be
    created or trusted (owned by another user, or writable by group or others)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as err:
        _warn_once(
            f"mkdir:{path}", "tpu_dist: cannot use %s=%s (%s); collective programs are "
            "compiled without the compile cache.", _settings.COMPILE_CACHE.env, path, err,
        )
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        _warn_once(
            f"unsafe:{path}", "tpu_dist: not using the compile cache %s: it is owned by uid %d "
            "(you are %d) with mode %o, and loading a program from it runs its code. Point %s "
            "at a directory of your own that only you can write (mode 0700), or set it to 0.",
            path, info.st_uid, os.getuid(), info.st_mode & 0o777, _settings.COMPILE_CACHE.env,
        )
        return None
    return path


def directory(platform: str) -> Path | None:
    """The cache directory for programs of ``platform``, or None when the cache is off.

    Reads ``TPU_DIST_COMPILE_CACHE`` once per platform and process.

    Raises:
        ValueError: ``TPU_DIST_COMPILE_CACHE`` is malformed (the message names it).
    """
    if platform in _resolved:
        return _resolved[platform]
    path = choose_directory(_settings.COMPILE_CACHE.get(), platform)
    if path is not None:
        path = private_directory(path)
    _resolved[platform] = path
    return path


_PROGRAM_CODE = ("_lowering.py", "_types.py", "_jaxlib.py")
"""The modules (beside this one) whose code builds programs: bodies, keys, the 64-bit scope."""


def _code_fingerprint() -> str:
    """A digest of the code that builds programs (:data:`_PROGRAM_CODE`)."""
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
    global _fingerprint
    if _fingerprint is None:
        _fingerprint = _code_fingerprint()
    client = devices[0].client
    parts = (
        _MAGIC, jax.__version__, jaxlib.__version__, client.platform, client.platform_version,
        _fingerprint, os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
        jax.process_count(), placement_key(key, devices),
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
    seen = getattr(_events, "seen", None)
    if seen is not None:
        seen.add(event)


@contextlib.contextmanager
def watch_compile() -> Iterator[CompileWatch]:
    """Around one ``lowered.compile()`` in this thread: whether XLA really compiled it.

    JAX's persistent cache reports each lookup and each hit as a monitoring event
    (``jax.monitoring``), in the thread that compiles; this listens for them in this thread
    only, so compilations in other threads do not count.
    """
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_jax_event)
            _listening = True
    watch = CompileWatch()
    _events.seen = seen = set()
    try:
        yield watch
    finally:
        _events.seen = None
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


# -- one compilation per host ------------------------------------------------------------------


@contextlib.contextmanager
def compile_turn(name: str, root: Path) -> Iterator[bool]:
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
    try:
        locks.mkdir(mode=0o700, exist_ok=True)
        stripe = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % LOCK_STRIPES
        fd = os.open(locks / f"{stripe:03d}", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
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


def load(
    key: ProgramKey, devices: Sequence[jax.Device], platform: str
) -> tuple[jax.stages.Compiled, Serialized] | None:
    """``key``'s compiled program from the cache, loaded onto ``devices``, and the entry it
    came from (a program of the same :func:`placement_key`, perhaps written for other devices);
    or None (off, not there, or unusable: a damaged entry is warned about and left to be
    replaced by the next :func:`store`)."""
    root = directory(platform)
    if root is None:
        return None
    path = root / entry_name(key, devices)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
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
    with contextlib.suppress(OSError):
        os.utime(path)  # trimming removes the least recently used entries first
    return compiled, serialized


def store(
    key: ProgramKey, devices: Sequence[jax.Device], platform: str, serialized: Serialized
) -> None:
    """Put ``key``'s program over ``devices``, as :func:`serialize` gave it, in the cache (when
    on). Failures only warn: the program runs all the same."""
    root = directory(platform)
    if root is None:
        return
    path = root / entry_name(key, devices)
    body = b",".join(b"%d" % i for i in serialized.devices) + b"\n" + serialized.blob
    try:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(_MAGIC)
                out.write(hashlib.sha256(body).digest())
                out.write(body)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as err:
        _warn_once(f"write:{root}", "tpu_dist: cannot write the compile cache entry %s: %s",
                   path, err)
        return
    _trim_once(root)


def _trim_once(root: Path) -> None:
    """Remove the least recently used entries while the directory holds more than
    :data:`MAX_BYTES`."""
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
