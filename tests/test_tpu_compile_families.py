"""Family programs compiled by libtpu's TPU compiler, on the generations where they matter.

On TPU v5e and v6e a collective over part of a slice does not compile as a program over the
group's own devices (libtpu, docs/reference/libtpu.md: v5e ``device assignment should include
all slice devices``; v6e ``Unexpected device_id ... in replica group`` for many groups). A group
registered as one of a family (the groups of a mesh dimension) runs a *family program*
instead: one program over every device of the family, whose replica groups are the family's
groups (``ProgramKey.groups``). Here the backend's own plans (``_plan_*`` functions on a
``GroupView`` with the family, as a "tpu" group makes them) are compiled over libtpu's
compile-only devices, for the dimensions of ``plan_mesh`` layouts, and the compiled HLO's
replica groups, mapped back to ranks, must be exactly the family's groups (on v5p and TPU7x,
where the backend keeps each group's own program, the group's):

* one slice: every in-slice collective's groups equal the family's;
* several slices: the in-slice collective lists each group's part in one slice (positions
  among that slice's devices, in program order), and the rest crosses DCN (MegaScale sends
  over exactly the family's devices; an all-to-all's target lists the family's groups);
* permutes: every (source, target) pair inside one group.

Every program compiles in this process: only programs measured to compile are here
(``docs/decisions/0020-family-programs-study.md``); the subset programs that crash libtpu are not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("libtpu")

from tpu_dist.collectives import _plan, _plan_all_to_all, _plan_collectives  # noqa: E402
from tpu_dist.collectives._dispatch import agreement_key  # noqa: E402
from tpu_dist.collectives.compile_only import (  # noqa: E402
    compile_collective,
    hlo_collectives,
    part_of_slice_hint,
    topology_devices,
)
from tpu_dist.mesh import Topology, plan_mesh  # noqa: E402

_CACHE: dict = {}


def _world(gen: str, shape: str, slices: int = 1) -> tuple[Topology, list]:
    if (gen, shape, slices) not in _CACHE:
        topo = Topology.create(gen, shape, num_slices=slices)
        _CACHE[gen, shape, slices] = (topo, topology_devices(topo))
    return _CACHE[gen, shape, slices]


def _family(ranks: np.ndarray, axis: int) -> list[list[int]]:
    """The groups of ``axis`` of a mesh of ranks, each in mesh (group-rank) order."""
    return np.moveaxis(ranks, axis, -1).reshape(-1, ranks.shape[axis]).tolist()


def _view(family: list[list[int]], devices: list) -> _plan.GroupView:
    """Rank ``family[0][0]``'s view of its group, as a registered "tpu" group has it."""
    mine = family[0]
    return _plan.GroupView(
        0, len(mine), tuple(devices[r].id for r in mine), "tpu", tuple(mine),
        family=tuple(tuple(devices[r].id for r in g) for g in family),
        device_kind=devices[0].device_kind,
    )


def _plans(view: _plan.GroupView) -> dict[str, _plan.Plan]:
    """The backend's plan of each kind of call on ``view`` (8 elements a rank, or 8 a peer)."""
    n = view.size
    sum_, max_, product = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT
    return {
        "all_reduce bf16 SUM": _plan_collectives.all_reduce(view, [torch.ones(8, dtype=torch.bfloat16)], sum_),
        "all_reduce f32 PRODUCT": _plan_collectives.all_reduce(view, [torch.ones(8)], product),
        "all_reduce f64 MAX": _plan_collectives.all_reduce(view, [torch.ones(8, dtype=torch.float64)], max_),
        "all_gather": _plan_collectives.all_gather_into_tensor(view, torch.empty(8 * n), torch.ones(8)),
        "reduce_scatter AVG": _plan_collectives.reduce_scatter_tensor(
            view, torch.empty(8), torch.ones(8 * n), dist.ReduceOp.AVG
        ),
        "all_to_all": _plan_all_to_all.all_to_all_single(view, torch.empty(8 * n), torch.ones(8 * n), [], []),
        "broadcast": _plan_collectives.broadcast(view, [torch.ones(8)], n - 1),
        "scatter": _plan_collectives.scatter(
            view, [torch.empty(8)], [[torch.ones(8) for _ in range(n)]], 0
        ),
        "barrier": _plan_collectives.barrier(view),
    }


