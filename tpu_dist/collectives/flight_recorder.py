"""The flight recorder: each rank's last collectives, dumped when something goes wrong.

Every "tpu" collective appends an entry to a per-process ring buffer (the last
``TPU_DIST_FLIGHT_RECORDER_SIZE`` calls, default 2000): its group, its
sequence number in that group, the op, the block sizes and dtypes, the reduce
op or root, its state (``scheduled``, ``completed``, ``failed``) and times.

A rank writes its buffer as JSON to ``<dir>/tpu_dist_fr_rank<R>.json``, where
``<dir>`` is ``TPU_DIST_FLIGHT_RECORDER_DIR`` (default
``$TMPDIR/tpu_dist_flight_recorder-<uid>``, one per user):

* when a collective times out or a peer stops responding (the watchdog),
* on ``SIGUSR2`` (installed only if the signal had no handler),
* on demand: :func:`dump`.

Records are written so that no one else can use them to make the job overwrite a file. The
default directory is the user's own: created with mode 0700, and not used (the dump fails with
a ``PermissionError`` that says why) if it is a symbolic link, belongs to another user or others
can write to it, since anyone can create it first in a shared ``/tmp``. A directory named by
``TPU_DIST_FLIGHT_RECORDER_DIR`` or passed to :func:`dump` is the user's choice and is not
checked (it may be a shared directory that every host's ranks write to). In any directory a
record is first written to a new file of a random name, created with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` (so never through a link someone planted), with mode 0600, then renamed over the
record's name (which replaces a link there rather than writing through it); if the write fails
(a full disk), the new file is removed and the previous record stays.

The analyzer reads every rank's file of a directory and says, per group,
which ranks are behind (their last sequence number is lower) and where ranks
called different collectives at the same sequence number::

    python -m tpu_dist.collectives.flight_recorder          # the default directory
    python -m tpu_dist.collectives.flight_recorder DIR

The format is our own JSON, not the pickle of torch's NCCL flight recorder: torch 2.13's
analyzer (``torch.distributed.flight_recorder.fr_trace``) accepts only records whose profiling
name starts with one of its known libraries (``nccl:``, ``gloo:``, ``xccl:``, ...) and rejects
any other, so it could read these records only if they claimed to come from another backend.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import glob
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from tpu_dist import _settings

DIR_ENV = _settings.FLIGHT_RECORDER_DIR.env
SIZE_ENV = _settings.FLIGHT_RECORDER_SIZE.env
FORMAT_VERSION = 1


class FlightRecorder:
    """A ring buffer of collective entries (one per process; see the module docstring)."""

    def __init__(self, size: int, rank: int = -1) -> None:
        self.rank = rank
        self._entries: collections.deque[dict] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def record(
        self,
        group: str,
        group_ranks: Sequence[int],
        seq: int,
        op: str,
        blocks: Sequence[tuple[int, str]],
        params: tuple,
    ) -> dict:
        """Add a ``scheduled`` entry; returns it so its state can be updated."""
        entry = {
            "group": group,
            "group_ranks": list(group_ranks),
            "seq": seq,
            "op": op,
            "blocks": blocks,  # made JSON-shaped by entries(), off the collective's path
            "params": params,
            "state": "scheduled",
            "time_scheduled": time.time(),
            "time_finished": None,
            "error": None,
        }
        with self._lock:
            self._entries.append(entry)
        return entry

    @staticmethod
    def finish(entry: dict, error: BaseException | None = None) -> None:
        """Mark ``entry`` completed, or failed with ``error``."""
        entry["time_finished"] = time.time()
        if error is None:
            entry["state"] = "completed"
        else:
            entry["state"] = "failed"
            entry["error"] = str(error)

    def entries(self) -> list[dict]:
        """A copy of the buffered entries, oldest first."""
        with self._lock:
            entries = [dict(e) for e in self._entries]
        for entry in entries:
            entry["blocks"] = [list(b) for b in entry["blocks"]]
            entry["params"] = [str(p) for p in entry["params"]]
        return entries

    def dump(self, directory: str | None = None, reason: str = "on demand") -> str:
        """Write the buffer as JSON; returns the file's path.

        ``directory``: where to (default: :func:`default_dir`); the module doc says how the
        record is written and what is checked.

        Raises:
            PermissionError: the default directory is not this user's own (the message says
                whose it is and what to do).
            OSError: the record cannot be written (nothing new is left in the directory).
        """
        directory = directory or default_dir()
        private = directory == _default_private_dir()
        name = f"tpu_dist_fr_rank{self.rank}.json"
        record = {
            "version": FORMAT_VERSION,
            "rank": self.rank,
            "pid": os.getpid(),
            "reason": reason,
            "time": time.time(),
            "entries": self.entries(),
        }
        data = json.dumps(record).encode()
        dir_fd = _open_private_directory(directory) if private else _open_directory(directory)
        try:
            _write_new(dir_fd, name, data)
        finally:
            os.close(dir_fd)
        return os.path.join(directory, name)


def _open_directory(directory: str) -> int:
    """``directory`` (created with mode 0700 if missing), opened."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_private_directory(directory: str) -> int:
    """``directory``, created with mode 0700 if missing, opened without following a link, and
    checked after it is opened: this user's, and writable by no one else.

    Raises:
        PermissionError: it is not.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise PermissionError(
            f"not writing the flight record to {directory}: it is a symbolic link or not a "
            f"directory, and anyone can create it first in a shared temporary directory. "
            f"Remove it, or set {DIR_ENV} to a directory of your own."
        ) from None
    info = os.fstat(fd)
    uid = os.getuid()
    if info.st_uid != uid or info.st_mode & 0o022:
        os.close(fd)
        raise PermissionError(
            f"not writing the flight record to {directory}: it is owned by uid {info.st_uid} "
            f"(you are {uid}) with mode {info.st_mode & 0o7777:o}, so others could replace or "
            f"read records there. Remove it (it is created again, mode 0700), or set {DIR_ENV} "
            "to a directory of your own."
        )
    return fd


def _write_new(dir_fd: int, name: str, data: bytes) -> None:
    """Put ``data`` in file ``name`` of the directory open as ``dir_fd``, mode 0600: written to
    a new file of a random name (``O_EXCL | O_NOFOLLOW``), then renamed over ``name``. On any
    failure the new file is removed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)  # a network file system may report a failed write only here
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def default_dir() -> str:
    """``TPU_DIST_FLIGHT_RECORDER_DIR``, or ``$TMPDIR/tpu_dist_flight_recorder-<uid>`` (this
    user's own: :meth:`FlightRecorder.dump` checks it)."""
    return _settings.FLIGHT_RECORDER_DIR.read() or _default_private_dir()


