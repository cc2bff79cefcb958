"""Backend semantics on 4 ranks: layouts, async works, groups, the program cache, bad input.

Rank groups used below (4 ranks):
    new_group([0, 2])            -> {0, 2}; ranks 1 and 3 are not members
    new_subgroups(2)             -> {0, 1}, {2, 3}
    init_device_mesh((2, 2))     -> dim 0 groups {0, 2}, {1, 3}; dim 1 groups {0, 1}, {2, 3}
    init_device_mesh((1, 2, 2))  -> dim 0 groups {r} (size 1), dims 1 and 2 as above
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import World


@pytest.fixture(scope="module")
def world() -> World:
    with World(4, backend="tpu") as w:
        yield w


def _layouts(rank: int, world_size: int) -> list[str]:
    problems = []
    total = sum(range(world_size))
    # a non-contiguous view: every second column of a matrix; the rest stays untouched
    base = torch.full((3, 4), float(rank))
    view = base[:, ::2]
    dist.all_reduce(view)
    if not (torch.all(base[:, ::2] == total) and torch.all(base[:, 1::2] == rank)):
        problems.append(f"strided all_reduce: {base.tolist()}")
    # a transposed view and a view with a storage offset
    base = torch.arange(12.0).reshape(3, 4) + 100 * rank
    dist.broadcast(base.t(), src=1)
    if not torch.equal(base, torch.arange(12.0).reshape(3, 4) + 100):
        problems.append(f"transposed broadcast: {base.tolist()}")
    store = torch.zeros(10, dtype=torch.int64)
    window = store[3:7]
    window.fill_(rank + 1)
    dist.all_reduce(window, op=dist.ReduceOp.MAX)
    if store.tolist() != [0, 0, 0] + [world_size] * 4 + [0, 0, 0]:
        problems.append(f"offset all_reduce: {store.tolist()}")
    # all_gather into a non-contiguous output
    out = torch.zeros(world_size, 6)[:, ::2]
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    if not torch.equal(out, torch.arange(world_size, dtype=torch.float32)[:, None].expand(-1, 3)):
        problems.append(f"strided all_gather output: {out.tolist()}")
    # empty and 0-d tensors
    empty = torch.empty(0, 3)
    dist.all_reduce(empty)
    outs = [torch.empty(0) for _ in range(world_size)]
    dist.all_gather(outs, torch.empty(0))
    scalar = torch.tensor(float(rank + 1))
    dist.all_reduce(scalar, op=dist.ReduceOp.PRODUCT)
    want = 1.0
    for r in range(world_size):
        want *= r + 1
    if scalar.item() != want or scalar.dim() != 0:
        problems.append(f"0-d all_reduce: {scalar}")
    gathered = torch.empty(world_size)
    dist.all_gather_into_tensor(gathered, torch.tensor(float(rank)))
    if gathered.tolist() != [float(r) for r in range(world_size)]:
        problems.append(f"0-d all_gather: {gathered.tolist()}")
    return problems


def test_layouts_views_offsets_empty_scalars(world: World) -> None:
    assert world.run(_layouts) == [[]] * 4


def _async_works(rank: int, world_size: int) -> list[str]:
    problems = []
    total = float(sum(range(world_size)))
    t = torch.full((1000,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed():
        if time.monotonic() > deadline:
            problems.append("is_completed() never became True")
            break
        time.sleep(0.001)
    if not torch.all(t == total):
        problems.append("is_completed() was True before the output was written")
    if work.wait() is not True or not work.is_success():
        problems.append("wait() did not return True")
    # get_future: value is the list of outputs, as on gloo, and then() chains
    t = torch.full((7,), float(rank))
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    if doubled.wait().tolist() != [2 * total] * 7 or fut.value()[0] is not t:
        problems.append(f"future value: {fut.value()}")
    # several works in flight, waited in reverse order
    tensors = [torch.full((5,), float(rank * i)) for i in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in tensors]
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(tensors):
        if not torch.all(x == total * i):
            problems.append(f"in-flight work {i}: {x.tolist()}")
    return problems


def test_async_work_wait_is_completed_future(world: World) -> None:
    assert world.run(_async_works) == [[]] * 4


def _dropped_works_are_freed(rank: int, world_size: int) -> list[str]:
    """A work the caller drops, waited on or not, is freed with the outputs it holds at once,
    not at the next run of Python's cyclic collector (issue 51: works closed over themselves,
    and FSDP2's gradient buffers stayed alive step after step)."""
    import gc
    import weakref

    problems = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for async_op in (False, True):
            out = torch.empty(world_size * 1000)
            work = dist.all_gather_into_tensor(
                out, torch.full((1000,), float(rank)), async_op=True
            )
            if not async_op:
                work.wait()
            freed_work, freed_out = weakref.ref(work), weakref.ref(out)
            del work, out
            dist.barrier()  # completes the dropped work first (in issue order)
            if freed_work() is not None or freed_out() is not None:
                problems.append(
                    f"waited={not async_op}: work alive {freed_work() is not None}, "
                    f"output alive {freed_out() is not None}"
                )
    finally:
        if enabled:
            gc.enable()
    return problems


