"""Imported by test workers instead of ``tpu_dist``: TorchTPU's registration simulated, then tpu_dist.

What TorchTPU 0.2.0 does on a TPU host inside ``import torch`` (read from its
``torch_tpu/_loader.py`` and ``_internal/distributed/torchcomm_tpu.py``): rename PrivateUse1 to
"tpu", register the c10d backends "tpu" and "tpu_dist" for device "tpu", map device "tpu" to
"tpu_dist". Its creator is replaced by one that records its calls and builds a gloo backend.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

CREATED: list[int] = []
"""One entry (the group size) per simulated TorchTPU backend created."""


def create_process_group(store, rank, size, timeout):  # TorchTPU's creator takes the plain API
    CREATED.append(size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


torch.utils.rename_privateuse1_backend("tpu")
for _name in ("tpu", "tpu_dist"):
    dist.Backend.register_backend(_name, create_process_group, devices=["tpu"])
dist.Backend.default_device_backend_map["tpu"] = "tpu_dist"

with warnings.catch_warnings(record=True) as _caught:
    warnings.simplefilter("always")
    import tpu_dist  # noqa: E402,F401

WARNINGS = [str(w.message) for w in _caught if "tpu_dist" in str(w.message)]
"""tpu_dist's warnings at import."""
