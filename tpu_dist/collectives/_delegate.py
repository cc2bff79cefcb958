"""Other devices' backends inside a tpu_dist group: ``init_process_group("cpu:tpu,tpu:tpu_dist")``.

torch's per-device backend syntax (``"<device>:<backend>,..."``) builds one process group with a
backend per device type. But when a backend's creator returns a Python ``ProcessGroup`` (as
tpu_dist's must, torch 2.13 offers no Python ``Backend`` base), torch 2.13 makes that object the
whole group and stops creating the others (``_new_process_group_helper``: "If the type is a
subclass of ProcessGroup then return this process group immediately"). Measured: with
``"cpu:tpu_jax,tpu:tpu"`` the "tpu" backend is never created, with ``"tpu:tpu,cpu:tpu_jax"`` it is
created and dropped.

So a tpu_dist group creates the other devices' backends itself, the first time a collective gets
tensors of that device type (every rank makes the same calls, so every rank creates it at the
same point): the backend named for the device in the group's backend config
(``torch.distributed.get_backend_config(group)``), built by its registered creator (or gloo's
constructor) on a store of its own, and registered on the group
(``group._get_backend(torch.device(type))`` then returns it). The collective, and every later one
with tensors of that device type, goes to that backend unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

def _device_type(args: tuple) -> str | None:
    """The device type of the first tensor among the call's arguments (lists are searched)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, (list, tuple)):
            found = _device_type(tuple(arg))
            if found is not None:
                return found
    return None


def _backend_name(config: str, device_type: str) -> str | None:
    """The backend ``config`` (``"cpu:tpu_jax,tpu:tpu"``) names for ``device_type``."""
    for part in config.split(","):
        device, _, name = part.strip().partition(":")
        if name and device.strip() == device_type:
            return name.strip().lower()
    return None


def create_backend(
    name: str, store: dist.Store, rank: int, size: int, timeout: timedelta, global_ranks: list[int]
) -> Any:
    """Build backend ``name`` as torch's ``_new_process_group_helper`` would for one device."""
    if name == dist.Backend.GLOO:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise ValueError(
            f"tpu_dist: the group's backend config names {name!r}, which is not a registered "
            f"torch.distributed backend (registered: {sorted(dist.Backend.backend_list)})"
        )
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size, opts.timeout = store, rank, size, timeout
    opts.global_ranks_in_group = global_ranks
    return plugin.creator_fn(opts, None)


class DelegatingMixin:
    """Sends collectives whose tensors are not on a device the group takes (the CPU; compile-only
    mode's pipeline takes its emulated "tpu" device too: ``tensor_device_types``) to the
    group's backend for them."""

    _store: dist.Store | None
    _delegates: dict[str, Any]
    _tensor_device_types: frozenset[str] = frozenset({"cpu"})

    supports_coalescing = False
    """torch's ``batch_isend_irecv`` then issues each op on its own, as for gloo: the group
    matches sends and receives by direction and tag as gloo does (``_p2p.P2PChannels``), so
    any order of a batch that completes on gloo completes here."""

    def _get_backend(self, device: torch.device | str) -> Any:
        """The backend that runs this group's collectives on ``device``'s tensors.

        For CPU tensors the group itself: a Python ``ProcessGroup`` is its own backend (torch
        2.14+ asks the group for it in ``batch_isend_irecv``, ``get_backend_impl`` and
        ``_abort_process_group``; c10d's own lookup knows only backends registered in C++).
        For another device type the delegate created for it, else torch's lookup (which
        raises ``RuntimeError`` naming the device type).
        """
        device_type = torch.device(device).type
        if device_type == "cpu":
            return self
        if device_type in self._delegates:
            return self._delegates[device_type]
        return super()._get_backend(device)  # type: ignore[misc]

    def get_backend(self, device: torch.device | str) -> Any:
        """Public name of :meth:`_get_backend` (torch 2.14+)."""
        return self._get_backend(device)

    def _delegate_for(self, device_type: str) -> Any:
        backend = self._delegates.get(device_type)
        if backend is not None:
            return backend
        config = dist.get_backend_config(self)  # type: ignore[arg-type]
        name = _backend_name(config, device_type)
        if name is None:
            raise ValueError(
                f"tpu_dist: this group (backend config {config!r}) has no backend for tensors on "
                f"{device_type!r}; tpu_dist's groups take CPU tensors. To combine backends in one "
                f"group use torch's per-device syntax, e.g. init_process_group("
                f"'cpu:{dist.get_backend(self)},{device_type}:<backend>')"  # type: ignore[arg-type]
            )
        if self._store is None:
            raise RuntimeError(
                f"tpu_dist: this group was built without a store, so it cannot create the "
                f"{name!r} backend for {device_type!r} tensors; create groups through "
                "torch.distributed (init_process_group, new_group)"
            )
        store = dist.PrefixStore(f"tpu_dist_delegate/{device_type}/", self._store)
        backend = create_backend(
            name, store, self.rank(), self.size(), self._timeout,  # type: ignore[attr-defined]
            list(self._global_ranks),  # type: ignore[attr-defined]
        )
        if isinstance(backend, torch._C._distributed_c10d.Backend):
            self._register_backend(  # type: ignore[attr-defined]
                torch.device(device_type), dist.ProcessGroup.BackendType.CUSTOM, backend
            )
        self._delegates[device_type] = backend
        return backend


def other_devices_to(theirs: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Method decorator: a call whose first tensor is of a device type the group does not take
    itself (``_tensor_device_types``: CPU, and compile-only mode's fake devices) goes to that
    device type's delegate backend (module doc), as its method ``theirs`` (c10d ``Backend``'s
    name for the same collective, ``_allgather_base`` for ``all_gather_single``), unchanged."""

    def decorate(ours: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(ours)
        def routed(self: Any, *args: Any) -> Any:
            device_type = _device_type(args)
            if device_type is None or device_type in self._tensor_device_types:
                return ours(self, *args)
            return getattr(self._delegate_for(device_type), theirs)(*args)

        routed.other_devices_to = theirs  # what tests read to see the routing
        return routed

    return decorate