def test_dropped_works_and_their_outputs_are_freed(world: World) -> None:
    assert world.run(_dropped_works_are_freed) == [[]] * 4


def _async_returns_before_peers_arrive(rank: int, world_size: int) -> dict:
    """Rank 0 issues async collectives while the others are still asleep; a synchronous call
    right after them still runs after them (the same order on every rank)."""
    total = float(sum(range(world_size)))
    small = torch.full((8,), float(rank))      # XLA:CPU would run this inline, blocking
    gathered = torch.empty(world_size * 3)
    dist.barrier()
    if rank != 0:
        time.sleep(1.5)
    began = time.monotonic()
    first = dist.all_reduce(small, async_op=True)
    second = dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank)), async_op=True)
    returned_after = time.monotonic() - began
    done_early = first.is_completed()
    after = torch.full((4,), float(rank))
    dist.all_reduce(after, op=dist.ReduceOp.MAX)  # sync: must not overtake the two above
    second.wait()
    first.wait()
    return {
        "returned_after": returned_after,
        "done_early": done_early,
        "values": [small.tolist() == [total] * 8,
                   gathered.tolist() == [float(r) for r in range(world_size) for _ in range(3)],
                   after.tolist() == [float(world_size - 1)] * 4],
    }


def test_async_op_returns_before_the_data_moves(world: World) -> None:
    results = world.run(_async_returns_before_peers_arrive)
    assert all(r["values"] == [True, True, True] for r in results), results
    # Rank 0 got both works back while ranks 1..3 slept 1.5 s, and they were not done then.
    assert results[0]["returned_after"] < 0.5, results[0]
    assert results[0]["done_early"] is False, results[0]


def _timed_wait(rank: int, world_size: int) -> dict:
    """Rank 0 waits 0.2 s for an all_reduce its peers join 1 s late; then waits for good."""
    t = torch.full((4,), float(rank))
    dist.barrier()
    if rank != 0:
        time.sleep(1.0)
    work = dist.all_reduce(t, async_op=True)
    out: dict = {}
    if rank == 0:
        began = time.monotonic()
        try:
            out["first"] = work.wait(timeout=timedelta(milliseconds=200))
        except RuntimeError as err:
            out["first"] = type(err).__name__ + (": timed out" if "timed out" in str(err) else str(err))
        out["elapsed"] = time.monotonic() - began
        out["completed_after_timeout"] = work.is_completed()
    out["second"] = work.wait()
    out["value"] = t.tolist()
    later = torch.ones(2)
    out["long_enough"] = dist.all_reduce(later, async_op=True).wait(timeout=timedelta(seconds=60))
    out["later"] = later.tolist()
    return out


