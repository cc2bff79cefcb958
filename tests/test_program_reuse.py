"""One compiled program serves every group of the same size and layout (CPU platform).

XLA:CPU's code does not depend on which devices run it: a program compiled for group [0, 1]
is loaded onto [0, 2] (or [1, 0]) with that group's device assignment, which decides which
process runs which group rank and whom XLA's gloo collectives talk to. A wrong assignment
shows in the data: a broadcast takes the wrong root, an all_gather or reduce_scatter puts
blocks in the wrong places. So every check here is against numpy, with data that differs by
rank and by position, on groups in reversed order over the same devices ([1, 0] after
[0, 1]), and the program's origin is checked too (reuse must have happened).

Tier (a): which groups share a program (fake devices). Tier (b): 3 ranks of "tpu" on CPU, one
device and one process each; and one process with four CPU devices: a reused program's
optimized HLO is what XLA compiles for its new devices, and without the private calls (a jax
that lacks them) each group compiles, logged once.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.fresh_process import cpu_devices_env, script_result
from tests.harness import World
from tpu_dist.collectives import ProgramKey
from tpu_dist.collectives._compile_cache import placement_key


# Groups of 2 of a 3-rank world, in creation order; group rank i is global rank ranks[i].
_GROUPS = [[0, 1], [0, 2], [1, 2], [1, 0], [2, 0]]
_SMALL = 5  # an all_reduce this small is an all-to-all exchange on CPU
_LARGE = 70_000  # 280 KB a rank: XLA's own all-reduce (ring)


def _data(rank: int, n: int) -> np.ndarray:
    """Rank ``rank``'s input of ``n`` floats, distinct by rank and position (exact in float32)."""
    return (np.arange(n) * (rank + 1) + 100 * rank).astype(np.float32)


def _expected(ranks: list[int], me: int) -> dict[str, list]:
    """What global rank ``me`` gets from the collectives of :func:`_run_groups` on ``ranks``."""
    size = len(ranks)
    small = [_data(r, _SMALL) for r in ranks]
    scatter_in = [_data(r, _SMALL * size) for r in ranks]
    mine = ranks.index(me)
    return {
        "all_reduce": np.sum(small, axis=0).tolist(),
        "all_reduce_large": np.sum([_data(r, _LARGE) for r in ranks], axis=0)[::997].tolist(),
        "all_gather": [b.tolist() for b in small],
        "reduce_scatter": np.sum(scatter_in, axis=0)[mine * _SMALL:(mine + 1) * _SMALL].tolist(),
        "broadcast_first": small[0].tolist(),
        "broadcast_last": small[-1].tolist(),
    }


def _run_groups(rank: int, world_size: int, groups: list[list[int]]) -> dict:
    """Every rank creates every group (sort_ranks=False: group rank i is ranks[i]); the members
    run an all_reduce (small and large), all_gather, reduce_scatter and two broadcasts (from
    the first and the last group rank). Returns, per group, the results and where this rank's
    programs for it came from."""
    import jax
    import torch
    import torch.distributed as dist

    from tpu_dist.collectives import _runtime

    # JAX's persistent cache (on in the suite) would serve compiles, and programs it loads are
    # never kept for reuse: off, so that this process really compiles.
    jax.config.update("jax_enable_compilation_cache", False)
    rt = _runtime.get()
    out: dict = {}
    for ranks in groups:
        group = dist.new_group(ranks, sort_ranks=False)
        if rank not in ranks:
            continue
        size = len(ranks)
        got: dict = {}
        t = torch.from_numpy(_data(rank, _SMALL))
        dist.all_reduce(t, group=group)
        got["all_reduce"] = t.tolist()
        t = torch.from_numpy(_data(rank, _LARGE))
        dist.all_reduce(t, group=group)
        got["all_reduce_large"] = t[::997].tolist()
        parts = [torch.empty(_SMALL) for _ in range(size)]
        dist.all_gather(parts, torch.from_numpy(_data(rank, _SMALL)), group=group)
        got["all_gather"] = [p.tolist() for p in parts]
        t = torch.empty(_SMALL)
        dist.reduce_scatter_tensor(t, torch.from_numpy(_data(rank, _SMALL * size)), group=group)
        got["reduce_scatter"] = t.tolist()
        for name, src in (("broadcast_first", ranks[0]), ("broadcast_last", ranks[-1])):
            t = torch.from_numpy(_data(rank, _SMALL))
            dist.broadcast(t, src=src, group=group)
            got[name] = t.tolist()
        ids = tuple(rt.devices[r].id for r in ranks)
        origins = sorted(o for key, o in rt.programs.origins.items() if key.devices == ids)
        # Loaded programs too start through the executable's own execute (decision 0002's fast
        # path, docs/decisions/).
        fast = all(p.execute is not None for k, p in rt.programs.by_key.items() if k.devices == ids)
        out[json.dumps(ranks)] = {"results": got, "origins": origins, "fast": fast}
    return out


