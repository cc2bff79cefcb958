"""The seam for running a "tpu" group's calls some other way: a pipeline of one's own.

A "tpu" process group plans every call itself (checks, blocks, the program's
:class:`ProgramKey`) and hands the plan to its *pipeline*, which does the rest (the backend's
own: track, dispatch, complete). Another pipeline can take its place for every group created
from then on: :func:`set_pipeline_source`. Compile-only mode does this
(:mod:`tpu_dist.compile_job`: record each call and return at once, no JAX runtime started),
so it needs nothing of the backend's inside.

A source is called once per new group, on the rank creating it, with ``(rank, size,
global_ranks, world_size)`` (group rank, group size, the global rank of each group rank, the
world's size) and returns ``(devices, pipeline)``: the JAX device of each group rank and an
object with :class:`GroupPipeline`'s methods. A pipeline may also have ``tensor_device_types``,
the device types whose tensors the group takes itself (default ``("cpu",)``; others go to the
backend the group's config names for them): compile-only mode's takes its emulated ``"tpu"``
device's fake tensors too.

Names: :class:`GroupPipeline` (the protocol), :class:`GroupView` (what a pipeline is told of
the group), :class:`Plan` / :class:`P2PPlan` (a planned collective / send or receive),
:class:`Kind` and :class:`ProgramKey` (the program), :class:`TPUWork` (what a call returns:
``TPUWork.completed(description, outputs)`` for a call done at once).
"""

from __future__ import annotations

from tpu_dist.collectives._pipeline import GroupPipeline
from tpu_dist.collectives._plan import GroupView, P2PPlan, Plan
from tpu_dist.collectives._registry import PipelineSource, pipeline_source, set_pipeline_source
from tpu_dist.collectives._types import Kind, ProgramKey
from tpu_dist.collectives._work import TPUWork

__all__ = [
    "GroupPipeline",
    "GroupView",
    "Kind",
    "P2PPlan",
    "PipelineSource",
    "Plan",
    "ProgramKey",
    "TPUWork",
    "pipeline_source",
    "set_pipeline_source",
]