def test_wait_with_a_timeout_behaves_as_on_gloo(
    world: World, worlds: Callable[..., World]
) -> None:
    # gloo (c10d's Work::wait): RuntimeError("Operation timed out!"), the collective stays in
    # flight and a later wait() completes it.
    for results in (world.run(_timed_wait), worlds(4, backend="gloo").run(_timed_wait)):
        total = float(sum(range(4)))
        assert results[0]["first"] == "RuntimeError: timed out", results[0]
        assert 0.15 < results[0]["elapsed"] < 0.9, results[0]
        assert results[0]["completed_after_timeout"] is False, results[0]
        for r in results:
            assert r["second"] is True and r["value"] == [total] * 4, r
            assert r["long_enough"] is True and r["later"] == [4.0, 4.0], r


def _subgroups(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    problems = []
    # new_group over a strided subset, created on every rank as torch requires
    evens = dist.new_group([0, 2])
    if rank in (0, 2):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=evens)
        if t.item() != 4.0:
            problems.append(f"new_group([0, 2]) all_reduce: {t.item()}")
        out = [torch.empty(1) for _ in range(2)]
        dist.all_gather(out, torch.tensor([float(rank)]), group=evens)
        if [o.item() for o in out] != [0.0, 2.0]:
            problems.append(f"new_group all_gather: {out}")
        # broadcast with a global src rank inside the group
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=2, group=evens)
        if b.item() != 2.0:
            problems.append(f"new_group broadcast from global 2: {b.item()}")
    # new_subgroups: {0, 1}, {2, 3}
    mine, _ = dist.new_subgroups(group_size=2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    want = 1.0 if rank < 2 else 5.0
    if t.item() != want:
        problems.append(f"new_subgroups all_reduce: {t.item()} != {want}")
    # send/recv inside a subgroup, with group ranks
    x = torch.tensor([float(rank * 10)])
    if rank % 2 == 0:
        dist.send(x, group_dst=1, group=mine)
    else:
        dist.recv(x, group_src=0, group=mine)
        if x.item() != (rank - 1) * 10:
            problems.append(f"subgroup recv: {x.item()}")
    # 2-D and 3-D device meshes: many groups alive at once
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim, name in enumerate(("dp", "tp")):
        group = mesh.get_group(name)
        members = dist.get_process_group_ranks(group)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        if t.item() != float(sum(members)):
            problems.append(f"mesh dim {name} ({members}) all_reduce: {t.item()}")
    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    for name in ("pp", "dp", "tp"):
        group = mesh3.get_group(name)
        members = dist.get_process_group_ranks(group)
        out = torch.empty(len(members))
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=group)
        if out.tolist() != [float(m) for m in members]:
            problems.append(f"3-D mesh dim {name} all_gather: {out.tolist()} != {members}")
    # the default group still works with all of these alive
    t = torch.ones(1)
    dist.all_reduce(t)
    if t.item() != world_size:
        problems.append("default group after subgroups")
    return problems


def test_subgroups_and_device_meshes(world: World) -> None:
    assert world.run(_subgroups, timeout=180) == [[]] * 4


def _split_group(rank: int, world_size: int) -> str:
    try:
        dist.split_group(split_ranks=[[0, 1], [2, 3]])
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_split_group_is_refused_clearly(world: World) -> None:
    # torch 2.13 only splits NCCL/XCCL groups (it refuses gloo the same way).
    messages = world.run(_split_group)
    assert all("split" in m for m in messages), messages


def _steady_loop(rank: int, world_size: int) -> list[int]:
    import tpu_dist.collectives as tc

    counts = []
    for step in range(4):
        grads = torch.full((64,), float(rank + step))
        dist.all_reduce(grads, op=dist.ReduceOp.AVG)
        full = torch.empty(world_size * 16)
        dist.all_gather_into_tensor(full, grads[:16].contiguous())
        shard = torch.empty(16)
        dist.reduce_scatter_tensor(shard, full)
        dist.broadcast(grads, src=0)
        dist.barrier()
        counts.append(tc.compile_count())
    return counts


