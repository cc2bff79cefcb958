"""A compile-only run writes no checkpoint: ``torch.save`` and DCP's save refuse, before any
file is opened.

A dry run's large tensors are fake (they hold no data), and whatever it wrote would take the
place of what is on disk: ``torch.save`` of a fake tensor onto an existing 4 MB checkpoint left
a corrupt 680-byte file (torch opens the file, truncating it, before it pickles anything), and
``torch.distributed.checkpoint.save`` a partial ``.distcp`` file, each with an obscure pickling
error. While the script of a compile-only run runs (:func:`refusing_saves`), ``torch.save`` and
``torch.distributed.checkpoint``'s ``save``, ``async_save`` and ``save_state_dict`` raise
:class:`SaveRefused` instead, having touched nothing. A script that saves checkpoints can skip
them in a dry run: ``if not tpu_dist.compile_job.enabled(): torch.save(...)``.

DCP is large to import (about 0.8 s), so it is not imported for this: its functions are
replaced when the script imports it (:class:`_OnImport`), or at once if it is imported already.
Other writes of the script (its logs, a config it dumps) are its own and are not refused.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SaveRefused", "refusing_saves"]

_DCP_SAVER = "torch.distributed.checkpoint.state_dict_saver"
_DCP = "torch.distributed.checkpoint"
_DCP_SAVES = ("save", "async_save", "save_state_dict")


class SaveRefused(RuntimeError):
    """A checkpoint save refused in a compile-only run (module doc); nothing was written."""


def _describe(args: tuple, kwargs: dict) -> str:
    """Where a save was headed: ``'ckpt.pt'``, ``checkpoint_id='ckpt/'``, or ``a file object``."""
    target = kwargs.get("f", args[1] if len(args) > 1 else None)
    if target is None:
        target = kwargs.get("checkpoint_id") or kwargs.get("storage_writer")
    if isinstance(target, (str, bytes)) or hasattr(target, "__fspath__"):
        return repr(str(target))
    return "a file object" if target is not None else "its default destination"


def _refusal(name: str, refused: list[str]) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        where = _describe(args, kwargs)
        refused.append(f"{name}({where})")
        raise SaveRefused(
            f"tpu-launch --compile-only: {name} to {where} was refused, and nothing was "
            "written: a dry run writes no checkpoint (its large tensors are fake and hold no "
            "data, and the save would replace what is on disk). Skip saves in a dry run: "
            "`if not tpu_dist.compile_job.enabled(): ...`, or run without --compile-only."
        )

    refuse.__name__ = name.rsplit(".", 1)[-1]
    refuse.refuses_saves = True  # type: ignore[attr-defined]
    return refuse


class _OnImport(importlib.abc.MetaPathFinder):
    """Replaces DCP's save functions as soon as the script imports DCP's saver module."""

    def __init__(self, patch: Callable[[Any], None]) -> None:
        self._patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _DCP_SAVER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        load, patch = spec.loader.exec_module, self._patch

        def exec_module(module: Any) -> None:
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


@contextlib.contextmanager
def refusing_saves() -> Iterator[list[str]]:
    """While active, checkpoint saves raise :class:`SaveRefused` (module doc). Yields the list
    of refused saves (``torch.save('ckpt.pt')``), filled as they happen; everything replaced is
    put back on exit."""
    import torch

    refused: list[str] = []
    undo: list[tuple[Any, str, Any]] = []

    def replace(module: Any, attr: str, name: str) -> None:
        if hasattr(module, attr):
            undo.append((module, attr, getattr(module, attr)))
            setattr(module, attr, _refusal(name, refused))

    def patch_dcp(saver: Any) -> None:
        for attr in _DCP_SAVES:
            replace(saver, attr, f"torch.distributed.checkpoint.{attr}")
        dcp = sys.modules.get(_DCP)
        if dcp is not None:  # the package re-exports them by name
            for attr in _DCP_SAVES:
                replace(dcp, attr, f"torch.distributed.checkpoint.{attr}")

    replace(torch, "save", "torch.save")
    finder = None
    if _DCP_SAVER in sys.modules:
        patch_dcp(sys.modules[_DCP_SAVER])
    else:
        finder = _OnImport(patch_dcp)
        sys.meta_path.insert(0, finder)
    try:
        yield refused
    finally:
        if finder is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(finder)
        for module, attr, original in reversed(undo):
            setattr(module, attr, original)
        dcp, saver = sys.modules.get(_DCP), sys.modules.get(_DCP_SAVER)
        for attr in _DCP_SAVES if dcp is not None and saver is not None else ():
            # bound by the package from the saver while it was replaced (imported meanwhile)
            if getattr(getattr(dcp, attr, None), "refuses_saves", False):
                setattr(dcp, attr, getattr(saver, attr))
