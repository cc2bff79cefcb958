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
    private_in = _jaxlib.dlpack_import(t, device)
    private_out = _jaxlib.dlpack_export(private_in)
    key = ProgramKey("allreduce", (device.id,), ((6, "float32"),), ("SUM",), "xla")
    private_run = _lowering.run(key, [device], [private_in])
    out["private_execute"] = _lowering.program(key, [device]).execute is not None
    out["before"] = list(warnings)

    _jaxlib._dlpack_import = broken
    _jaxlib._dlpack_export = broken
    _jaxlib._collect_garbage = None
    found = _lowering.program(key, [device])
    _lowering._programs[key] = _lowering._Program(found.compiled, broken)
    for _ in range(2):  # the second time logs nothing new
        public_in = _jaxlib.dlpack_import(t, device)
        public_out = _jaxlib.dlpack_export(public_in)
        public_run = _lowering.run(key, [device], [public_in])
        _jaxlib.collect_garbage()
    out["same"] = [
        torch.equal(private_out, public_out),
        torch.equal(_jaxlib.dlpack_export(private_run[0]), _jaxlib.dlpack_export(public_run[0])),
        public_out.tolist() == t.tolist(),
    ]
    out["execute_after"] = _jaxlib.loaded_execute(found.compiled) is None
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