def test_steady_loop_compiles_nothing_after_first_step(world: World) -> None:
    for counts in world.run(_steady_loop):
        assert counts[1:] == [counts[0]] * 3, counts


def _both_dispatch_paths(rank: int, world_size: int) -> list[str]:
    """The same calls through the executable's own ``execute`` and through the public
    ``Compiled.__call__`` on global arrays (the fallback when jaxlib's private call is gone)."""
    from tpu_dist.collectives import _lowering, _runtime

    def calls() -> list[torch.Tensor]:
        a = torch.arange(6, dtype=torch.float64) * (rank + 1) + 2**40   # exact beyond 32 bits
        dist.all_reduce(a)
        gathered = torch.empty(world_size * 3, dtype=torch.int16)
        dist.all_gather_into_tensor(gathered, torch.full((3,), rank, dtype=torch.int16))
        pair = [torch.zeros(2), torch.ones(2) * rank]
        dist.all_reduce_coalesced(pair)                                   # two blocks, one program
        return [a, gathered, *pair]

    direct = calls()
    problems = []
    programs = _runtime.get().programs.by_key
    if not all(p.execute is not None for p in programs.values()):
        problems.append("a program has no direct execute")
    saved = dict(programs)
    for key, found in saved.items():
        programs[key] = _lowering.Program(found.compiled, None)
    try:
        public = calls()
    finally:
        programs.update(saved)
    total = sum(range(1, world_size + 1))
    want = [
        torch.arange(6, dtype=torch.float64) * total + world_size * 2**40,
        torch.arange(world_size, dtype=torch.int16).repeat_interleave(3),
        torch.zeros(2),
        torch.ones(2) * sum(range(world_size)),
    ]
    for name, results in (("direct", direct), ("public", public)):
        for got, expected in zip(results, want):
            if not torch.equal(got, expected):
                problems.append(f"{name}: {got.tolist()} != {expected.tolist()}")
    return problems


def test_direct_and_public_dispatch_agree(world: World) -> None:
    assert world.run(_both_dispatch_paths) == [[]] * 4


def _both_lowerings(rank: int, world_size: int) -> list[str]:
    """On CPU, small all-reduces and all-gathers run as direct all-to-all exchanges and large
    ones as XLA's rings; both give the exact results, for lengths that do not divide evenly.
    reduce_scatter is an exchange at every size on CPU; its XLA lowering (what TPUs run) is
    checked too, with the choice forced."""
    from tpu_dist.collectives import _plan_collectives

    pg = dist.distributed_c10d._get_default_group()
    small = 1001                                                   # padded to 1004 inside
    large = 256 * 1024 // 4 + 5                                    # float32: over the limit
    problems = []
    for numel, direct in ((small, True), (large, False)):
        plan = _plan_collectives.all_reduce(pg._view, [torch.empty(numel)], dist.ReduceOp.SUM)
        if plan.key.algorithm != ("exchange" if direct else "xla"):
            problems.append(f"{numel} elements: direct exchange should be {direct}")
        for dtype in (torch.float32, torch.int32, torch.bfloat16):
            def value(r: int) -> torch.Tensor:  # small integers: exact in every dtype and op
                return ((torch.arange(numel) % 3) + 1 + (r % 2)).to(dtype)

            everyone = torch.stack([value(r) for r in range(world_size)]).to(torch.float64)
            ops = {"SUM": everyone.sum(0), "MAX": everyone.amax(0), "PRODUCT": everyone.prod(0)}
            if dtype.is_floating_point:
                ops["AVG"] = everyone.mean(0)
            for op, want in ops.items():
                t = value(rank)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                if not torch.equal(t.to(torch.float64), want):
                    problems.append(f"all_reduce {op} {dtype} x{numel}")
        gathered = torch.empty(world_size * numel, dtype=torch.int16)
        dist.all_gather_into_tensor(gathered, torch.full((numel,), rank, dtype=torch.int16))
        ranks = torch.arange(world_size, dtype=torch.int16)
        if not torch.equal(gathered, ranks.repeat_interleave(numel)):
            problems.append(f"all_gather x{numel}")
        chunk = torch.empty(numel)
        full = torch.arange(world_size * numel, dtype=torch.float32) + rank
        dist.reduce_scatter_tensor(chunk, full)
        want = (torch.arange(numel) + rank * numel) * world_size + sum(range(world_size))
        if not torch.equal(chunk, want.to(torch.float32)):
            problems.append(f"reduce_scatter x{numel}")
    for op in ("SUM", "MAX"):
        chunk = torch.empty(7)            # a size no other call here compiled
        plan = _plan_collectives.reduce_scatter_tensor(
            pg._view, chunk, torch.arange(world_size * 7.0) + rank, getattr(dist.ReduceOp, op)
        )
        pg._run(_with_algorithm(plan, "xla")).wait()
        rows = torch.stack([torch.arange(world_size * 7.0) + r for r in range(world_size)])
        want = (rows.sum(0) if op == "SUM" else rows.amax(0)).view(world_size, 7)[rank]
        if not torch.equal(chunk, want):
            problems.append(f"reduce_scatter {op} through XLA's reduce-scatter")
    return problems


