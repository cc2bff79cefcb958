"""``tpu-dist-bench``: a collective benchmark for torch.distributed backends, after nccl-tests.

``tpu-dist-bench`` (also ``python -m tpu_dist.bench``) starts ``--nproc`` ranks on this machine
(2 by default) and, for each op and message size, times every backend of ``--backends`` (default
``tpu,gloo``) in the same processes, alternating blocks of calls so that all backends see the
same machine load, and prints one table line per size::

    tpu-dist-bench                                         # all ops, 1K..64M, tpu vs gloo
    tpu-dist-bench -n 4 --ops all_reduce --sizes 4K,64M --json ar.json --plot ar.png
    torchrun --nproc-per-node 8 -m tpu_dist.bench --backends tpu      # ranks from the launcher

Ops: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, broadcast,
send_recv (a ring of ``batch_isend_irecv`` as nccl-tests' sendrecv), each called through the
public ``torch.distributed`` function with ``async_op=True`` then ``wait()``.

What is measured, per op, size and backend (all ranks run the same sequence):

1. first call, timed: for tpu it traces and compiles the op's XLA programs; the number of
   programs compiled comes from :func:`tpu_dist.collectives.compile_count`;
2. a result check (rank-dependent inputs, one call; ``--no-check`` skips it), then ``--warmup``
   calls; for tpu any compilation after the first call is counted as *steady-state
   compilations*, which must stay 0;
3. ``--iters`` timed calls in ``--rounds`` blocks; within a round each backend (and, for tpu,
   the bare XLA program) runs one block after a barrier on a separate gloo group, the order
   rotating every round;
4. a call's time runs from the call to the end of ``wait()`` on each rank, averaged over ranks
   (call ``i`` on every rank is the same collective); the table shows the median over calls and
   ``+-`` = half the p10..p90 range relative to it; the JSON also has p10, p90, min, max, mean.

Columns: ``algbw = S / t`` and ``busbw = algbw * factor`` with nccl-tests' factors (all_reduce
``2(n-1)/n``; all_gather, reduce_scatter, all_to_all ``(n-1)/n``; broadcast, send_recv 1), ``S``
the whole buffer (the gathered output, the reduce-scatter input), GB/s = 1e9 B/s. ``xla`` is the
same data movement as one bare jitted program on prebuilt JAX arrays, and ``host`` the tpu call
minus it: the time the backend spends outside the XLA program (DLPack hand-off, global-array
construction, dispatch, the Work, copying results into the outputs). The last columns are each
backend's median time over the reference backend's (``--baseline``, gloo by default):
``tpu/gloo`` above 1 means tpu is slower. Under each op, a summary gives per backend the
first-call times, programs compiled, and the median host overhead.

On TPU devices the table adds ``%exp``: measured busbw over the topology model's bound from
:mod:`tpu_dist.mesh` (per-generation ICI link and DCN bandwidths; the model is in
:mod:`tpu_dist.mesh._bandwidth`'s docstring, e.g. 600 GB/s for an all_reduce over a v5p 4x4x4).

Output: the table on stdout (a line per size as it is measured; progress on stderr unless
``-q``), ``--json PATH`` for the full report (schema ``tpu_dist.bench/1``: config, environment
with versions and load average, one entry per op/size/backend), ``--plot PATH`` for a PNG of
time and busbw against size. ``--plot`` needs matplotlib, an optional extra that tpu_dist does
not install (``pip install matplotlib``). Exit status: 0, or 1 if any op returned wrong values.

Timings on a shared CPU machine are noisy: compare backends only within one run (the ratio
columns), never across runs.
"""

from __future__ import annotations

from tpu_dist.bench._cli import launch, main
from tpu_dist.bench._config import OPS, BenchConfig
from tpu_dist.mesh import Expectation, expected_busbw
from tpu_dist.bench._ops import bus_factor

__all__ = ["OPS", "BenchConfig", "Expectation", "bus_factor", "expected_busbw", "launch", "main"]