def _default_private_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"tpu_dist_flight_recorder-{os.getuid()}")


_recorder = FlightRecorder(_settings.FLIGHT_RECORDER_SIZE.get())


def recorder() -> FlightRecorder:
    """This process's flight recorder."""
    return _recorder


def dump(directory: str | None = None) -> str:
    """Write this rank's flight record now; returns the file's path. Any rank may call it."""
    return _recorder.dump(directory)


def install_signal_handler(rank: int) -> None:
    """Set the recorder's rank and dump on SIGUSR2, unless the program handles SIGUSR2."""
    _recorder.rank = rank
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGUSR2, _dump_on_signal)


def _dump_on_signal(signum: int, frame: object) -> None:
    # An error raised here would surface in whatever the main thread was doing: print it.
    try:
        _recorder.dump(reason="SIGUSR2")
    except OSError as err:
        print(f"tpu_dist: SIGUSR2: flight record not written: {err}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The analyzer.


def load(directory: str) -> dict[int, dict]:
    """Every rank's dump in ``directory``, by rank.

    Raises:
        FileNotFoundError: the directory holds no ``tpu_dist_fr_rank*.json``.
    """
    paths = sorted(glob.glob(os.path.join(directory, "tpu_dist_fr_rank*.json")))
    if not paths:
        raise FileNotFoundError(
            f"no flight records (tpu_dist_fr_rank*.json) in {directory!r}; dumps go to "
            f"{DIR_ENV} or {default_dir()!r}."
        )
    dumps = {}
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        dumps[int(record["rank"])] = record
    return dumps


def _signature(entry: dict) -> str:
    blocks = ", ".join(f"{dtype}[{n}]" for n, dtype in entry["blocks"])
    params = f" {' '.join(entry['params'])}" if entry["params"] else ""
    return f"{entry['op']}{params} ({blocks})"


def analyze(dumps: dict[int, dict]) -> list[str]:
    """Findings, one line each: ranks behind, and mismatched calls per group."""
    findings: list[str] = []
    groups: dict[str, dict[int, dict[int, dict]]] = collections.defaultdict(dict)
    members: dict[str, list[int]] = {}
    for rank, record in dumps.items():
        for entry in record["entries"]:
            groups[entry["group"]].setdefault(rank, {})[entry["seq"]] = entry
            members[entry["group"]] = entry["group_ranks"]
    for group, by_rank in sorted(groups.items()):
        last = {rank: max(seqs) for rank, seqs in by_rank.items()}
        top = max(last.values())
        missing = [r for r in members[group] if r not in dumps]
        behind = {r: s for r, s in last.items() if s < top}
        if missing:
            findings.append(f"group {group!r}: no flight record from ranks {missing}")
        if behind:
            ahead = sorted(r for r, s in last.items() if s == top)
            detail = ", ".join(f"rank {r} at #{s}" for r, s in sorted(behind.items()))
            findings.append(
                f"group {group!r}: ranks {ahead} reached collective #{top} "
                f"({_signature(by_rank[ahead[0]][top])}); behind: {detail}"
            )
        common = set.intersection(*(set(seqs) for seqs in by_rank.values()))
        for seq in sorted(common):
            calls = {r: _signature(by_rank[r][seq]) for r in by_rank}
            if len(set(calls.values())) > 1:
                detail = "; ".join(f"rank {r}: {c}" for r, c in sorted(calls.items()))
                findings.append(f"group {group!r}: collective #{seq} differs between ranks: {detail}")
                break
        stuck = sorted(r for r, seqs in by_rank.items() if seqs[last[r]]["state"] == "scheduled")
        if stuck and not behind:
            findings.append(
                f"group {group!r}: collective #{top} ({_signature(by_rank[stuck[0]][top])}) "
                f"never completed on ranks {stuck}"
            )
    return findings


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tpu_dist.collectives.flight_recorder DIR``: print the findings."""
    parser = argparse.ArgumentParser(
        prog="python -m tpu_dist.collectives.flight_recorder",
        description="Read every rank's tpu_dist flight record in DIR and say which rank is "
        "behind or called a different collective.",
    )
    parser.add_argument("directory", nargs="?", default=default_dir())
    args = parser.parse_args(argv)
    try:
        dumps = load(args.directory)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"flight records of ranks {sorted(dumps)} in {args.directory}")
    findings = analyze(dumps)
    for line in findings:
        print(line)
    if not findings:
        print("no rank is behind and every rank called the same collectives")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
