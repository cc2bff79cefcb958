"""``tpu-launch --compile-only`` without libtpu: one clear error, nothing blamed on the script
(issue 34, item 7a).

libtpu stays installed: the launch runs with a ``sitecustomize`` first on ``PYTHONPATH`` whose
``sys.meta_path`` finder refuses ``import libtpu`` (how tpu_dist finds out whether libtpu is
there: ``tpu_dist.collectives.compile_only.topology_devices``), in the launcher and in the
compile-only process it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.launch_worker import REPO, clean_env

_BLOCKER = '''
import sys


class _NoLibtpu:
    """As if libtpu were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "libtpu" or name.startswith("libtpu."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoLibtpu())
'''

_SCRIPT = '''
import torch, torch.distributed as dist
dist.init_process_group("tpu")
t = torch.ones(8)
dist.all_reduce(t)
dist.destroy_process_group()
'''


def _env_without_libtpu(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "nolibtpu"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_BLOCKER)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), env["PYTHONPATH"]])
    return env


def test_blocker_hides_libtpu(tmp_path: Path) -> None:
    """The simulation itself: ``import libtpu`` fails under it (and only under it)."""
    env = _env_without_libtpu(tmp_path)
    probe = [sys.executable, "-c", "import libtpu"]
    assert subprocess.run(probe, env=env, capture_output=True, check=False).returncode != 0
    plain = subprocess.run(probe, env=clean_env(), capture_output=True, check=False)
    assert plain.returncode == 0, (
        "libtpu is not installed here: the test needs it to be hidden, not absent"
    )


def test_compile_only_without_libtpu_gives_one_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_dist.launch", "--emulate", "v5p:2x2x2", "--compile-only",
         str(script)],
        cwd=REPO,
        env=_env_without_libtpu(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    err = proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n--- stderr\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        (
            "tpu-launch --compile-only: error: compile-only mode: compile-only TPU devices need "
            "libtpu: pip install 'tpu-dist[tpu-compile]' (or pip install libtpu); nothing was run"
        )
    ], err
