"""The flight recorder: each rank's last collectives, dumped when something goes wrong.

Every "tpu" collective appends an entry to a per-process ring buffer (the last
``TPU_DIST_FLIGHT_RECORDER_SIZE`` calls, default 2000): its group, its
sequence number in that group, the op, the block sizes and dtypes, the reduce
op or root, its state (``scheduled``, ``completed``, ``failed``) and times.

A rank writes its buffer as JSON to ``<dir>/tpu_dist_fr_rank<R>.json``, where
``<dir>`` is ``TPU_DIST_FLIGHT_RECORDER_DIR`` (default
``$TMPDIR/tpu_dist_flight_recorder``):

* when a collective times out or a peer stops responding (the watchdog),
* on ``SIGUSR2`` (installed only if the signal had no handler),
* on demand: :func:`dump`.

The analyzer reads every rank's file of a directory and says, per group,
which ranks are behind (their last sequence number is lower) and where ranks
called different collectives at the same sequence number::

    python -m tpu_dist.collectives.flight_recorder /tmp/tpu_dist_flight_recorder

The format is our own JSON, not the pickle of torch's NCCL flight recorder: torch 2.13's
analyzer (``torch.distributed.flight_recorder.fr_trace``) accepts only records whose profiling
name starts with one of its known libraries (``nccl:``, ``gloo:``, ``xccl:``, ...) and rejects
any other, so it could read these records only if they claimed to come from another backend.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
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
        """Write the buffer as JSON; returns the file's path."""
        directory = directory or default_dir()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"tpu_dist_fr_rank{self.rank}.json")
        record = {
            "version": FORMAT_VERSION,
            "rank": self.rank,
            "pid": os.getpid(),
            "reason": reason,
            "time": time.time(),
            "entries": self.entries(),
        }
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
        return path


def default_dir() -> str:
    """``TPU_DIST_FLIGHT_RECORDER_DIR``, or ``$TMPDIR/tpu_dist_flight_recorder``."""
    return _settings.FLIGHT_RECORDER_DIR.read() or os.path.join(
        tempfile.gettempdir(), "tpu_dist_flight_recorder"
    )


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
        signal.signal(signal.SIGUSR2, lambda signum, frame: _recorder.dump(reason="SIGUSR2"))


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