def _check(results: list[dict], groups: list[list[int]]) -> dict[tuple[int, str], list[str]]:
    """Asserts every rank's results against numpy; returns (rank, group) -> origins."""
    origins = {}
    for rank, by_group in enumerate(results):
        for ranks in groups:
            name = json.dumps(ranks)
            if rank not in ranks:
                assert name not in by_group
                continue
            got = by_group[name]
            assert got["results"] == _expected(ranks, rank), (rank, ranks)
            assert got["fast"], (rank, ranks)
            # 6 collectives, 6 programs (two broadcast roots: two keys).
            assert len(got["origins"]) == 6, (rank, ranks, got["origins"])
            origins[rank, name] = got["origins"]
    return origins


def _world(cache: str) -> World:
    return World(3, "tpu", env={"TPU_DIST_PLATFORM": "cpu", "TPU_DIST_COMPILE_CACHE": cache},
                 timeout=180)


def test_groups_of_the_same_shape_reuse_one_compiled_program() -> None:
    # The first group a rank is in compiles; every later group of 2 loads that rank's programs
    # onto its own devices, [1, 0] and [2, 0] (the same devices as [0, 1] and [0, 2], group
    # ranks swapped) included.
    with _world("0") as world:
        origins = _check(world.run(_run_groups, _GROUPS), _GROUPS)
    first = {0: "[0, 1]", 1: "[0, 1]", 2: "[0, 2]"}
    for (rank, name), seen in origins.items():
        want = "compiled" if name == first[rank] else "reused"
        assert seen == [want] * 6, (rank, name, seen)


def test_entries_written_for_one_group_serve_another_in_a_later_world(tmp_path: Path) -> None:
    # World 1 writes group [0, 1]'s programs; world 2 (new processes) runs [1, 2] and [2, 0]
    # only, and compiles nothing: the entries are named by size and layout, not device ids.
    cache = str(tmp_path / "xla")
    with _world(cache) as world:
        written = _check(world.run(_run_groups, [[0, 1]]), [[0, 1]])
    # Each program compiled by rank 0 or 1; the slower of the two may find the other's entry.
    assert all(set(seen) <= {"compiled", "disk"} for seen in written.values()), written
    entries = sorted(path.name for path in Path(cache).glob("*.xla"))
    assert len(entries) == 6, entries  # ranks 0 and 1 wrote the same 6 names
    later = [[1, 2], [2, 0]]
    with _world(cache) as world:
        origins = _check(world.run(_run_groups, later), later)
    first = {0: "[2, 0]", 1: "[1, 2]", 2: "[1, 2]"}
    for (rank, name), seen in origins.items():
        # A rank's first group loads from disk; later ones may reuse what it loaded.
        assert set(seen) <= ({"disk"} if name == first[rank] else {"disk", "reused"}), (
            rank, name, seen)
    assert sorted(path.name for path in Path(cache).glob("*.xla")) == entries  # none new


_FALLBACK = textwrap.dedent(
    r"""
    import json, logging, re
    import jax, numpy as np
    from tpu_dist.collectives import _jaxlib, _lowering
    from tpu_dist.collectives._lowering import ProgramKey

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("tpu_dist.collectives._jaxlib").addHandler(Collect())
    devices = jax.devices("cpu")
    programs = _lowering.ProgramCache()
    programs.platform = "cpu"

    def run(ids):
        group = [devices[i] for i in ids]
        key = ProgramKey("broadcast", tuple(ids), ((4, "int32"),), (0,), "xla")
        blocks = [jax.device_put(np.arange(4, dtype=np.int32) + 10 * i, devices[i]) for i in ids]
        _, sharding = programs.mesh_for(group)
        x = jax.make_array_from_single_device_arrays((4 * len(ids),), sharding, blocks)
        (y,) = programs.program(key, group).compiled(x)
        shards = {s.device.id: np.asarray(s.data).tolist() for s in y.addressable_shards}
        return [shards[i] for i in ids], programs.origins[key]

    out = {"private": [run([0, 1]), run([3, 2])]}

    def code(compiled):  # the optimized HLO without source locations (stack frame numbering)
        text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
        return [b for b in text.split("\n\n") if not re.match(r"File|Function|StackFrames", b)]

    group = [devices[3], devices[2]]
    key = ProgramKey("broadcast", (3, 2), ((4, "int32"),), (0,), "xla")
    fresh = _lowering.lower(key, group).compile()
    out["same_code"] = code(programs.program(key, group).compiled) == code(fresh)
    _jaxlib._get_compile_options = None  # a jax without it
    out["public"] = [run([2, 0]), run([1, 3])]
    out["warnings"] = warnings
    print("RESULT" + json.dumps(out))
    """
)