def _with_algorithm(plan, algorithm: str):
    """``plan`` with its program's algorithm chosen by the test (any op, any size)."""
    import dataclasses

    return dataclasses.replace(plan, key=dataclasses.replace(plan.key, algorithm=algorithm))


def test_direct_exchanges_and_rings_agree_with_reference(world: World) -> None:
    assert world.run(_both_lowerings) == [[]] * 4


def _tpu_wide_lowerings(rank: int, world_size: int) -> list[str]:
    """On TPU, float64/int64 MIN/MAX all-reduces gather and reduce locally, and float64 and
    complex reduce-scatters are an all-to-all and a local reduction (XLA:TPU's collectives
    reject those types; tests/test_tpu_compile.py compiles them with libtpu). The same bodies,
    forced here on CPU, against a float64/complex128 reference."""
    from tpu_dist.collectives import _plan_collectives

    pg = dist.distributed_c10d._get_default_group()
    problems = []
    n = 13  # a size no other call here compiled
    for dtype in (torch.float64, torch.int64):
        for op in ("MAX", "MIN"):
            rows = torch.stack([(torch.arange(n) * (r + 1)) % 7 - r for r in range(world_size)])
            t = rows[rank].to(dtype).clone()
            plan = _plan_collectives.all_reduce(pg._view, [t], getattr(dist.ReduceOp, op))
            pg._run(_with_algorithm(plan, "gather_reduce")).wait()
            want = rows.amax(0) if op == "MAX" else rows.amin(0)
            if not torch.equal(t, want.to(dtype)):
                problems.append(f"all_reduce {op} {dtype}: {t.tolist()} != {want.tolist()}")
    for dtype in (torch.float64, torch.complex64):
        full = torch.stack([torch.arange(world_size * 3) * (r + 1) for r in range(world_size)])
        full = full.to(dtype) * (1 + 1j if dtype.is_complex else 1)
        chunk = torch.empty(3, dtype=dtype)
        plan = _plan_collectives.reduce_scatter_tensor(pg._view, chunk, full[rank].clone(), dist.ReduceOp.SUM)
        pg._run(_with_algorithm(plan, "exchange")).wait()
        want = full.sum(0).view(world_size, 3)[rank]
        if not torch.equal(chunk, want):
            problems.append(f"reduce_scatter SUM {dtype}: {chunk.tolist()} != {want.tolist()}")
    return problems


