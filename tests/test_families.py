"""Family programs on CPU: a mesh dimension's groups run one program over the whole family.

A group registered as one of a family (``tpu_dist.mesh.init_device_mesh`` does it, and
``tpu_dist.mesh.register_mesh`` for a torch ``DeviceMesh``) runs each collective as one
program over every device of the family, with the family's groups as replica groups: the
lowering TPU v5e and v6e need (``tests/test_tpu_compile_families.py`` compiles it for TPU).
The CPU runs the same programs, so these tests check what TPU runs: every op of both families
of a (2, 2) mesh on 4 "tpu" ranks, each rank's results equal to what the same body gives on
gloo, and the programs the "tpu" ranks ran are family programs (``ProgramKey.groups == 2``).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

from tests.collective_cases import all_reduce_from_threads

_TPU = {"world_size": 4, "backend": "tpu"}


def _ops_on_group(group: dist.ProcessGroup, rank: int, tag: str) -> dict:
    """Every collective of the backend on ``group``, with values that tell ranks apart; the
    results by name (compared between "tpu" and gloo)."""
    ranks = dist.get_process_group_ranks(group)
    n, me = len(ranks), ranks.index(rank)
    out: dict = {}
    for size in (5, 70_000):  # a small exchange, and above the CPU's direct-exchange limit
        base = torch.arange(size, dtype=torch.float32) + 10 * rank
        for op in ("SUM", "AVG", "MAX", "PRODUCT") if size == 5 else ("SUM",):
            t = base.clone() if op != "PRODUCT" else torch.full((size,), 1.0 + rank)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
            out[f"{tag}/all_reduce/{op}/{size}"] = t
        if size == 5:
            t = (torch.arange(size) * (rank + 1)).to(torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.BXOR, group=group)
            out[f"{tag}/all_reduce/BXOR/int64/{size}"] = t
        gathered = torch.empty(n * size, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(gathered, base.to(torch.bfloat16), group=group)
        out[f"{tag}/all_gather/{size}"] = gathered
        scattered = torch.empty(size)
        dist.reduce_scatter_tensor(
            scattered, torch.arange(n * size, dtype=torch.float32) * (rank + 1), group=group
        )
        out[f"{tag}/reduce_scatter/{size}"] = scattered
        moved = torch.empty(n * size, dtype=torch.int32)  # large: collective-permutes on CPU
        dist.all_to_all_single(
            moved, torch.arange(n * size, dtype=torch.int32) + 1000 * rank, group=group
        )
        out[f"{tag}/all_to_all/{size}"] = moved
        if size > 5:
            continue
        sent = base.clone()
        dist.broadcast(sent, ranks[n - 1], group=group)
        out[f"{tag}/broadcast/{size}"] = sent
    # Uneven all-to-all (two programs: the widest chunk is agreed first).
    splits = [me + 1 + j for j in range(n)]  # this rank sends splits[j] elements to rank j
    recv = [ranks.index(r) + 1 + me for r in ranks]
    inp = torch.arange(sum(splits), dtype=torch.float32) + 100 * rank
    uneven = torch.empty(sum(recv))
    dist.all_to_all_single(uneven, inp, recv, splits, group=group)
    out[f"{tag}/all_to_all_uneven"] = uneven
    objects: list = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "tag": tag}, group=group)
    out[f"{tag}/all_gather_object"] = objects
    # Async calls of the group in flight together, then waited on in reverse.
    works, tensors = [], []
    for k in range(3):
        t = torch.full((7,), float(rank + k))
        works.append(dist.all_reduce(t, group=group, async_op=True))
        tensors.append(t)
    for w in reversed(works):
        w.wait()
    out[f"{tag}/async"] = tensors
    # A send and its receive inside the group (a pair's own program, not a family's).
    if n >= 2:
        peer = ranks[(me + 1) % n] if me % 2 == 0 else ranks[me - 1]
        box = torch.full((4,), float(rank))
        got = torch.empty(4)
        ops = [dist.P2POp(dist.isend, box, peer, group), dist.P2POp(dist.irecv, got, peer, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out[f"{tag}/p2p"] = got
    dist.barrier(group=group)
    return out


def _program_groups() -> dict:
    """How many programs of each ``ProgramKey.groups`` this rank built (empty on gloo)."""
    if dist.get_backend() == "gloo":
        return {}
    from tpu_dist.collectives import _runtime

    counts = collections.Counter(k.groups for k in _runtime.get().programs.by_key)
    return dict(counts)


def _tpu_dist_mesh(rank: int, world_size: int) -> dict:
    from tpu_dist.mesh import init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    out = {"mesh": mesh.mesh.tolist()}
    for dim in ("dp", "tp"):
        out.update(_ops_on_group(mesh.get_group(dim), rank, dim))
        backend = mesh.get_group(dim)
        family = getattr(backend, "family", None)
        out[f"{dim}/family"] = family
    out["program_groups"] = _program_groups()
    if dist.get_backend() != "gloo":
        # JAX's public call (global arrays of every family device, this rank's block taken
        # back out), which the backend falls back to if jaxlib's direct execute goes away.
        from tpu_dist.collectives import _lowering, _runtime

        cache = _runtime.get().programs
        for key, program in list(cache.by_key.items()):
            if key.groups > 1:
                cache.by_key[key] = _lowering.Program(program.compiled, None)
    for dim in ("dp", "tp"):
        t = torch.arange(5.0) + rank
        dist.all_reduce(t, group=mesh.get_group(dim))
        out[f"{dim}/public_path"] = t
    return out


def _torch_mesh_registered(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tpu_dist.mesh import register_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    register_mesh(mesh)
    out = {"mesh": mesh.mesh.tolist()}
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        out[f"{dim}/family"] = getattr(group, "family", None)
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x, group=group)
        out[f"{dim}/sum"] = x
        y = torch.empty(2 * 3)
        dist.all_gather_into_tensor(y, torch.full((3,), float(rank)), group=group)
        out[f"{dim}/gathered"] = y
    out["program_groups"] = _program_groups()
    return out


def _compare(tpu: list[dict], gloo: list[dict]) -> None:
    for rank, (t, g) in enumerate(zip(tpu, gloo)):
        assert t["mesh"] == g["mesh"]
        for name, expected in g.items():
            if name in ("program_groups",) or name.endswith("/family"):
                continue
            got = t[name]
            if isinstance(expected, torch.Tensor):
                assert torch.equal(got, expected), (rank, name, got, expected)
            elif isinstance(expected, list) and expected and isinstance(expected[0], torch.Tensor):
                for a, b in zip(got, expected):
                    assert torch.equal(a, b), (rank, name, a, b)
            else:
                assert got == expected, (rank, name, got, expected)


def test_every_op_of_a_meshs_families_as_gloo(worlds) -> None:
    tpu = worlds(**_TPU).run(_tpu_dist_mesh, timeout=240)
    gloo = worlds(4).run(_tpu_dist_mesh, timeout=240)
    _compare(tpu, gloo)
    mesh = tpu[0]["mesh"]  # [[0, 2], [1, 3]] on the default v5p 2x2x1: dp pairs columns
    dp_family = sorted(sorted(mesh[i][j] for i in range(2)) for j in range(2))
    tp_family = sorted(sorted(row) for row in mesh)
    for rank, result in enumerate(tpu):
        assert sorted(map(sorted, result["dp/family"])) == dp_family, result["dp/family"]
        assert sorted(map(sorted, result["tp/family"])) == tp_family, result["tp/family"]
        # The mesh's collectives ran as family programs; the others (the pairs of p2p, the
        # default group's) as a group's own.
        assert result["program_groups"].get(2, 0) >= 10, result["program_groups"]


def test_a_torch_device_mesh_registered_runs_family_programs(worlds) -> None:
    tpu = worlds(**_TPU).run(_torch_mesh_registered, timeout=120)
    gloo = worlds(4).run(_torch_mesh_registered, timeout=120)
    _compare(tpu, gloo)
    for result in tpu:
        # torch's DeviceMesh sorts each group's ranks; the family follows.
        assert result["dp/family"] == [[0, 2], [1, 3]], result["dp/family"]
        assert result["tp/family"] == [[0, 1], [2, 3]], result["tp/family"]
        assert result["program_groups"].get(2, 0) >= 2, result["program_groups"]


def _flattened_dimensions(rank: int, world_size: int, iters: int) -> dict:
    """A (dp 2, cp 1, tp 2) torch mesh with two flattened dimensions (TorchTitan's meshes with
    cp = 1: ``dp_cp`` has dp's ranks, ``cp_tp`` tp's), registered through a sub-mesh; then two
    threads all-reduce at once on dp and on dp_cp, two groups over the same ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from tpu_dist.mesh import register_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
    meshes = {
        "dp": mesh["dp"], "tp": mesh["tp"],
        "dp_cp": mesh["dp", "cp"]._flatten("dp_cp"), "cp_tp": mesh["cp", "tp"]._flatten(),
    }
    register_mesh(mesh["tp"])  # a sub-mesh stands for its root and what was flattened from it
    out: dict = {}
    for dim, sub in meshes.items():
        group = sub.get_group()
        out[f"{dim}/ranks"] = dist.get_process_group_ranks(group)
        out[f"{dim}/family"] = getattr(group, "family", None)
    groups = [meshes["dp"].get_group(), meshes["dp_cp"].get_group()]
    before = _agreement_programs()
    out["wrong"] = all_reduce_from_threads([[g] for g in groups], rank, (1000, 500), iters)
    out["agreements"] = _agreement_programs()
    out["new_agreements"] = sorted(set(out["agreements"]) - set(before))
    return out