def test_reused_code_is_a_fresh_compile_and_without_private_calls_each_group_compiles() -> None:
    env = cpu_devices_env(4, caches=False)
    out = script_result(_FALLBACK, env=env, timeout=120)

    def rooted(ids: list[int]) -> list[list[int]]:  # every device gets the root's block
        return [(np.arange(4) + 10 * ids[0]).tolist()] * len(ids)

    assert out["private"] == [[rooted([0, 1]), "compiled"], [rooted([3, 2]), "reused"]]
    assert out["same_code"]  # the reused program is what XLA compiles for [3, 2]
    assert out["public"] == [[rooted([2, 0]), "compiled"], [rooted([1, 3]), "compiled"]]
    assert len(out["warnings"]) == 1 and "compiling the program for each group" in (
        out["warnings"][0]), out["warnings"]


@dataclasses.dataclass(frozen=True)
class _Device:  # what placement_key reads of a jax.Device
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def test_placement_ignores_device_ids_on_cpu_only() -> None:
    def place(ids: list[int], processes: list[int], platform: str = "cpu") -> tuple:
        devices = [_Device(i, p, platform, platform) for i, p in zip(ids, processes)]
        key = ProgramKey("allreduce", tuple(ids), ((8, "float32"),), ("SUM",), "exchange")
        return placement_key(key, devices)

    # One device per process: any two ranks, either order, have the same layout.
    assert place([0, 1], [0, 1]) == place([3, 1], [3, 1]) == place([1, 0], [1, 0])
    # Another size, or two devices of one process against devices of two: another program.
    assert place([0, 1], [0, 1]) != place([0, 1, 2], [0, 1, 2])
    assert place([0, 1], [0, 0]) != place([0, 1], [0, 1])
    assert place([0, 1, 2], [0, 0, 1]) != place([0, 1, 2], [0, 1, 1])
    # TPU: each device set its own (the code may depend on the chips and links).
    assert place([0, 1], [0, 1], "tpu") != place([2, 3], [2, 3], "tpu")


@pytest.mark.parametrize("ranks", [[0, 1], [1, 0]])
def test_expected_values_differ_by_group_order(ranks: list[int]) -> None:
    # The reference itself tells the orders apart (else the checks above could not).
    assert _expected(ranks, 0) != _expected(ranks[::-1], 0)


_BUDGET = textwrap.dedent(
    r"""
    import json
    import jax, numpy as np
    from tpu_dist.collectives import _lowering
    from tpu_dist.collectives._lowering import ProgramKey

    devices = jax.devices("cpu")[:2]
    programs = _lowering.ProgramCache(budget_bytes=2 * _lowering.PROGRAM_BYTES + (1 << 18))
    programs.platform = "cpu"
    _, sharding = programs.mesh_for(devices)

    def run(n):  # an all_reduce of n floats over two devices, checked against numpy
        key = ProgramKey("allreduce", (0, 1), ((n, "float32"),), ("SUM",), "xla")
        data = [np.arange(n, dtype=np.float32) * (i + 1) for i in range(2)]
        blocks = [jax.device_put(d, dev) for d, dev in zip(data, devices)]
        x = jax.make_array_from_single_device_arrays((2 * n,), sharding, blocks)
        (y,) = programs.program(key, devices).compiled(x)
        ok = all(np.array_equal(np.asarray(s.data), data[0] + data[1]) for s in y.addressable_shards)
        return ok

    out = {"ok": [run(n) for n in (5, 6, 7)]}
    out["after_three"] = programs.info().__dict__
    out["ok"] += [run(6), run(5)]  # 6 is held (now the most recent); 5 was dropped: built again
    out["held"] = sorted(k.blocks[0][0] for k in programs.by_key)
    out["end"] = programs.info().__dict__
    print("RESULT" + json.dumps(out))
    """
)


def test_programs_past_the_budget_are_dropped_least_recently_used_first() -> None:
    out = script_result(_BUDGET, env=cpu_devices_env(2, caches=False), timeout=120)
    assert out["ok"] == [True] * 5
    three = out["after_three"]
    assert (three["programs"], three["built"], three["dropped"]) == (2, 3, 1), three
    assert three["bytes"] <= three["budget_bytes"], three
    assert out["held"] == [5, 6], out  # 7 was the least recently used when 5 came back
    assert (out["end"]["built"], out["end"]["dropped"]) == (4, 2), out["end"]
