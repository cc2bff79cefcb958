"""A call that torch itself rejects on one rank, before any backend sees it, then an all_reduce
(tests/test_rejected_by_torch.py). Run under torchrun: ``python rejected_by_torch_job.py
BACKEND CASE``. Each rank prints one JSON line per call: how it ended (``"returned"`` with the
all_reduce's values, or the exception's type and message). A rank the backend ends prints
nothing more."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT_S = 5


def bad_call(case: str, rank: int) -> None:
    """Valid on rank 1; on rank 0 torch raises before calling the backend."""
    if case == "gather_list_missing_on_dst":
        dist.gather(torch.ones(3), None, dst=0)  # torch: gather_list must be given on dst
    elif case == "unpicklable_object_on_src":
        dist.broadcast_object_list([(lambda: 0) if rank == 0 else None], src=0)
    else:
        raise AssertionError(case)


def report(rank: int, call: str, fn) -> None:
    try:
        out = fn()
        line = {"rank": rank, "call": call, "outcome": "returned", "values": out}
    except Exception as err:  # noqa: BLE001 - the outcome is the point
        line = {"rank": rank, "call": call, "outcome": type(err).__name__, "message": str(err)[:500]}
    print(json.dumps(line), flush=True)


def main() -> None:
    backend, case = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    report(rank, "bad", lambda: bad_call(case, rank))

    def all_reduce():
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x)
        return x.tolist()

    report(rank, "all_reduce", all_reduce)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