def _check(key, family: list[list[int]], devices: list, topo: Topology) -> set[str]:
    """Compile ``key``'s program; assert its collectives run within the family's groups;
    return how the groups were seen (``in-slice``, ``per-slice``, ``dcn``, ``pairs``)."""
    rank_of = {d.id: r for r, d in enumerate(devices)}
    program = [devices[rank_of[i]] for i in key.devices]
    result = compile_collective(key, program)
    flat = [rank_of[d.id] for d in program]
    expected = sorted(tuple(g) for g in family)
    slices = topo.num_slices
    seen = set()
    for c in result.collectives:
        if c.op == "megascale-send":
            groups = [[rank_of[i] for i in g] for g in c.megascale_groups()]
            members = sorted(r for g in groups for r in g)
            assert set(members) <= set(flat), c.megascale_target
            if len(groups) > 1:  # an all-to-all between slices: the family's groups
                assert sorted(tuple(sorted(g)) for g in groups) == sorted(
                    tuple(sorted(g)) for g in family
                ), c.megascale_target
            seen.add("dcn")
            continue
        if c.op == "collective-permute":
            for a, b in c.replica_groups:
                assert any(flat[a] in g and flat[b] in g for g in family), (a, b)
            seen.add("pairs")
            continue
        if slices == 1:
            got = sorted(tuple(flat[p] for p in g) for g in c.replica_groups)
            assert got == expected, (key.kind, c.op, got[:2], expected[:2])
            seen.add("in-slice")
        else:  # positions among one slice's program devices; each group's part in it
            matched = False
            for s in range(slices):
                table = [r for r in flat if int(topo.slice_of(r)) == s]
                got = sorted(tuple(table[p] for p in g) for g in c.replica_groups)
                parts = sorted(
                    tuple(r for r in g if int(topo.slice_of(r)) == s) for g in family
                )
                matched |= got == [p for p in parts if p]
            assert matched, (key.kind, c.op, c.replica_groups[:2])
            seen.add("per-slice")
    assert seen, result.hlo_text
    return seen


_CASES = [
    # (generation, shape, slices, mesh shape, dcn mesh shape, axis, kinds)
    ("v5e", "16x16", 1, (32, 8), None, 1, ("all_reduce bf16 SUM", "reduce_scatter AVG",
                                             "all_to_all")),  # tp: 32 groups of 8
    ("v5e", "16x16", 1, (32, 8), None, 0, None),  # dp: 8 groups of 32 (strided), every kind
    ("v6e", "16x16", 1, (4, 8, 8), None, 1, ("all_reduce bf16 SUM", "all_gather", "barrier")),
    ("v6e", "16x16", 1, (4, 8, 8), None, 0, ("all_reduce bf16 SUM", "reduce_scatter AVG")),
    ("v6e", "4x8", 1, (4, 8), None, 1, ("all_reduce f32 PRODUCT", "all_gather", "broadcast")),
    ("v6e", "16x16", 4, (128, 8), None, 0,
     ("all_reduce bf16 SUM", "all_gather", "reduce_scatter AVG", "all_to_all")),
    ("v5p", "4x4x4", 2, (16, 8), None, 0, ("all_reduce bf16 SUM", "all_gather")),
    ("tpu7x", "4x4x4", 1, (16, 8), None, 1,
     ("all_gather", "all_reduce f32 PRODUCT", "all_reduce bf16 SUM")),
]


