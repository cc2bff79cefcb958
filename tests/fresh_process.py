"""Run a script in a fresh interpreter and read the result it prints (for tests whose point
is a process of its own: its own devices, limits or environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

PREFIX = "RESULT"
"""The script prints ``RESULT`` followed by its result as JSON, on one line of stdout."""


def script_result(script: str, *args: str, env: Mapping[str, str], timeout: float) -> Any:
    """``python -c script ARGS`` with ``env``: the JSON of the last line of its stdout that
    starts with :data:`PREFIX`. Fails the test, with the tail of its stderr, if it exits with
    a non-zero code or prints no such line."""
    proc = subprocess.run([sys.executable, "-c", script, *args], env=dict(env),
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len(PREFIX):])
