"""TPU all-gather blocks padded to 128 elements compile where unaligned ones did not.

Measured: docs/decisions/0022-tpu-block-alignment.md.

Llama-3-70B on two ``v5p:8x8x8`` slices at dp 128 (tp 8 within a slice) all-gathers 1,950,000
bf16 elements a rank over 128 devices of both slices. libtpu's compiler (docs/reference/libtpu.md)
took more than
8 GiB on that program and died (35-96 s); the same all-gather of 1,950,080 elements (a multiple
of 128) compiles in under a second, 1,950,720 (of 1,024) in about 3 s. The "tpu" backend's
plan now pads each rank's all-gather block to a multiple of 1,024 on v5p
(``tpu_dist.collectives._plan_algorithms.tpu_block_align``): its program must compile, in a child process
that may map at most 4 GiB more than its import of torch did (a compiler that grows past it dies
there, not here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libtpu", reason="TPU compilation needs libtpu (pip install libtpu)")

ROOT = Path(__file__).resolve().parents[1]

# Each child first limits its own address space (after importing torch, before libtpu loads):
# a compiler that grows past 4 GiB more than torch's import mapped dies there, not in the test
# process. (A CUDA build of torch, as PyPI's 2.14 and 2.15 are, maps ~3 GB of libraries at
# import, ~2.5 GB more than the CPU build, almost none of it ever touched: under a flat 4 GiB
# the compile below failed to allocate on torch 2.15.)
_LIMIT = """
import resource
import torch
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (4 << 30), mapped + (4 << 30)))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
"""

_COMPILE = _LIMIT + """
import time
import torch
from tpu_dist.collectives import _plan, _plan_collectives
from tpu_dist.collectives.compile_only import compile_collective, topology_devices
from tpu_dist.mesh import Topology

devices = topology_devices(Topology.parse("v5p:8x8x8", 2))[::8]  # dp: every 8th rank, both slices
group = _plan.GroupView(0, len(devices), tuple(d.id for d in devices), "tpu",
                        device_kind=devices[0].device_kind)
n = 1_950_000
plan = _plan_collectives.all_gather_into_tensor(group, torch.empty(n * len(devices), dtype=torch.bfloat16),
                                    torch.empty(n, dtype=torch.bfloat16))
start = time.monotonic()
result = compile_collective(plan.key, devices)
print(len(devices), plan.key.blocks, sorted({c.op for c in result.collectives}),
      round(time.monotonic() - start, 1))
"""


_IN_SLICE = _LIMIT + """
import torch
from tpu_dist.collectives import _plan, _plan_collectives
from tpu_dist.collectives.compile_only import compile_collective, topology_devices
from tpu_dist.mesh import Topology

for spec in ("v4:2x2x2", "v5e:4x4", "v6e:4x4", "v5p:2x2x2"):
    devices = topology_devices(Topology.parse(spec))
    group = _plan.GroupView(0, len(devices), tuple(d.id for d in devices), "tpu",
                            device_kind=devices[0].device_kind)
    n = 1_000_064  # a multiple of 128, not of 1,024
    plan = _plan_collectives.all_gather_into_tensor(
        group, torch.empty(n * len(devices), dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16))
    result = compile_collective(plan.key, devices)
    print(spec, plan.key.blocks[0][0], [c.op for c in result.collectives])
"""


def test_cross_slice_all_gather_of_an_unaligned_block_compiles() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, (
        f"the program did not compile within 4 GiB beyond torch (exit {proc.returncode}):\n"
        f"{proc.stderr[-2000:]}"
    )
    assert proc.stdout.startswith("128 ((1950720, 'int16'),) "), proc.stdout
    assert "all-gather" in proc.stdout, proc.stdout


def test_an_all_gather_block_is_a_multiple_of_1024_on_every_generation() -> None:
    """Whole-slice all-gathers of 1,000,064 bf16 elements a rank (a multiple of 128): on v4, v5e
    and v6e libtpu took 16-33 s and 1.1-1.3 GiB on that block, and 0.4-1.4 s on 1,000,448
    (docs/decisions/0022-tpu-block-alignment.md); the plan pads to 1,000,448 on each generation,
    and each program is one all-gather."""
    proc = subprocess.run(
        [sys.executable, "-c", _IN_SLICE], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["v4:2x2x2", "v5e:4x4", "v6e:4x4", "v5p:2x2x2"]
    for line in lines:
        assert line.split(" ", 1)[1] == "1000448 ['all-gather']", line
