"""The measured ops: buffers, one call, a result check, and nccl-tests' bandwidth formulas.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``). With ``S`` the message size in bytes (see
:mod:`._config`), ``t`` the time of one call and ``n`` the ranks:

* ``algbw = S / t``;
* ``busbw = algbw * factor``, the factor being what makes busbw comparable to the bandwidth of
  the slowest link whatever the op and ``n``:

  ============================ ============ ==============================================
  op                           factor       why
  ============================ ============ ==============================================
  all_reduce                   2 (n-1) / n  a reduce-scatter then an all-gather, each
                                            moving (n-1)/n of S in and out of every rank
  all_gather_into_tensor       (n-1) / n    S is the gathered output; a rank receives all
                                            but its own 1/n
  reduce_scatter_tensor        (n-1) / n    S is the input; a rank sends all but its 1/n
  all_to_all_single            (n-1) / n    a rank keeps 1/n of S and exchanges the rest
  broadcast                    1            every byte crosses each link of the tree/ring
  send_recv                    1            S leaves and S arrives on every rank
  ============================ ============ ==============================================

Example: all_reduce of 64 MiB on 4 ranks in 100 ms: algbw = 67.1 MB / 0.1 s = 0.671 GB/s,
busbw = 0.671 * 2 * 3/4 = 1.007 GB/s (GB = 1e9 bytes, as nccl-tests).

Every op is called the way a torch program calls it (``torch.distributed`` functions with
``group=``, ``async_op=True`` and ``wait()``), so the time includes everything the backend does
per call. send_recv is nccl-tests' sendrecv: rank ``r`` sends ``S`` to ``r+1`` and receives ``S``
from ``r-1`` (mod n) with one ``batch_isend_irecv``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from tpu_dist.mesh import BUS_FACTORS, bus_factor

__all__ = ["BUS_FACTORS", "OpCase", "bus_factor", "make_case"]


@dataclasses.dataclass
class OpCase:
    """One op at one size on one group: its buffers and how to call and check it."""

    op: str
    count: int
    """Elements of the message (S / element size)."""
    call: Callable[[], None]
    """Run the op once and wait for it."""
    fill: Callable[[], None]
    """Put rank-dependent values in the inputs, for :attr:`verify`."""
    verify: Callable[[], str | None]
    """After one :attr:`call` on filled inputs: None if the outputs are right, else what is wrong."""
    clear: Callable[[], None]
    """Zero every buffer (timed calls run on zeros, so repeated sums stay finite)."""


# torch 2.13 deprecates the *_tensor names in favour of *_single (same c10d method, same op).
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _waiter(works: list[dist.Work] | dist.Work | None) -> None:
    if works is None:
        return
    for work in works if isinstance(works, list) else [works]:
        work.wait()


def _mismatch(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if torch.equal(got.float(), want.float()):
        return None
    bad = (got.float() != want.float()).nonzero()[0].item()
    return f"{what}[{bad}] = {got[bad].item()}, expected {want[bad].item()}"


def _full(numel: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((numel,), value, dtype=dtype)


def _all_reduce_case(
    group: dist.ProcessGroup, r: int, n: int, count: int, dtype: torch.dtype
) -> OpCase:
    t = torch.zeros(count, dtype=dtype)
    return OpCase(
        "all_reduce",
        count,
        call=lambda: _waiter(dist.all_reduce(t, group=group, async_op=True)),
        fill=lambda: t.fill_(r + 1),
        verify=lambda: _mismatch("out", t, _full(count, n * (n + 1) // 2, dtype)),
        clear=t.zero_,
    )


def _all_gather_case(
    group: dist.ProcessGroup, r: int, n: int, count: int, dtype: torch.dtype
) -> OpCase:
    chunk = count // n
    inp, out = torch.zeros(chunk, dtype=dtype), torch.zeros(count, dtype=dtype)
    want = torch.arange(1, n + 1, dtype=dtype).repeat_interleave(chunk)
    return OpCase(
        "all_gather_into_tensor",
        count,
        call=lambda: _waiter(_ALL_GATHER(out, inp, group=group, async_op=True)),
        fill=lambda: inp.fill_(r + 1),
        verify=lambda: _mismatch("out", out, want),
        clear=lambda: (inp.zero_(), out.zero_()),
    )


def _reduce_scatter_case(
    group: dist.ProcessGroup, r: int, n: int, count: int, dtype: torch.dtype
) -> OpCase:
    chunk = count // n
    inp, out = torch.zeros(count, dtype=dtype), torch.zeros(chunk, dtype=dtype)
    return OpCase(
        "reduce_scatter_tensor",
        count,
        call=lambda: _waiter(_REDUCE_SCATTER(out, inp, group=group, async_op=True)),
        fill=lambda: inp.fill_(r + 1),
        verify=lambda: _mismatch("out", out, _full(chunk, n * (n + 1) // 2, dtype)),
        clear=lambda: (inp.zero_(), out.zero_()),
    )


def _all_to_all_case(
    group: dist.ProcessGroup, r: int, n: int, count: int, dtype: torch.dtype
) -> OpCase:
    chunk = count // n
    inp, out = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
    # Chunk j of rank r's input is r*n + j + 1; rank r receives chunk r of every rank i.
    sent = (torch.arange(n, dtype=torch.float32) + r * n + 1).repeat_interleave(chunk)
    want = (torch.arange(n, dtype=torch.float32) * n + r + 1).repeat_interleave(chunk)
    return OpCase(
        "all_to_all_single",
        count,
        call=lambda: _waiter(dist.all_to_all_single(out, inp, group=group, async_op=True)),
        fill=lambda: inp.copy_(sent),
        verify=lambda: _mismatch("out", out, want.to(dtype)),
        clear=lambda: (inp.zero_(), out.zero_()),
    )


def _broadcast_case(
    group: dist.ProcessGroup, r: int, n: int, count: int, dtype: torch.dtype
) -> OpCase:
    t = torch.zeros(count, dtype=dtype)
    return OpCase(
        "broadcast",
        count,
        call=lambda: _waiter(dist.broadcast(t, src=0, group=group, async_op=True)),
        fill=lambda: t.fill_(r + 1),
        verify=lambda: _mismatch("out", t, _full(count, 1, dtype)),
        clear=t.zero_,
    )


def _send_recv_case(
    group: dist.ProcessGroup, r: int, n: int, count: int, dtype: torch.dtype
) -> OpCase:
    send, recv = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
    to, frm = (r + 1) % n, (r - 1) % n
    peer_to = dist.get_global_rank(group, to)
    peer_from = dist.get_global_rank(group, frm)

    def call() -> None:
        ops = [
            dist.P2POp(dist.isend, send, peer_to, group),
            dist.P2POp(dist.irecv, recv, peer_from, group),
        ]
        _waiter(dist.batch_isend_irecv(ops))

    return OpCase(
        "send_recv",
        count,
        call=call,
        fill=lambda: send.fill_(r + 1),
        verify=lambda: _mismatch("recv", recv, _full(count, frm + 1, dtype)),
        clear=lambda: (send.zero_(), recv.zero_()),
    )


_CASES: dict[str, Callable[..., OpCase]] = {
    "all_reduce": _all_reduce_case,
    "all_gather_into_tensor": _all_gather_case,
    "reduce_scatter_tensor": _reduce_scatter_case,
    "all_to_all_single": _all_to_all_case,
    "broadcast": _broadcast_case,
    "send_recv": _send_recv_case,
}
"""Each op's buffers and calls, made from ``(group, rank, nranks, count, dtype)``."""


def make_case(
    op: str, group: dist.ProcessGroup, rank: int, nranks: int, count: int, dtype: torch.dtype
) -> OpCase:
    """Buffers and calls for ``op`` moving ``count`` elements over ``group``.

    ``rank`` is this process's rank in ``group`` (= its global rank: groups span the world).
    """
    if op not in _CASES:
        raise ValueError(f"unknown op {op!r}")
    return _CASES[op](group, rank, nranks, count, dtype)
