"""jaxlib's gloo connection lines, left out of what a user reads.

The gloo inside jaxlib (XLA's CPU collectives) prints ``[Gloo] Rank N is connected to K peer
ranks. Expected number of connected peer ranks is : K`` with ``std::cout`` for every
communicator it connects, with no knob to turn it off: a line per group and rank on every "tpu"
job on CPU. Only that exact line with the two counts equal is left out; gloo's report of a peer
that did not connect (the counts differ) and everything else is kept.

* ``tpu-launch`` leaves them out where it reads its workers' output: the tails that copy each
  worker's stdout to the console (:func:`shows_line`; ``tpu_dist.launch._run``). Nothing runs
  inside a worker for it, so a line a worker printed before it was killed reaches the console.
* A process outside tpu-launch (``tpu-dist-bench``'s ranks) can route its own stdout through a
  filter: :func:`quiet_gloo_lines`.
"""

from __future__ import annotations

import os
import re
import sys

__all__ = ["quiet_gloo_lines", "shows_line"]

_CONNECTED = (
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)\n"
)
_LINE = re.compile(_CONNECTED + "?")
_IN_BYTES = re.compile(_CONNECTED.encode())
_HEAD = b"[Gloo] Rank "


def shows_line(line: str) -> bool:
    """Whether a line of a worker's stdout is shown: all but a healthy gloo connection line."""
    match = _LINE.fullmatch(line)
    return match is None or match.group(1) != match.group(2)


def _without_gloo_lines(buf: bytes) -> tuple[bytes, bytes]:
    """Splits ``buf`` into what to write now (healthy gloo lines removed) and a tail to hold: the
    start of a gloo line not yet complete. A gloo line may land in the middle of another line."""
    buf = _IN_BYTES.sub(lambda m: b"" if m.group(1) == m.group(2) else m.group(0), buf)
    start = buf.rfind(_HEAD)
    if start != -1 and b"\n" not in buf[start:]:
        return buf[:start], buf[start:]
    for k in range(min(len(_HEAD) - 1, len(buf)), 0, -1):
        if _HEAD.startswith(buf[-k:]):
            return buf[:-k], buf[-k:]
    return buf, b""


def quiet_gloo_lines() -> None:
    """Routes this process's fd 1 through a pipe whose reader (a thread of this process) drops
    the healthy gloo connection lines; every other byte passes unchanged. Undone at exit, after
    the program's last output. Call it once, early, in a process that will run "tpu"
    collectives on CPU outside tpu-launch (whose workers need nothing: the launcher filters).
    What the process wrote just before it is killed may not get through the pipe."""
    import atexit
    import threading

    sys.stdout.flush()
    real = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def write(data: bytes) -> None:
        while data:
            data = data[os.write(real, data):]

    def pump() -> None:
        held = b""
        while True:
            try:
                chunk = os.read(read_end, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                write(held)
                return
            now, held = _without_gloo_lines(held + chunk)
            write(now)

    thread = threading.Thread(target=pump, name="tpu-dist-stdout", daemon=True)
    thread.start()

    def restore() -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(real, 1)  # closes our write end of the pipe: the reader sees EOF and flushes
        thread.join(timeout=1.0)

    atexit.register(restore)
