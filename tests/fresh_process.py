"""Run a script in a fresh interpreter and read the result it prints (for tests whose point
is a process of its own: its own devices, limits or environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

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


def cpu_devices_env(count: int, *, caches: bool = True) -> dict[str, str]:
    """This process's environment for a script that imports this checkout's tpu_dist and sees
    ``count`` JAX CPU devices in one process. With ``caches=False`` it compiles every program
    itself: tpu_dist's compile cache off and JAX's persistent cache unset."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"}
    if not caches:
        env["TPU_DIST_COMPILE_CACHE"] = "0"
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env
