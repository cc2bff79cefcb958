"""Compile-only mode: a job's collectives compiled for its TPU topology, without a TPU.

``tpu-launch --emulate tpu7x:16x16x16 --compile-only train.py`` runs ``train.py`` once, in one
process, as one rank (``--compile-rank``, default 0) of the whole world of the topology (8,192
ranks there), and reports on every collective the script issued. The pieces, in order:

1. :class:`Session` (:func:`activate`: the process's one): installed as the "tpu" groups'
   pipeline source (:mod:`tpu_dist.collectives.pipelines`), so every "tpu" group of the process
   is the backend's own group, planning each call exactly as it does, with a recording pipeline
   (:mod:`._recording`) that records the call and returns at once with outputs of the right
   shape; values are not meaningful. Each group's devices are the compile-only TPU devices
   (libtpu) of its ranks, rank ``r`` driving the chip ``tpu-launch`` would give it
   (:class:`tpu_dist.mesh.Topology`).
2. :meth:`Session.compile`: each distinct recorded program compiled with libtpu's TPU compiler
   (``pip install libtpu``; no TPU needed), each in a child process started while the
   script runs, so that a compiler crash (a signal) fails that program, named with the
   script line that issued it, and the report is still written with every other program.
3. The script runs with its large tensors fake (:class:`LargeTensorsFake`: shapes, no data),
   so a model of any size costs no memory; ``--tensors real`` runs it with real tensors.
4. :class:`CompileReport`: per collective, whether it compiled, the HLO collectives it became,
   its scratch memory and an estimated time per call (:func:`estimate_seconds`);
   :func:`write_report` writes it as JSON (``--compile-report``).
5. The measured step (:class:`StepMeter` around the script's run, :func:`step_report`): the
   FLOPs, tokens and peak tensor memory of the script's last training step (torch's FLOP
   formulas, ``_op_costs.op_cost``, and ``MemTracker`` on the fake tensors) and its collectives' estimated
   times, overlappable (FSDP's, DDP's) or on the critical path (DTensor's, the script's): the
   report's ``"step"`` object (compute, exposed communication, a step-time lower bound, MFU
   bound, tokens/s, peak HBM against the generation's: "fits" or "short by X GiB") and a
   picture (:func:`write_step_picture`, ``X.step.svg`` next to ``X.json``).
6. The step model (:func:`estimate_fsdp_tp_step`, :class:`StepEstimate`): a training step's
   lower bound from the model's FLOPs at the device's peak and the communication that cannot
   overlap compute, and the step to expect (:func:`predict_step`: matmuls padded to the MXU at
   a fitted efficiency, memory-bound work at HBM bandwidth, the communication compute does not
   hide); pure arithmetic, see ``tpu_dist/compile_job/_estimate.py``.
7. TorchTPU's ``"tpu"`` device, emulated for scripts written for TorchTPU
   (:meth:`Session.emulate_tpu_device`, ``tpu_dist/compile_job/_tpu_device.py``): ``"tpu:N"``
   tensors (fake), ``torch.tpu``, torch's accelerator and c10d backend for ``"tpu"``.

``TPU_DIST_COMPILE_ONLY=1`` (which ``tpu-launch`` sets) activates the session at ``import
tpu_dist``. Only the process that runs the script calls any of this; there are no peers. The
collectives package knows nothing of this one: it only offers the pipeline seam.
"""

from __future__ import annotations

from collections.abc import Mapping

from tpu_dist import _settings
from tpu_dist.compile_job._compile import (
    CompiledCall,
    CompileReport,
    estimate_seconds,
    write_report,
)
from tpu_dist.compile_job._estimate import (
    MATMUL_EFFICIENCY,
    CollectiveTime,
    DecoderShape,
    Prediction,
    StepCollective,
    StepEstimate,
    collective_time,
    estimate_fsdp_tp_step,
    flops_per_device,
    flops_per_token,
    fsdp_tp_collectives,
    predict_step,
    step_estimate,
)
from tpu_dist.compile_job._fake import LargeTensorsFake
from tpu_dist.compile_job._no_saves import SaveRefused, refusing_saves
from tpu_dist.compile_job._step import (
    StepMeter,
    StepRecord,
    StepReport,
    step_report,
    write_step_picture,
)
from tpu_dist.compile_job._session import (
    Session,
    activate,
    active_session,
    world_devices,
)

__all__ = [
    "COMPILE_ONLY_ENV",
    "MATMUL_EFFICIENCY",
    "CollectiveTime",
    "CompileReport",
    "CompiledCall",
    "DecoderShape",
    "LargeTensorsFake",
    "Prediction",
    "SaveRefused",
    "Session",
    "StepCollective",
    "StepEstimate",
    "StepMeter",
    "StepRecord",
    "StepReport",
    "activate",
    "active_session",
    "collective_time",
    "enabled",
    "estimate_fsdp_tp_step",
    "estimate_seconds",
    "flops_per_device",
    "flops_per_token",
    "fsdp_tp_collectives",
    "predict_step",
    "refusing_saves",
    "step_estimate",
    "step_report",
    "world_devices",
    "write_report",
    "write_step_picture",
]

COMPILE_ONLY_ENV = _settings.COMPILE_ONLY.env
"""``1``: "tpu" groups of this process record collectives instead of running them (set by
``tpu-launch --compile-only``; the world's topology comes from ``TPU_DIST_TOPOLOGY`` /
``TPU_DIST_NUM_SLICES``)."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TPU_DIST_COMPILE_ONLY`` asks for compile-only mode.

    Raises:
        ValueError: the variable is set to something other than 0 or 1.
    """
    return _settings.COMPILE_ONLY.get(environ)
