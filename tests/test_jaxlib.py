"""tpu_dist.collectives._jaxlib: each private jaxlib call has a public fallback, logged once.

One process of its own (JAX's CPU backend, no distributed runtime): the private calls are
forced to fail as a jaxlib with another signature would make them fail, and the results are
compared with what the private calls gave.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json, logging
    import jax, torch
    from tpu_dist.collectives import _jaxlib, _lowering
    from tpu_dist.collectives._lowering import ProgramKey

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("tpu_dist.collectives._jaxlib").addHandler(Collect())
    device = jax.devices("cpu")[0]

    def broken(*args, **kwargs):
        raise TypeError("a changed signature")

    out = {}
    t = torch.arange(6, dtype=torch.float32)
    calls = _jaxlib.JaxlibCalls()
    private_in = calls.dlpack_import(t, device)
    private_out = calls.dlpack_export(private_in)
    key = ProgramKey("allreduce", (device.id,), ((6, "float32"),), ("SUM",), "xla")
    programs = _lowering.ProgramCache(calls)
    private_run = programs.run(key, [device], [private_in])
    out["private_execute"] = programs.program(key, [device]).execute is not None
    out["before"] = list(warnings)

    calls.import_call = broken
    calls.export_call = broken
    _jaxlib._collect_garbage = None
    found = programs.program(key, [device])
    programs.by_key[key] = _lowering.Program(found.compiled, broken)
    for _ in range(2):  # the second time logs nothing new
        public_in = calls.dlpack_import(t, device)
        public_out = calls.dlpack_export(public_in)
        public_run = programs.run(key, [device], [public_in])
        _jaxlib.collect_garbage()
    out["same"] = [
        torch.equal(private_out, public_out),
        torch.equal(calls.dlpack_export(private_run[0]), calls.dlpack_export(public_run[0])),
        public_out.tolist() == t.tolist(),
    ]
    out["execute_after"] = calls.loaded_execute(found.compiled) is None
    out["after"] = warnings[len(out["before"]):]
    print(json.dumps(out))
    """
)


def test_forced_fallbacks_give_the_same_results_and_are_logged_once() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == [] and out["private_execute"], out
    assert out["same"] == [True, True, True], out
    assert out["execute_after"], out
    after = out["after"]
    assert len(after) == 4, after  # one line per private call, not one per use
    for name in ("from_dlpack", "torch.from_dlpack", "Compiled.__call__", "garbage collector"):
        assert sum(name in line for line in after) >= 1, (name, after)
    assert all("a changed signature" in line for line in after if "garbage" not in line), after


_COMPILE_ONLY_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    from tpu_dist.collectives import ProgramKey
    from tpu_dist.collectives.compile_only import compile_collective, topology_devices
    from tpu_dist.mesh import Topology

    devices = topology_devices(Topology.create("v5e", (2, 2)))
    key = ProgramKey("allreduce", tuple(d.id for d in devices), ((256, "float32"),), ("SUM",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compile_collective(key, devices)
    print(len(os.listdir(sys.argv[1])), len(caught))
    """
)


def test_compile_only_programs_stay_out_of_jaxs_persistent_cache(tmp_path) -> None:
    """JAX writes a compile-only executable to its persistent cache but cannot load it back
    (it warns on every later read); compile_collective keeps them out. Checked against the
    same compile without the scope, which does write an entry."""
    import os

    import pytest

    from tests.launch_worker import clean_env

    pytest.importorskip("libtpu")

    def run(script: str, cache: str) -> list[int]:
        env = clean_env({"JAX_COMPILATION_CACHE_DIR": cache,
                         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
        proc = subprocess.run([sys.executable, "-c", script, cache], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [int(v) for v in proc.stdout.split()[-2:]]

    ours, plain = tmp_path / "ours", tmp_path / "plain"
    ours.mkdir()
    plain.mkdir()
    assert run(_COMPILE_ONLY_SCRIPT, str(ours)) == [0, 0]
    without_scope = _COMPILE_ONLY_SCRIPT.replace(
        "import os, sys, warnings",
        "import os, sys, warnings, contextlib\n"
        "from tpu_dist.collectives import _jaxlib\n"
        "_jaxlib.uncached = contextlib.nullcontext",
    )
    entries, warned = run(without_scope, str(plain))
    assert entries >= 1 and warned >= 1, (entries, warned)
    assert os.listdir(ours) == []