def test_tpu_lowerings_of_wide_dtypes_agree_with_reference(world: World) -> None:
    assert world.run(_tpu_wide_lowerings) == [[]] * 4


def _zero_copy(rank: int, world_size: int) -> list[str]:
    """Blocks go to JAX without a copy (DLPack), for every dtype a collective sends."""
    from tpu_dist.collectives import _runtime

    problems = []
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64,
              torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
    for dtype in dtypes:
        t = torch.ones(1024, dtype=dtype)  # torch's CPU allocator aligns to 64 bytes
        array = _runtime.to_jax(t)
        if array.unsafe_buffer_pointer() != t.data_ptr():
            problems.append(f"{dtype}: the JAX array does not share the tensor's memory")
        if str(array.dtype) != str(dtype).removeprefix("torch."):
            problems.append(f"{dtype}: became {array.dtype}")
    # An offset view is shared too, where its address keeps XLA's alignment (a 64-byte step).
    base = torch.zeros(64)
    view = base[16:32]
    if _runtime.to_jax(view).unsafe_buffer_pointer() != view.data_ptr():
        problems.append("a 64-byte-aligned offset view was copied")
    return problems


def test_blocks_reach_jax_without_a_copy(world: World) -> None:
    assert world.run(_zero_copy) == [[]] * 4


def _bad_calls(rank: int, world_size: int) -> list[tuple[str, str]]:
    """Each bad call must raise on the calling rank before anything is sent."""
    outcomes = []

    def attempt(name, fn, tensor):
        before = tensor.clone()
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as err:
            unchanged = torch.equal(before, tensor)
            outcomes.append((name, f"{type(err).__name__}: {err}" if unchanged else "input modified"))
        else:
            outcomes.append((name, "no error"))

    x = torch.arange(6.0) + rank
    attempt("wrong output size",
            lambda: dist.all_gather_into_tensor(torch.empty(world_size * 6 + 1), x), x)
    attempt("wrong list length",
            lambda: dist.all_gather([torch.empty(6)] * (world_size + 1), x), x)
    attempt("bad splits",
            lambda: dist.all_to_all_single(torch.empty(6), x, [1] * world_size, [5] + [0] * (world_size - 1)), x)
    attempt("uneven rows", lambda: dist.all_to_all_single(torch.empty(6), x[:5].clone()), x)
    attempt("bad root", lambda: dist.broadcast(x, src=world_size + 3), x)
    attempt("bitwise op on float", lambda: dist.all_reduce(x, op=dist.ReduceOp.BAND), x)
    i = torch.arange(4)
    attempt("AVG on int", lambda: dist.all_reduce(i, op=dist.ReduceOp.AVG), i)
    m = torch.empty(3, device="meta")
    attempt("meta device", lambda: dist.all_reduce(m), torch.empty(0))
    attempt("unsupported dtype", lambda: dist.all_reduce(torch.zeros(2, dtype=torch.uint16)), x)
    attempt("send to self", lambda: dist.send(x, rank), x)
    attempt("dtype mismatch",
            lambda: dist.all_gather_into_tensor(torch.empty(world_size * 6, dtype=torch.int32), x), x)
    # the group is still usable
    ok = torch.ones(2)
    dist.all_reduce(ok)
    outcomes.append(("usable after", str(ok.tolist())))
    return outcomes


def test_bad_calls_raise_before_communicating(world: World) -> None:
    for outcomes in world.run(_bad_calls):
        for name, message in outcomes[:-1]:
            assert message.startswith(("ValueError", "TypeError", "RuntimeError")), (name, message)
        assert outcomes[-1] == ("usable after", "[4.0, 4.0]")
    messages = dict(world.run(_bad_calls)[0])
    assert "25" in messages["wrong output size"]  # the actual element count is named
    assert "BAND" in messages["bitwise op on float"] and "float32" in messages["bitwise op on float"]
    assert "uint16" in messages["unsupported dtype"]