@pytest.mark.parametrize(
    ("gen", "shape", "slices", "mesh", "dcn", "axis", "kinds"), _CASES,
    ids=[f"{c[0]}:{c[1]}x{c[2]}-{c[3]}-axis{c[5]}" for c in _CASES],
)
def test_family_programs_compile_with_the_familys_groups(
    gen: str, shape: str, slices: int, mesh: tuple, dcn: tuple | None, axis: int, kinds
) -> None:
    topo, devices = _world(gen, shape, slices)
    ranks = plan_mesh(topo, mesh, dcn)
    family = _family(ranks, axis)
    plans = _plans(_view(family, devices))
    for name in kinds or plans:
        key = plans[name].key
        if gen in ("v5p", "tpu7x"):
            # These compile a group's own program at any scale: the backend keeps it there.
            assert key.groups == 1 and key.devices == tuple(devices[r].id for r in family[0])
            seen = _check(key, family[:1], devices, topo)
        else:
            assert key.groups == len(family) and key.group_size == len(family[0]), key
            seen = _check(key, family, devices, topo)
        if slices > 1:
            assert "dcn" in seen, (name, seen)


@pytest.mark.parametrize(("gen", "axis"), [("v5e", 0), ("v6e", 0)])
def test_the_order_agreement_of_groups_over_the_same_ranks_compiles(gen: str, axis: int) -> None:
    # Two groups over the same ranks (a mesh dimension and one flattened to the same ranks)
    # agree on their calls' order with an all-gather (_dispatch.Dispatcher). Over part of a
    # v5e or v6e slice only the family's program compiles; the group's own does not.
    topo, devices = _world(gen, "16x16")
    family = _family(plan_mesh(topo, (32, 8)), axis)
    ids = [tuple(devices[r].id for r in g) for g in family]
    key = agreement_key(ids[0], "tpu", tuple(ids), devices[0].device_kind)
    assert key.groups == len(family), key
    _check(key, family, devices, topo)
    own = agreement_key(ids[0], "tpu", (), devices[0].device_kind)
    with pytest.raises(Exception) as caught:
        compile_collective(own, [devices[r] for r in family[0]])
    assert part_of_slice_hint(own, str(caught.value)) is not None, str(caught.value)[:300]


def test_a_group_over_part_of_a_v5e_slice_says_what_to_do() -> None:
    # A group's own program (no family) over 8 of 256 v5e chips: libtpu refuses it, and the
    # message says how to make it compile.
    topo, devices = _world("v5e", "16x16")
    group = plan_mesh(topo, (32, 8))[0].tolist()
    view = _plan.GroupView(
        0, 8, tuple(devices[r].id for r in group), "tpu", tuple(group),
        device_kind=devices[0].device_kind,
    )
    key = _plan_collectives.all_reduce(view, [torch.ones(8)], dist.ReduceOp.SUM).key
    assert key.groups == 1
    with pytest.raises(Exception) as caught:
        compile_collective(key, [devices[r] for r in group])
    hint = part_of_slice_hint(key, str(caught.value))
    assert hint is not None, str(caught.value)[:300]
    assert "tpu_dist.mesh.register_mesh" in hint and "group of 8 devices" in hint


def test_hlo_collectives_reads_a_megascale_target_of_several_groups() -> None:
    line = (
        '  %s = (s32[8]{0}, u32[]) send(s32[8]{0} %x, token[] %t), channel_id=3, '
        'frontend_attributes={_xla_megascale_target="{{100000,200000},{100001,200001}}",'
        '_xla_megascale_transfer_type="ALL_TO_ALL"}\n'
    )
    text = line.replace('"{{', "{{").replace('}}",', "}},")
    for hlo in (line, text):
        (found,) = hlo_collectives(hlo)
        assert found.op == "megascale-send" and found.megascale_transfer == "ALL_TO_ALL"
        assert found.megascale_groups() == ((100000, 200000), (100001, 200001))
        assert found.megascale_devices() == (100000, 200000, 100001, 200001)
