"""What one benchmark run measures: :class:`BenchConfig`, built from flags and checked once.

Sizes are message sizes in bytes as nccl-tests counts them: the whole buffer of the op (the
gathered output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce,
broadcast or send). Each size is rounded down to a whole number of elements that splits evenly
over the ranks (at least one element per rank), so the size in the report can be a little below
the one asked for.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch

__all__ = [
    "BenchConfig",
    "DTYPES",
    "OP_ALIASES",
    "OPS",
    "format_bytes",
    "parse_bytes",
    "size_sweep",
]

OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "send_recv",
)
"""Every op the benchmark knows, by its torch.distributed function name (send_recv: a ring of
``batch_isend_irecv`` pairs, as nccl-tests' sendrecv)."""

OP_ALIASES: dict[str, str] = {
    "allreduce": "all_reduce",
    "ar": "all_reduce",
    "all_gather": "all_gather_into_tensor",
    "allgather": "all_gather_into_tensor",
    "ag": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "reducescatter": "reduce_scatter_tensor",
    "rs": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
    "alltoall": "all_to_all_single",
    "a2a": "all_to_all_single",
    "bcast": "broadcast",
    "sendrecv": "send_recv",
    "p2p": "send_recv",
}
"""Short names accepted by ``--ops``."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int8": torch.int8,
}
"""Element types ``--dtype`` accepts."""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_BYTES_RE = re.compile(r"^\s*(\d+)\s*([kmgKMG]?)(i?[bB])?\s*$")


def parse_bytes(text: str) -> int:
    """``"4K"``, ``"64MiB"``, ``"1m"``, ``"1024"`` -> bytes (binary units).

    Raises:
        ValueError: not a whole number with an optional K/M/G unit.
    """
    match = _BYTES_RE.match(text)
    if not match:
        raise ValueError(
            f"{text!r} is not a size in bytes; write a whole number with an optional binary "
            "unit, e.g. 1024, 4K, 64M, 1G"
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_bytes(n: int) -> str:
    """Bytes as the shortest exact binary unit: 1024 -> ``"1K"``, 3000 -> ``"3000"``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> tuple[int, ...]:
    """``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` (nccl-tests' ``-b -e -f``).

    Raises:
        ValueError: min above max, or a factor below 2.
    """
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes=} {max_bytes=}")
    if factor < 2:
        raise ValueError(f"the step factor must be >= 2, got {factor=}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return tuple(sizes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark run. Every rank gets the same config."""

    ops: tuple[str, ...] = OPS
    """Ops to measure, in this order (names from :data:`OPS`)."""
    backends: tuple[str, ...] = ("tpu", "gloo")
    """c10d backends measured side by side, alternating call blocks in one run. ``"tpu"`` is
    tpu_dist's backend (under whatever name ``import tpu_dist`` registered it)."""
    baseline: str | None = None
    """The backend ratios are taken against: ``gloo`` when measured, else the last backend."""
    sizes: tuple[int, ...] = size_sweep(1 << 10, 64 << 20, 8)
    """Message sizes in bytes (see the module docstring)."""
    dtype: str = "float32"
    """Element type (a key of :data:`DTYPES`); reductions are sums."""
    nproc: int = 2
    """Ranks to start (ignored when launched by torchrun / tpu-launch, which set the world)."""
    warmup: int = 3
    """Untimed calls per backend and size after the first call and before timing."""
    iters: int = 20
    """Timed calls per backend and size."""
    rounds: int = 5
    """Blocks the timed calls are split into; backends alternate block by block, so both see
    the same machine load. ``iters`` is rounded up to a multiple of it."""
    check: bool = True
    """Verify each op's result once per backend and size before timing it."""
    xla_baseline: bool = True
    """For the tpu backend, also time the bare XLA program (prebuilt arrays, no torch, no
    DLPack) to split the c10d call into program time and host overhead."""
    json_path: str | None = None
    """Where to write the JSON report (None: not written)."""
    plot_path: str | None = None
    """Where to write a PNG of bus bandwidth and time against size (needs matplotlib)."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective that takes longer fails the run."""
    progress: bool = True
    """Print a line per op and size to stderr while measuring."""

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ValueError(
                f"unknown ops {unknown} (or none given); use any of {', '.join(OPS)} or the "
                f"short names {', '.join(sorted(OP_ALIASES))}"
            )
        if not self.backends or len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends must be distinct and non-empty, got {self.backends}")
        if self.baseline is not None and self.baseline not in self.backends:
            raise ValueError(f"baseline {self.baseline!r} is not among backends {self.backends}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"sizes must be positive byte counts, got {self.sizes}")
        if self.nproc < 2:
            raise ValueError(f"nproc must be >= 2 (collectives need peers), got {self.nproc}")
        if self.warmup < 0 or self.iters < 1 or self.rounds < 1:
            raise ValueError(
                f"need warmup >= 0, iters >= 1, rounds >= 1, got {self.warmup=} {self.iters=} "
                f"{self.rounds=}"
            )

    @property
    def reference(self) -> str:
        """The backend ratios are taken against (see :attr:`baseline`)."""
        if self.baseline is not None:
            return self.baseline
        return "gloo" if "gloo" in self.backends else self.backends[-1]

    @property
    def per_round(self) -> int:
        """Timed calls per backend in one round."""
        return -(-self.iters // self.rounds)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type as a torch dtype."""
        return DTYPES[self.dtype]


def element_count(size: int, nproc: int, element_size: int) -> int:
    """Elements of a ``size``-byte buffer, rounded down to a multiple of ``nproc`` (>= nproc)."""
    count = size // element_size
    return max(nproc, count - count % nproc)


def canonical_ops(names: Sequence[str]) -> tuple[str, ...]:
    """Op names or aliases -> canonical names, in order, without repeats."""
    out: list[str] = []
    for name in names:
        key = name.strip().lower()
        op = OP_ALIASES.get(key, key)
        if op not in out:
            out.append(op)
    return tuple(out)
