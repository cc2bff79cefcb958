"""Changing a group's timeout after it was created (torch's helper reaches only gloo and NCCL)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Change a group's timeout for its later collectives (the watchdog's deadline).

    torch's ``distributed_c10d._set_pg_timeout`` only reaches gloo and NCCL backends (on a
    tpu_dist group it warns "Set timeout is now only supported for either nccl or gloo" and
    changes nothing), so call this instead; on any other group it calls torch's helper.
    Collectives already issued keep the deadline they started with.

    Local to the calling rank: each rank of the group that should use the new deadline calls
    it (normally all of them, at the same point of the program). Nothing is communicated.

    Args:
        timeout: the new timeout, positive.
        group: the group; default: the default group.

    Raises:
        TypeError: ``timeout`` is not a ``datetime.timedelta``.
        ValueError: ``timeout`` is not positive, or this rank is not in ``group``.
    """
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta, got {type(timeout).__name__} ({timeout!r})"
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    from tpu_dist.collectives._backend import ProcessGroupTPU

    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise ValueError("set_timeout: no default group: call init_process_group first")
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("set_timeout: this rank is not a member of the group")
    if isinstance(pg, ProcessGroupTPU):
        pg._set_default_timeout(timeout)
    else:
        dist.distributed_c10d._set_pg_timeout(timeout, pg)