def _agreement_programs() -> list[tuple[int, tuple[int, ...]]]:
    """(groups, the ranks of its devices) of each order-agreement program this rank built (an
    all-gather of three int32s; empty on gloo)."""
    if dist.get_backend() == "gloo":
        return []
    from tpu_dist.collectives import _runtime, global_devices

    rank_of = {d.id: r for r, d in enumerate(global_devices())}
    return sorted(
        (k.groups, tuple(rank_of[i] for i in k.devices))
        for k in _runtime.get().programs.by_key
        if k.kind == "allgather" and k.blocks == ((3, "int32"),)
    )


def test_flattened_dimensions_are_families_and_agree_on_order_as_one(worlds) -> None:
    tpu = worlds(**_TPU).run(_flattened_dimensions, 30, timeout=120)
    gloo = worlds(4).run(_flattened_dimensions, 30, timeout=120)
    dp, tp = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    for rank, (t, g) in enumerate(zip(tpu, gloo)):
        assert t["wrong"] == g["wrong"] == [0, 0], (rank, t["wrong"], g["wrong"])
        for dim, family in (("dp", dp), ("tp", tp), ("dp_cp", dp), ("cp_tp", tp)):
            assert t[f"{dim}/ranks"] == g[f"{dim}/ranks"] and rank in t[f"{dim}/ranks"]
            assert t[f"{dim}/family"] == family, (rank, dim, t[f"{dim}/family"])
        # dp and dp_cp share their ranks: their calls' order was agreed on by the family's
        # program over all four devices (two groups of two), as their own calls run, never
        # by a program of the group's own (the worker's earlier tests may have built one).
        assert (2, (0, 2, 1, 3)) in t["agreements"], (rank, t["agreements"])
        assert all(groups == 2 for groups, _ in t["new_agreements"]), (rank, t)


