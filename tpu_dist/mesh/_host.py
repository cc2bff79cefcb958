"""Is a TPU attached to this host? One answer for the whole package.

The launcher (``tpu-launch``: discovery, pre-flight checks) and the backend (``TPU_DIST_PLATFORM
=auto``) ask the same question; both ask it here, so they cannot disagree:

* a TPU chip is a PCI device with Google's vendor id (``0x1ae0``) and a TPU device id, read
  from sysfs (:func:`count_local_tpu_chips`; the ids are those JAX's own hardware check
  knows);
* the TPU runtime reaches the chips through device files: ``/dev/accel*`` (v2-v4, v5e, v6e)
  or ``/dev/vfio/<N>`` (v5p, TPU7x) (:func:`tpu_device_files`; the pre-flight check looks for
  processes holding them).

:func:`tpu_attached` is the PCI count, or the device files where sysfs has no PCI tree (some
containers): a ``/dev/vfio/<N>`` alone also appears for other passed-through PCI devices, so
it decides only when the PCI scan cannot.
"""

from __future__ import annotations

import glob
import os

__all__ = ["TPU_DEVICE_GLOBS", "count_local_tpu_chips", "tpu_attached", "tpu_device_files"]

_GOOGLE_PCI_VENDOR_ID = "0x1ae0"
_TPU_PCI_DEVICE_IDS = frozenset(
    {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
)

TPU_DEVICE_GLOBS = ("accel*", "vfio/[0-9]*")
"""Device files of TPU chips, relative to ``/dev``."""


def count_local_tpu_chips(sysfs_root: str = "/sys") -> int:
    """TPU chips attached to this host through PCI (0 without a TPU). Reads sysfs only."""
    count = 0
    for vendor_path in glob.glob(os.path.join(sysfs_root, "bus/pci/devices/*/vendor")):
        try:
            with open(vendor_path) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR_ID:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
                if f.read().strip() in _TPU_PCI_DEVICE_IDS:
                    count += 1
        except OSError:
            continue
    return count


def tpu_device_files(dev_root: str = "/dev") -> list[str]:
    """The TPU device files present under ``dev_root`` (:data:`TPU_DEVICE_GLOBS`), sorted."""
    found = set()
    for pattern in TPU_DEVICE_GLOBS:
        found.update(glob.glob(os.path.join(dev_root, pattern)))
    return sorted(found)


def tpu_attached(*, sysfs_root: str = "/sys", dev_root: str = "/dev") -> bool:
    """Whether a TPU is attached to this host (the module docstring says how it is told)."""
    if os.path.isdir(os.path.join(sysfs_root, "bus/pci/devices")):
        return count_local_tpu_chips(sysfs_root) > 0
    return bool(tpu_device_files(dev_root))
