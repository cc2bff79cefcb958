"""Small CPU programs compile for a short compilation, and compute the same bits.

``tpu_dist.collectives._lowering.compiler_options`` gives a CPU program whose blocks times its
group size hold at most ``FAST_COMPILE_MAX_BYTES`` XLA:CPU's fast-compile options (older fusion
code generator, no LLVM optimization), 2-5x less compilation
(docs/decisions/0007-fast-compile-for-small-cpu-programs.md). The
backend's correctness tests (``test_collectives_*``) run through them; here, one process with
four CPU devices compiles each kind of program both ways and runs both on the same random data:
the outputs must be the same bits, and the fast options must be the ones chosen.
"""

from __future__ import annotations

import textwrap

from tests.fresh_process import cpu_devices_env, script_result
from tpu_dist.collectives import ProgramKey
from tpu_dist.collectives._lowering import (
    CPU_FAST_COMPILE_OPTIONS,
    FAST_COMPILE_MAX_BYTES,
    compiler_options,
)



class _Cpu:  # what compiler_options reads of a jax.Device
    platform = "cpu"
    device_kind = "cpu"


def test_small_cpu_programs_get_the_fast_options_and_large_ones_none() -> None:
    devices = [_Cpu()] * 4
    limit = FAST_COMPILE_MAX_BYTES // 4  # bytes of blocks for a group of 4

    def key(*blocks: tuple[int, str], kind: str = "allreduce", groups: int = 1) -> ProgramKey:
        return ProgramKey(kind, tuple(range(4 * groups)), blocks, ("SUM", None), "exchange",
                          groups)

    assert compiler_options(devices, key((limit // 4, "float32"))) == CPU_FAST_COMPILE_OPTIONS
    assert compiler_options(devices, key((limit // 4 + 1, "float32"))) == {}
    # Every block counts, at its dtype's size.
    assert compiler_options(devices, key((limit // 8, "float64"))) == CPU_FAST_COMPILE_OPTIONS
    assert compiler_options(devices, key((limit // 8, "float32"), (limit // 8 + 1, "float32"))) == {}
    # A family program's blocks are one group's (the group size is what counts, not the family).
    family = ProgramKey("allreduce", tuple(range(8)), ((limit // 4, "float32"),), ("SUM", None),
                        "exchange", 2)
    assert compiler_options([_Cpu()] * 8, family) == CPU_FAST_COMPILE_OPTIONS
    assert compiler_options(devices) == {}  # no key: XLA's defaults


_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from tpu_dist.collectives import _jaxlib, _lowering
    from tpu_dist.collectives._types import ProgramKey

    devices = jax.devices("cpu")
    size = len(devices)
    mesh, sharding = _lowering.mesh_of(devices, 1)
    rng = np.random.default_rng(7)
    cases = [
        ("allreduce", "exchange", ("SUM", None), "float32"),
        ("allreduce", "exchange", ("AVG", None), "bfloat16"),
        ("allreduce", "exchange", ("MAX", None), "int32"),
        ("allreduce", "gather_reduce", ("PRODUCT", None), "float64"),
        ("allreduce", "gather_reduce", ("BXOR", None), "int64"),
        ("allreduce", "xla", ("PREMUL_SUM", 0.37), "float32"),
        ("reduce_scatter", "exchange", ("SUM", None), "float16"),
        ("reduce_scatter", "exchange", ("MIN", None), "float32"),
        ("allgather", "exchange", (), "bfloat16"),
        ("alltoall", "xla", (), "float32"),
        ("broadcast", "xla", (2,), "int32"),
        ("permute", "xla", ((0, 1), (1, 2), (2, 3), (3, 0)), "float32"),
    ]
    out = []
    for kind, algorithm, params, dtype in cases:
        n = 500  # 4 KB a float64 block: 16,000 bytes over the group, at most the limit
        key = ProgramKey(kind, tuple(d.id for d in devices), ((n, dtype),), params, algorithm)
        chosen = _lowering.compiler_options(devices, key)
        lowered = _lowering.lower(key, devices)
        with _jaxlib.x64_scope():
            fast = _lowering.compile_lowered(lowered, devices, key)
            default = lowered.compile()
            data = rng.standard_normal(size * n) * 1000
            if dtype.startswith("int"):
                data = data.round()
            x = jax.device_put(data.astype(jax.numpy.dtype(dtype)), sharding)
            a = np.asarray(fast(x)[0])
            b = np.asarray(default(x)[0])
        out.append({"case": f"{kind}/{algorithm}/{params}/{dtype}", "fast": chosen,
                    "same_bits": a.tobytes() == b.tobytes(),
                    "nonzero": bool(np.any(a != 0))})
    print("RESULT" + json.dumps(out))
    """
)


def test_fast_compiled_programs_give_the_same_bits_as_xlas_defaults() -> None:
    env = cpu_devices_env(4, caches=False)
    results = script_result(_SCRIPT, env=env, timeout=180)
    assert len(results) == 12
    for row in results:
        assert row["fast"] == CPU_FAST_COMPILE_OPTIONS, row
        assert row["same_bits"] and row["nonzero"], row