def _threads_over_shared_sets(rank: int, world_size: int, shape: str, iters: int) -> dict:
    """Threads all-reduce at once on 4 ranks, one of them on a device set two groups share,
    another on other groups (issue 48, item 3); returns the wrong results of each thread.

    * ``pair``: WORLD and a pair group ([0, 1]), with a ``new_group`` of all ranks alive and
      unused (so WORLD's calls are ordered by an agreement over the four ranks);
    * ``world_and_all``: one thread alternates between WORLD and a ``new_group`` of all ranks,
      the other uses the pair group;
    * ``mesh``: a registered (dp 2, cp 1, tp 2) torch mesh with ``dp_cp`` flattened (dp's
      ranks); three threads on dp, dp_cp and tp.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if shape == "mesh":
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
        dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
        if dist.get_backend() == "tpu":
            from tpu_dist.mesh import register_mesh

            register_mesh(mesh)
        threads = [[mesh["dp"].get_group()], [dp_cp.get_group()], [mesh["tp"].get_group()]]
        sizes: tuple[int, ...] = (1000, 500, 700)
    else:
        everyone = dist.new_group(list(range(world_size)))
        pair = dist.new_group([0, 1])
        world = dist.group.WORLD
        threads = [[world] if shape == "pair" else [world, everyone], [pair]]
        sizes = (1000, 500)
    return {"wrong": all_reduce_from_threads(threads, rank, sizes, iters)}


@pytest.mark.parametrize("shape", ["pair", "world_and_all", "mesh"])
@pytest.mark.parametrize("backend", ["tpu", "gloo"])
def test_threads_over_shared_rank_sets_never_wait_for_each_other(worlds, backend, shape) -> None:
    # Before the fix: with one dispatcher thread per process, rank 0 started the pair's
    # program there while ranks 1-3 waited in WORLD's order agreement on theirs, with the
    # pair's program queued behind it: every run of "pair" and "world_and_all" hung at 300
    # calls, "mesh" in 3 of 6 runs (at 30 calls, 2 of 4). A hang fails within the run's timeout.
    world = worlds(**_TPU) if backend == "tpu" else worlds(4)
    results = world.run(_threads_over_shared_sets, shape, 300, timeout=60)
    threads = 3 if shape == "mesh" else 2
    assert [r["wrong"] for r in results] == [[0] * threads] * 4, results


def test_the_agreement_family_of_a_device_set() -> None:
    # Which family the order agreement over a device set runs as (_dispatch.DeviceSets): the
    # one every live group over the set is of; a dimension in mesh (ring) order and one
    # flattened to the same ranks, sorted, are one family; a group of none, or of another
    # family, leaves the group's own program.
    from tpu_dist.collectives._dispatch import DeviceSets

    sets = DeviceSets()
    row = (0, 1, 2, 3)
    ring = ((0, 2, 3, 1), (4, 6, 7, 5))  # tpu_dist.mesh's order: a ring over the chips
    first, second = sets.add(row), sets.add(row)
    assert sets.shared(row) and sets.family(row) == ()
    sets.set_family(row, first, ring)
    assert sets.family(row) == ()  # the second is of no family yet
    sets.set_family(row, second, ((4, 5, 6, 7), (0, 1, 2, 3)))
    assert sets.family(row) == ((0, 1, 2, 3), (4, 5, 6, 7))
    third = sets.add(row)
    sets.set_family(row, third, ((0, 1, 2, 3), (4, 5, 8, 9)))
    assert sets.family(row) == ()
    sets.remove(row, third)
    assert sets.family(row) == ((0, 1, 2, 3), (4, 5, 6, 7))
    sets.remove(row, second)
    assert not sets.shared(row) and sets.add(row) == 3  # indices are never reused


def _mesh_after_a_group_some_ranks_joined(rank: int, world_size: int) -> dict:
    from tpu_dist.mesh import init_device_mesh

    # Every rank calls new_group([0, 1]); only ranks 0 and 1 are its members, so they now
    # belong to one more group than ranks 2 and 3.
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        t = torch.ones(1)
        dist.all_reduce(t, group=pair)
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out[dim] = (sorted(dist.get_process_group_ranks(group)), t.item())
    return out


@pytest.mark.parametrize("backend", ["tpu", "gloo"])
def test_init_device_mesh_after_a_group_only_some_ranks_joined(worlds, backend: str) -> None:
    # The mesh's groups used to be named from each rank's own count of groups: ranks 1 and 3
    # (a dp group) named theirs differently and waited for each other until the timeout.
    world = worlds(**_TPU) if backend == "tpu" else worlds(4)
    results = world.run(_mesh_after_a_group_some_ranks_joined, timeout=60)
    for rank, result in enumerate(results):
        for dim, (ranks, total) in result.items():
            assert rank in ranks and total == float(sum(ranks)), (rank, dim, ranks, total)


def _bad_families(rank: int, world_size: int) -> list[str]:
    from tpu_dist.collectives import global_devices
    from tpu_dist.mesh import init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    group = mesh.get_group("tp")
    mine = dist.get_process_group_ranks(group)
    others = [r for r in range(4) if r not in mine]
    devices = global_devices()
    errors = []
    for family in (
        [others],  # not this group's
        [mine, others[:1]],  # sizes differ
        [mine, [mine[0], others[0]]],  # a rank twice
        [list(reversed(mine)), others],  # this group's ranks, in another order
    ):
        try:
            group.set_family(family, devices)
        except ValueError as err:
            errors.append(str(err))
    # Nothing changed: still the family init_device_mesh registered, and it still works.
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=group)
    errors.append(f"family {group.family} sum {t.item()}")
    return errors


def test_set_family_refuses_a_family_that_is_not_the_groups(worlds) -> None:
    results = worlds(**_TPU).run(_bad_families, timeout=60)
    for errors in results:
        assert len(errors) == 5, errors
        assert "none of them is this group's ranks" in errors[0]
        assert "their sizes differ ([1, 2])" in errors[1]
        assert "a rank is in two of them" in errors[2]
        assert "none of them is this group's ranks" in errors[3]
        for message in errors[:4]:
            assert "Pass every group of one mesh dimension" in message
        assert errors[4].endswith("sum 2.0") and "[[" in errors[4], errors[4]
