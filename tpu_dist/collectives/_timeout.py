"""Changing a group's timeout after it was created, on every torch the package supports."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from tpu_dist.collectives._checks import check_timeout


def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Change a group's timeout for its later collectives (the watchdog's deadline).

    On torch 2.14 and later ``torch.distributed.set_timeout(timeout, group)`` does the same on a
    "tpu" group (it calls :meth:`ProcessGroupTPU.set_timeout`). torch 2.13 has no public
    ``set_timeout``, and its private ``distributed_c10d._set_pg_timeout`` reaches only gloo and
    NCCL backends (on a tpu_dist group it warns "Set timeout is now only supported for either
    nccl or gloo" and changes nothing): there call this. On a group of another backend it calls
    torch's helper. Collectives already issued keep the deadline they started with.

    Local to the calling rank: each rank of the group that should use the new deadline calls
    it (normally all of them, at the same point of the program). Nothing is communicated.

    Args:
        timeout: the new timeout, positive.
        group: the group; default: the default group.

    Raises:
        TypeError: ``timeout`` is not a ``datetime.timedelta``.
        ValueError: ``timeout`` is not positive, or this rank is not in ``group``.
    """
    check_timeout("set_timeout", timeout)
    from tpu_dist.collectives._backend import ProcessGroupTPU

    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise ValueError("set_timeout: no default group: call init_process_group first")
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("set_timeout: this rank is not a member of the group")
    if isinstance(pg, ProcessGroupTPU):
        pg.set_timeout(timeout)
    elif hasattr(dist, "set_timeout"):  # torch >= 2.14
        dist.set_timeout(timeout, pg)
    else:
        dist.distributed_c10d._set_pg_timeout(timeout, pg)
