"""TPU all-gather blocks padded to 128 elements compile where unaligned ones did not (E45).

Llama-3-70B on two ``v5p:8x8x8`` slices at dp 128 (tp 8 within a slice) all-gathers 1,950,000
bf16 elements a rank over 128 devices of both slices. libtpu 0.0.52's compiler took more than
8 GiB on that program and died (35-96 s); the same all-gather of 1,950,080 elements (a multiple
of 128) compiles in under a second. The "tpu" backend's plan now pads each rank's block
(``tpu_dist.collectives._plan.TPU_BLOCK_ALIGN``): its program must compile, in a child process
that may use at most 4 GiB (a compiler that grows past it dies there, not here).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libtpu", reason="TPU compilation needs libtpu (pip install libtpu)")

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = """
import resource, sys, time
import torch
from tpu_dist.collectives import _plan
from tpu_dist.collectives.compile_only import compile_collective, topology_devices
from tpu_dist.mesh import Topology

devices = topology_devices(Topology.parse("v5p:8x8x8", 2))[::8]  # dp: every 8th rank, both slices
group = _plan.GroupView(0, len(devices), tuple(d.id for d in devices), "tpu",
                        device_kind=devices[0].device_kind)
n = 1_950_000
plan = _plan.all_gather_into_tensor(group, torch.empty(n * len(devices), dtype=torch.bfloat16),
                                    torch.empty(n, dtype=torch.bfloat16))
start = time.monotonic()
result = compile_collective(plan.key, devices)
print(len(devices), plan.key.blocks, sorted({c.op for c in result.collectives}),
      round(time.monotonic() - start, 1))
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_cross_slice_all_gather_of_an_unaligned_block_compiles() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
        preexec_fn=_limit_memory,
    )
    assert proc.returncode == 0, (
        f"the program did not compile within 4 GiB (exit {proc.returncode}):\n"
        f"{proc.stderr[-2000:]}"
    )
    assert proc.stdout.startswith("128 ((1950080, 'int16'),) "), proc.stdout
    assert "all-gather" in proc.stdout, proc.stdout
