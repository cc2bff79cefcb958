"""Run torch's own ``DistributedTest`` suite (shipped in the torch wheel) on a backend.

torch tests its c10d backends with ``torch/testing/_internal/distributed/distributed_test.py``,
driven by ``test/distributed/test_distributed_spawn.py`` in torch's repository (not in the
wheel). This script does what that driver does, for any backend name:

* sets the variables the suite reads when it is imported: ``BACKEND``, ``WORLD_SIZE``,
  ``TEMP_DIR`` (and ``INIT_METHOD``, default ``env://``; the tests themselves initialise with
  ``file://`` in ``TEMP_DIR``);
* registers the backend (``import tpu_dist``) and adds it to
  ``DistTestCases.backend_feature["plugin"]``, the set through which the suite's
  ``require_backend_is_available`` accepts a backend that is neither gloo, nccl, ucc nor mpi;
* defines ``TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase)``, whose
  ``setUp`` spawns ``WORLD_SIZE`` processes per test (each re-imports this file, so the
  backend is registered there too), and runs the selected tests with ``unittest``;
* adds it to ``backend_feature["ddp"]`` (the suite's DDP tests are gated on that set), and
  runs the tests of :data:`GLOO_NAMED`, which the suite gates on the backend's *name* being
  "gloo" for features "tpu" has, as if it were named so (:func:`_as_if_gloo`, the workaround).

Selection: by default the tests that apply to a CPU backend without DDP (names without
``ddp``, ``cuda``, ``gpu``, ``nccl``, ...): ``--ddp`` selects :data:`DDP_TESTS` instead (the
DDP tests that apply to a CPU backend), ``-k`` adds substrings a name must contain, ``--list``
prints the selection. Tests the suite marks skipped for the backend or world size when it is imported are left out (``--include-skipped``
runs them too); the summary line counts passed, failed and skipped tests separately.

Examples::

    python -m tests.torch_suite                       # tpu, 2 ranks, the non-DDP subset
    python -m tests.torch_suite --backend gloo        # the same tests on gloo, for reference
    python -m tests.torch_suite -k all_gather_coalesced      # names containing it
    python -m tests.torch_suite --test test_send_recv_any_source
    python -m tests.torch_suite --ddp --list
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import unittest


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=os.environ.get("BACKEND", "tpu"))
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 2)))
    parser.add_argument("-k", action="append", default=[], help="substring of test names")
    parser.add_argument("--test", action="append", default=[],
                        help="an exact test name (repeatable); overrides the selection")
    parser.add_argument("--ddp", action="store_true", help="select the DDP tests")
    parser.add_argument("--list", action="store_true", help="print the selected tests")
    parser.add_argument("--include-skipped", action="store_true",
                        help="also run the tests the suite skips for this backend")
    parser.add_argument("-v", action="store_true", help="one line per test")
    return parser.parse_known_args(argv)[0]


# The suite reads these at import time; worker processes (spawned) inherit them.
if __name__ == "__main__":
    _ARGS = _parse(sys.argv[1:])
    os.environ["BACKEND"] = _ARGS.backend
    os.environ["WORLD_SIZE"] = str(_ARGS.world_size)
os.environ.setdefault("BACKEND", "tpu")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="tpu_dist_torch_suite_"))
os.environ.setdefault("TPU_DIST_PLATFORM", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import tpu_dist  # noqa: E402,F401  (registers "tpu")
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

DistTestCases.backend_feature["plugin"].add(os.environ["BACKEND"])
# The suite gates its DDP tests on this set (nccl, gloo, ucc): DDP runs on any c10d backend.
DistTestCases.backend_feature["ddp"].add(os.environ["BACKEND"])

from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's DistributedTest, one set of spawned ranks per test (as torch's driver)."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


#: Tests the suite runs only when the backend is *named* "gloo" (or nccl/mpi), for features
#: "tpu" has: the skip reason torch gives, exactly (checked, so that a torch that gates the test
#: differently fails loudly here instead of running something else).
GLOO_NAMED = {
    # DDP with no_sync, and comm hooks calling group.allreduce([t]).get_future() (the body
    # takes its CPU branch only under BACKEND == "gloo")
    "test_accumulate_gradients_no_sync": "get_future is only supported on mpi, nccl and gloo",
    "test_accumulate_gradients_no_sync_grad_is_view":
        "get_future is only supported on mpi, nccl and gloo",
    "test_accumulate_gradients_no_sync_allreduce_hook":
        "get_future is only supported on mpi, nccl and gloo",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook":
        "get_future is only supported on mpi, nccl and gloo",
    "test_get_future": "get_future is only supported on mpi, nccl and gloo",
    # DDP, find_unused_parameters, different parameters used per rank
    "test_grads_same_across_ranks_with_no_sync": "Test requires backend {backend} to be one of "
        "{{'gloo'}}",
    "test_scatter_object_list": "Test requires backend {backend} to be one of {{'gloo'}}",
    # all_reduce_coalesced, every op, on the world, a group and the full group
    **{
        f"test_all_reduce_coalesced_{group}{op}":
            "Test requires backend {backend} to be one of {{'gloo'}}"
        for group in ("", "group_", "full_group_") for op in ("sum", "product", "min", "max")
    },
    # batch_isend_irecv of CPU tensors, with and without tags
    "test_batch_isend_irecv_gloo": "GLOO Batch Send Recv CPU",
    "test_batch_isend_irecv_gloo_tags": "GLOO Batch Send Recv CPU",
}


def _as_if_gloo(name: str) -> None:
    """Run ``name`` on this backend although the suite gates it on the name "gloo" (workaround).

    The suite decides ``BACKEND == "gloo"`` in two places: a skip decorator applied when it is
    imported, and sometimes the test body (``_test_accumulate_gradients_no_sync`` builds its
    CPU model only for "gloo" or "mpi"). So: the test function without the skip mark (after
    checking the skip's reason; the mark is all that decorator adds), with the suite's module-level
    ``BACKEND`` reading "gloo" while the body runs. The process group was created before,
    with the real backend (``TestDistBackend._run``), and every collective goes to it; nothing
    of torch.distributed is patched.
    """
    test = getattr(DistributedTest._DistTestBase, name)
    reason = GLOO_NAMED[name].format(backend=os.environ["BACKEND"])
    if getattr(test, "__unittest_skip_why__", None) != reason:
        raise RuntimeError(
            f"torch_suite: {name} is expected to be skipped with {reason!r} for backend "
            f"{os.environ['BACKEND']!r}, but its skip reason is "
            f"{getattr(test, '__unittest_skip_why__', None)!r}: update GLOO_NAMED for this torch"
        )
    body = test  # the skip only marked it (__unittest_skip__): the function is the body

    def run_as_if_gloo(self):  # noqa: ANN001, ANN202
        real = distributed_test.BACKEND
        distributed_test.BACKEND = "gloo"
        try:
            return body(self)
        finally:
            distributed_test.BACKEND = real

    run_as_if_gloo.__name__ = name
    setattr(TestDistBackendWithSpawn, name, run_as_if_gloo)


if os.environ["BACKEND"] != "gloo":
    for _name in GLOO_NAMED:
        _as_if_gloo(_name)

#: The DDP tests that apply to a CPU backend (``--ddp``); the suite's other DDP tests need
#: CUDA, several GPUs (``skip_if_lt_x_gpu``) or NCCL, or torchvision
#: (``test_SyncBatchNorm_process_group``).
DDP_TESTS = (
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",
    "test_dump_DDP_relevant_env_vars",
    "test_get_future",
    "test_grads_same_across_ranks_with_no_sync",
)

#: Name parts of the tests that are not part of the default (CPU, non-DDP) selection.
EXCLUDED = ("ddp", "DistributedDataParallel", "cuda", "gpu", "nccl", "SyncBatchNorm",
            "sync_bn", "post_localSGD", "_hook")


def selected(
    ddp: bool = False, parts: list[str] | None = None, include_skipped: bool = False
) -> list[str]:
    """Names of the tests of the selection (see the module docstring)."""
    names = sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_"))
    if ddp:
        names = list(DDP_TESTS)
    else:
        names = [n for n in names if not any(p.lower() in n.lower() for p in EXCLUDED)
                 and n not in DDP_TESTS]
    for part in parts or []:
        names = [n for n in names if part in n]
    if not include_skipped:
        # Tests the suite skips for this backend or world size (decided when it is imported)
        # would still spawn their ranks: leave them out.
        names = [n for n in names
                 if not getattr(getattr(TestDistBackendWithSpawn, n), "__unittest_skip__", False)]
    return names


class _Counting(unittest.TextTestResult):
    """A result that tells real skips (the suite's skip-but-pass) apart in its summary."""


def main(args: argparse.Namespace) -> int:
    names = args.test or selected(args.ddp, args.k, args.include_skipped)
    if args.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    start = time.monotonic()
    runner = unittest.TextTestRunner(verbosity=2 if args.v else 1, resultclass=_Counting)
    result = runner.run(suite)
    failed = {t.id().rsplit(".", 1)[-1] for t, _ in result.failures + result.errors}
    skipped = {t.id().rsplit(".", 1)[-1] for t, _ in result.skipped}
    passed = len(names) - len(failed) - len(skipped)
    print(
        f"torch DistributedTest on {os.environ['BACKEND']!r}, {os.environ['WORLD_SIZE']} ranks: "
        f"{passed} passed, {len(failed)} failed, {len(skipped)} skipped of {len(names)} "
        f"selected ({time.monotonic() - start:.0f} s)"
    )
    for name in sorted(failed):
        print(f"FAILED {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(_ARGS))
