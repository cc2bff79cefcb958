"""Issue 33 measurements: "family" programs (one program over all devices of a family of groups, the
family's groups as replica groups) against today's subset programs (one program over just one
group's devices). Reports; asserts nothing. Notes and results:
docs/decisions/0020-family-programs-study.md.

Each part is its own subcommand (run with your tree first on PYTHONPATH):

    python benchmarks/family_programs.py tpu  [--topologies v5e:16x16,...] [--mesh3d] [--out FILE.jsonl]
    python benchmarks/family_programs.py pair [--topologies ...] [--out FILE.jsonl]
    python benchmarks/family_programs.py cpu  [--nprocs 4 2] [--iters N] [--sizes B ...] [--kinds K ...]
    python benchmarks/family_programs.py groups            # what a c10d backend creator sees
    python benchmarks/family_programs.py table FILE.jsonl  # the tpu/pair results as markdown
    python benchmarks/family_programs.py probe             # v6e subsets; TPU7x whole-slice all-gather

``tpu``: for each topology (libtpu compile-only devices), a (dp, tp=8) mesh planned by
``tpu_dist.mesh.plan_mesh`` (as ``tpu_dist.mesh.init_device_mesh`` lays out the FSDP2 x TP
example), each program kind of ``tpu_dist/collectives/_lowering.py`` over each axis, in two
forms: ``subset`` (today's program: ``compile_collective`` over the devices of rank 0's group,
and for dp also rank 1's group) and ``family`` (``shard_map`` over the 2-D mesh of the whole
topology, the kind's body over the group axis). Every compile runs in a child process (a libtpu
compiler crash is a signal); a child that dies is restarted after the case that killed it.
Replica groups read from ``compiled.as_text()`` are mapped back to ranks and compared with the
family's groups.

``pair``: two-rank programs (a ``new_group([0, 1])`` that is not a family) on v5e/v6e: subset
ppermute / psum over the two devices, and world-spanning forms (ppermute over a 1-D mesh of the
whole slice whose permutation only moves between ranks 0 and 1; psum with
``axis_index_groups``).

``cpu``: XLA:CPU across 2 and 4 processes (``jax.distributed`` + gloo, one CPU device each),
tpu_dist's own bodies with the algorithm ``_plan_algorithms.choose_algorithm`` picks on CPU: subset program
(each group its own program, only its members call it) vs family program (one program over all
devices, every process calls it), alternating calls, time per call at 4 KiB and 16 MiB per
rank; results checked against numpy; gloo contexts read from the coordination service's
key-value store (``cpu:gloo/<device ids>/<rank>``); last, a family program called only by the
members of one group (does it need the other processes?).

``groups``: a 4-rank job (gloo underneath) whose backend "logpg" is registered with
``extended_api=True`` and logs every creator call; ``_new_process_group_helper`` is wrapped to
log every ``new_group`` as every rank sees it (members and non-members).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

def _read_json(path):
    with open(path) as fh:
        return json.load(fh)


# ---------------------------------------------------------------------------------------------
# part "tpu": compile matrix

TOPOLOGIES = {
    # name: (generation, shape, num_slices, mesh (dp, tp) inside the whole topology)
    "v5e:16x16": ("v5e", "16x16", 1),
    "v6e:16x16": ("v6e", "16x16", 1),
    "v6e:4x8": ("v6e", "4x8", 1),
    "v6e:16x16x4slices": ("v6e", "16x16", 4),
    "v5p:4x4x4x2slices": ("v5p", "4x4x4", 2),
    "tpu7x:4x4x4": ("tpu7x", "4x4x4", 1),
    # not in the default run (8,192 devices; run with --topologies tpu7x:16x16x16 --cases ...)
    "tpu7x:16x16x16": ("tpu7x", "16x16x16", 1),
}
DEFAULT_TOPOLOGIES = [t for t in TOPOLOGIES if t != "tpu7x:16x16x16"]
TP = 8
MESH_3D = (4, 8, TP)
"""``--mesh3d``: a (dp, fsdp, tp) mesh instead of (dp, tp); the families of dp and fsdp."""
BLOCK = 8192  # elements per rank: divisible by every group size used (<= 128)

# (case name, kind, algorithm, dtype, params)
KINDS = [
    ("allreduce/psum", "allreduce", "xla", "float32", ("SUM",)),
    ("allreduce/pmax", "allreduce", "xla", "float32", ("MAX",)),
    ("allreduce/pmin", "allreduce", "xla", "float32", ("MIN",)),
    ("allreduce/gather_reduce PRODUCT", "allreduce", "gather_reduce", "float32", ("PRODUCT",)),
    ("allgather", "allgather", "xla", "float32", ()),
    ("reduce_scatter/psum_scatter", "reduce_scatter", "xla", "float32", ("SUM",)),
    ("alltoall", "alltoall", "xla", "int32", ()),
    ("permute ring", "permute", "xla", "int32", "RING"),
    ("broadcast root0", "broadcast", "xla", "int32", (0,)),
    ("scatter root0", "scatter", "xla", "int32", (0,)),
    ("barrier", "barrier", "xla", "int32", ()),
    ("exchange allreduce", "allreduce", "exchange", "float32", ("SUM",)),
    ("exchange allgather", "allgather", "exchange", "float32", ()),
    ("exchange reduce_scatter", "reduce_scatter", "exchange", "float32", ("SUM",)),
]


def _plan(topo_name, mesh3d=False):
    from tpu_dist.mesh import Topology, plan_mesh

    gen, shape, slices = TOPOLOGIES[topo_name]
    topo = Topology.create(gen, shape, num_slices=slices)
    n = topo.num_devices
    if mesh3d:
        return topo, plan_mesh(topo, (n // (MESH_3D[1] * TP), MESH_3D[1], TP))
    grid = plan_mesh(topo, (n // TP, TP))  # (dp, tp): ranks
    return topo, grid


def _families(grid, axis):
    """The groups of ``axis`` ("dp", "tp"; 3-D: "dp", "fsdp", "tp") as rank lists in
    group-rank order, and the mesh as 2-D (every other axis, that axis)."""
    names = ("dp", "tp") if grid.ndim == 2 else ("dp", "fsdp", "tp")
    k = names.index(axis)
    g = np.moveaxis(grid, k, -1).reshape(-1, grid.shape[k])
    return [list(map(int, row)) for row in g], g


def _key(case, size):
    from tpu_dist.collectives import ProgramKey

    _, kind, algo, dtype, params = case
    if params == "RING":
        params = tuple((i, (i + 1) % size) for i in range(size))
    length = 1 if kind == "barrier" else BLOCK
    return ProgramKey(kind, tuple(range(size)), ((length, dtype),), params, algo)


def _read_groups(text, flat_ranks, slice_of=None, id_to_rank=None):
    """Collectives of the HLO with replica groups mapped from program positions to ranks.

    Multi-slice (``slice_of`` given): the replica groups of in-slice collectives count
    positions among one slice's devices (slice 0's, in program order); checked against the
    dp family, whose program order interleaves slices (flat positions would mix slices).
    Collective-permute pairs are mapped through the flat order."""
    from tpu_dist.collectives.compile_only import hlo_collectives

    in_slice = flat_ranks if slice_of is None else [
        r for r in flat_ranks if int(slice_of(r)) == 0]
    out = []
    for c in hlo_collectives(text):
        table = flat_ranks if c.op == "collective-permute" else in_slice
        groups = [[table[p] for p in g] for g in c.replica_groups]
        out.append({"op": c.op, "groups": groups, "megascale": c.megascale_transfer})
    if id_to_rank:
        # A send to the multi-slice runtime whose target lists several device-id groups
        # ({{100000,...},{...}}: cross-slice all-to-all) is not read by hlo_collectives
        # (libtpu 0.0.52 spelling); read its groups here, device ids -> ranks.
        for line in text.splitlines():
            m = re.search(r"\ssend\(.*_xla_megascale_target=\{((?:\{[\d,]+\},?)+)\}", line)
            if m is None or m.group(1).count("{") < 2:
                continue
            groups = [[id_to_rank.get(int(v), -1) for v in g.split(",")]
                      for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
            out.append({"op": "megascale-send-groups", "groups": groups, "megascale": "groups"})
    return out


def _compile_family(case, devices_by_rank, grid_axis_last):
    """shard_map over the (other, x) mesh of every device; the body over "x"."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpu_dist.collectives import _lowering, _runtime

    size = grid_axis_last.shape[1]
    key = _key(case, size)
    devs = np.vectorize(lambda r: devices_by_rank[r], otypes=[object])(grid_axis_last)
    mesh = Mesh(devs, ("other", _lowering.AXIS))
    spec = P(("other", _lowering.AXIS))
    body = _lowering.body_for(key, [None] * size)
    n = len(key.blocks)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n, out_specs=(spec,) * n,
                           check_vma=False)
    sharding = NamedSharding(mesh, spec)
    total = devs.size
    args = [jax.ShapeDtypeStruct((total * length,), jnp.dtype(dt), sharding=sharding)
            for length, dt in key.blocks]
    t0 = time.perf_counter()
    with _runtime.x64_scope():
        compiled = jax.jit(mapped).lower(*args).compile()
    dt_ = time.perf_counter() - t0
    # program positions = the mesh's devices in flat order
    flat_ranks = [int(r) for r in grid_axis_last.reshape(-1)]
    return compiled.as_text(), flat_ranks, dt_


def _compile_subset(case, devices_by_rank, group):
    from tpu_dist.collectives.compile_only import compile_collective

    key = _key(case, len(group))
    t0 = time.perf_counter()
    res = compile_collective(key, [devices_by_rank[r] for r in group])
    return res.hlo_text, list(group), time.perf_counter() - t0


def _tpu_child(spec):
    """Runs in a child: compile cases[start:] of one (topology, axis, form), one JSON line each,
    flushed before the next compile starts (a crash then names the case that killed it)."""
    from tpu_dist.collectives.compile_only import topology_devices

    topo_name, axis, form, start = spec["topology"], spec["axis"], spec["form"], spec["start"]
    topo, grid = _plan(topo_name, spec.get("mesh3d", False))
    devices = topology_devices(topo)
    groups, g = _families(grid, axis)
    for i, case in enumerate(KINDS):
        if i < start or (spec.get("cases") and case[0] not in spec["cases"]):
            continue
        print(json.dumps({"event": "start", "i": i}), flush=True)
        row = {"topology": topo_name + ("/3d" if spec.get("mesh3d") else ""), "axis": axis, "form": form, "case": case[0],
               "group_size": len(groups[0]), "n_groups": len(groups),
               "num_slices": topo.num_slices}
        try:
            if form == "family":
                text, flat, secs = _compile_family(case, devices, g)
                row["expected_groups"] = groups
                chosen = groups
            else:
                which = int(form.split(":")[1])  # subset:K = the group holding rank K
                group = next(gr for gr in groups if which in gr)
                text, flat, secs = _compile_subset(case, devices, group)
                row["expected_groups"] = [group]
                chosen = [group]
            if topo.num_slices > 1:  # multi-slice HLO: each slice's part of each group
                slice_of = topo.slice_of
                row["expected_in_slice"] = [
                    [r for r in gr if int(slice_of(r)) == sl]
                    for sl in range(topo.num_slices) for gr in chosen
                    if any(int(slice_of(r)) == sl for r in gr)]
            row["ok"] = True
            row["seconds"] = round(secs, 2)
            row["collectives"] = _read_groups(
                text, flat, topo.slice_of if topo.num_slices > 1 else None,
                {d.id: r for r, d in enumerate(devices)} if topo.num_slices > 1 else None)
        except Exception as err:  # noqa: BLE001  (reported, not raised)
            row["ok"] = False
            row["error"] = f"{type(err).__name__}: {str(err)[:600]}"
        print(json.dumps({"event": "row", "i": i, "row": row}), flush=True)


def _groups_verdict(row):
    """Do the HLO's replica groups equal the expected groups? ('yes', 'no: ...', or 'n/a')."""
    if not row.get("ok"):
        return ""
    exp = sorted(tuple(g) for g in row["expected_groups"])
    exp_sets = sorted(tuple(sorted(g)) for g in row["expected_groups"])
    seen = []
    for c in row["collectives"]:
        if c["op"] == "megascale-send" or not c["groups"]:
            continue
        if c["op"] == "megascale-send-groups":
            got_sets = sorted(tuple(sorted(g)) for g in c["groups"])
            seen.append("dcn-groups-equal" if got_sets == exp_sets else "dcn-groups-DIFFERENT")
            continue
        if c["op"] == "collective-permute":
            pairs = [tuple(p) for p in c["groups"]]
            ok = all(any(a in g and b in g for g in exp_sets) for a, b in pairs)
            seen.append("pairs-in-groups" if ok else "pairs-cross-groups")
            continue
        got = sorted(tuple(g) for g in c["groups"])
        got_sets = sorted(tuple(sorted(g)) for g in c["groups"])
        if got == exp:
            seen.append("equal")
        elif got_sets == exp_sets:
            seen.append("equal-as-sets")
        elif row.get("expected_in_slice") and _per_slice(got, row["expected_in_slice"],
                                                            row["num_slices"]):
            seen.append("equal-per-slice")  # the groups' parts in one slice (+ DCN transfer)
        elif all(any(set(g) <= set(e) for e in exp_sets) for g in got_sets):
            seen.append("within-groups")  # e.g. hierarchical parts inside one slice
        else:
            seen.append("DIFFERENT")
    return ",".join(sorted(set(seen))) or "no-groups"


def _per_slice(got, expected_in_slice, num_slices):
    """``got`` (HLO groups as ranks) equals the in-slice parts of the expected groups in one
    slice: a multi-slice program lists one slice's groups, the rest crosses DCN.
    ``expected_in_slice`` is slice-major (see _tpu_child)."""
    per = len(expected_in_slice) // num_slices
    got = sorted(tuple(g) for g in got)
    return any(
        sorted(tuple(p) for p in expected_in_slice[i:i + per]) == got
        for i in range(0, len(expected_in_slice), per)
    )


def run_tpu(args):
    topos = args.topologies.split(",") if args.topologies else DEFAULT_TOPOLOGIES
    out = open(args.out, "a") if args.out else None  # noqa: SIM115  (open for the whole run)
    forms_for = {"tp": ["family", "subset:0"], "dp": ["family", "subset:0", "subset:1"],
                 "fsdp": ["family", "subset:0"]}
    axes = ("fsdp", "dp") if args.mesh3d else ("tp", "dp")
    for topo_name in topos:
        for axis in axes:
            for form in forms_for[axis]:
                if args.forms and form.split(":")[0] not in args.forms:
                    continue
                start = 0
                while start < len(KINDS):
                    spec = {"topology": topo_name, "axis": axis, "form": form, "start": start,
                            "mesh3d": args.mesh3d,
                            "cases": args.cases.split(",") if args.cases else []}
                    proc = subprocess.Popen(
                        [sys.executable, __file__, "_tpu_child", json.dumps(spec)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    )
                    current = start
                    for line in proc.stdout:
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            continue
                        if msg["event"] == "start":
                            current = msg["i"]
                        else:
                            _emit(msg["row"], out)
                            current = msg["i"] + 1
                    err = proc.stderr.read()
                    rc = proc.wait()
                    if rc == 0:
                        break
                    if rc != 0:
                        tail = [ln for ln in err.splitlines() if ln.strip()][-3:]
                        _emit({"topology": topo_name + ("/3d" if args.mesh3d else ""),
                               "axis": axis, "form": form,
                               "case": KINDS[current][0], "ok": False,
                               "error": f"process died rc={rc}: " + " | ".join(tail)[:600]}, out)
                        current += 1
                    start = current


def _emit(row, out):
    verdict = _groups_verdict(row)
    ops = ",".join(sorted({c["op"] for c in row.get("collectives", [])}))
    status = "OK" if row.get("ok") else "FAIL"
    print(f"{row['topology']:<20} {row['axis']:<3} {row['form']:<9} {row['case']:<32} "
          f"{status:<4} {row.get('seconds', ''):>6} {ops:<40} {verdict} "
          f"{'' if row.get('ok') else ' '.join(row.get('error', '').split())[:260]}", flush=True)
    if out is not None:
        slim = {k: v for k, v in row.items() if k not in ("expected_groups",)}
        slim["verdict"] = verdict
        if "collectives" in slim:  # keep the first 4 groups of each collective
            slim["collectives"] = [dict(c, groups=c["groups"][:4], n=len(c["groups"]))
                                   for c in slim["collectives"]]
        out.write(json.dumps(slim) + "\n")
        out.flush()


# ---------------------------------------------------------------------------------------------
# part "pair": a group of two ranks that is not a family

PAIR_CASES = ["subset ppermute swap", "subset psum", "world ppermute swap(0,1) others idle",
              "world psum axis_index_groups {0,1}+singletons",
              "world ppermute swap(0,1) + identity pairs others"]


def _pair_child(spec):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpu_dist.collectives.compile_only import topology_devices
    from tpu_dist.mesh import Topology

    gen, shape, slices = TOPOLOGIES[spec["topology"]]
    devices = topology_devices(Topology.create(gen, shape, num_slices=slices))
    for i, case in enumerate(PAIR_CASES):
        if i < spec["start"]:
            continue
        print(json.dumps({"event": "start", "i": i}), flush=True)
        row = {"topology": spec["topology"], "axis": "pair", "form": case.split()[0],
               "case": case}
        try:
            devs = devices[:2] if case.startswith("subset") else devices
            n = len(devs)
            mesh = Mesh(np.array(devs, dtype=object), ("x",))
            if "ppermute" in case:
                perm = [(0, 1), (1, 0)]
                if "identity" in case:
                    perm += [(k, k) for k in range(2, n)]

                def body(x, perm=perm):
                    return lax.ppermute(x, "x", perm=perm)
            elif "axis_index_groups" in case:
                groups = [[0, 1]] + [[k] for k in range(2, n)]

                def body(x, groups=groups):
                    return lax.psum(x, "x", axis_index_groups=groups)
            else:
                def body(x):
                    return lax.psum(x, "x")
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                      check_vma=False))
            arg = jax.ShapeDtypeStruct((n * 1024,), jnp.float32,
                                       sharding=NamedSharding(mesh, P("x")))
            t0 = time.perf_counter()
            text = f.lower(arg).compile().as_text()
            row.update(ok=True, seconds=round(time.perf_counter() - t0, 2),
                       collectives=_read_groups(text, list(range(n))),
                       expected_groups=[[0, 1]])
        except Exception as err:  # noqa: BLE001
            row.update(ok=False, error=f"{type(err).__name__}: {str(err)[:600]}")
        print(json.dumps({"event": "row", "i": i, "row": row}), flush=True)


def run_pair(args):
    topos = args.topologies.split(",") if args.topologies else ["v5e:16x16", "v6e:16x16",
                                                                "v6e:4x8", "v5p:4x4x4x2slices"]
    out = open(args.out, "a") if args.out else None  # noqa: SIM115  (open for the whole run)
    for topo_name in topos:
        start = 0
        while start < len(PAIR_CASES):
            spec = {"topology": topo_name, "start": start}
            proc = subprocess.Popen([sys.executable, __file__, "_pair_child", json.dumps(spec)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            current = start
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg["event"] == "start":
                    current = msg["i"]
                else:
                    _emit(msg["row"], out)
                    current = msg["i"] + 1
            err = proc.stderr.read()
            rc = proc.wait()
            if rc != 0:
                tail = [ln for ln in err.splitlines() if ln.strip()][-3:]
                _emit({"topology": topo_name, "axis": "pair", "form": "-",
                       "case": PAIR_CASES[current], "ok": False,
                       "error": f"process died rc={rc}: " + " | ".join(tail)[:600]}, out)
                current += 1
            start = current


# ---------------------------------------------------------------------------------------------
# part "cpu": XLA:CPU across processes


def _cpu_worker(rank, nprocs, port, iters, sizes, outfile, kinds):
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", nprocs, rank, local_device_ids=[0])
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpu_dist.collectives import _jaxlib  # noqa: F401

    devs = sorted(jax.devices(), key=lambda d: d.process_index)
    me = jax.local_devices()[0]
    # family: groups of 2 consecutive ranks ("tp"), and the strided family ("dp")
    grid = np.arange(nprocs).reshape(nprocs // 2, 2)  # [[0,1],[2,3]]
    results = []

    def kvkeys():
        from jax._src import distributed

        client = distributed.global_state.client
        try:  # XLA:CPU's gloo contexts rendezvous under "cpu:gloo/<device ids>/<rank>"
            return sorted(k for k, _ in client.key_value_dir_get_bytes("cpu:gloo"))
        except Exception as err:  # noqa: BLE001
            return [f"<cannot list: {err}>"]

    from tpu_dist.collectives import _lowering, _plan_algorithms
    from tpu_dist.collectives._lowering import ProgramKey

    def make(kind, mesh_devs, names, n):
        """tpu_dist's own body for ``kind`` (the algorithm the backend chooses on CPU) over
        axis "x" of a mesh: ("x",) = one group's devices, ("other", "x") = the family's."""
        mesh = Mesh(mesh_devs, names)
        spec = P(names) if len(names) > 1 else P(names[0])
        size = mesh.shape["x"]
        params = ("SUM",) if kind in ("allreduce", "reduce_scatter") else ()
        blocks = ((n, "float32"),)
        algo = _plan_algorithms.choose_algorithm(kind, blocks, params, "cpu", size)
        key = ProgramKey(kind, tuple(range(size)), blocks, params, algo)
        body = _lowering.body_for(key, [None] * size)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(spec,),
                                  check_vma=False))
        return (lambda a: f(a)[0]), NamedSharding(mesh, spec), mesh.devices.size, algo

    def reference(kind, blocks, pos, size):
        if kind == "allreduce":
            return sum(blocks)
        if kind == "allgather":
            return np.concatenate(blocks)
        if kind == "reduce_scatter":
            return np.split(sum(blocks), size)[pos]
        return np.concatenate([np.split(b, size)[pos] for b in blocks])

    for axis_name in ("tp", "dp"):
        g = grid if axis_name == "tp" else grid.T
        my_group = [int(r) for r in g[np.argwhere(g == rank)[0][0]]]
        pos = my_group.index(rank)
        for kind in kinds:
            for nbytes in sizes:
                n = nbytes // 4
                local = (np.arange(n, dtype=np.float32) % 1000) + rank * 1000
                blocks = [(np.arange(n, dtype=np.float32) % 1000) + r * 1000 for r in my_group]
                ref = reference(kind, blocks, pos, len(my_group))
                block = jax.device_put(local, me)
                built = {}
                for form in ("subset", "family"):  # first calls: compile + communicator setup
                    if form == "family":
                        mesh_devs = np.array([[devs[r] for r in row] for row in g], dtype=object)
                        f, sh, total, algo = make(kind, mesh_devs, ("other", "x"), n)
                    else:
                        mesh_devs = np.array([devs[r] for r in my_group], dtype=object)
                        f, sh, total, algo = make(kind, mesh_devs, ("x",), n)
                    arr = jax.make_array_from_single_device_arrays((total * n,), sh, [block])
                    before = set(kvkeys())
                    t0 = time.perf_counter()
                    out = f(arr)
                    out.block_until_ready()
                    first = time.perf_counter() - t0
                    got = np.asarray(out.addressable_data(0))
                    correct = bool(got.shape == ref.shape and np.allclose(got, ref))
                    built[form] = (f, arr, first, correct, sorted(set(kvkeys()) - before), algo)
                times = {"subset": [], "family": []}
                for _ in range(iters):  # A B alternating, every rank in the same order
                    for form in ("subset", "family"):
                        f, arr = built[form][:2]
                        t0 = time.perf_counter()
                        f(arr).block_until_ready()
                        times[form].append(time.perf_counter() - t0)
                for form in ("subset", "family"):
                    _, _, first, correct, new_keys, algo = built[form]
                    results.append({"algorithm": algo,
                        "rank": rank, "nprocs": nprocs, "axis": axis_name, "group": my_group,
                        "kind": kind, "bytes": nbytes, "form": form, "correct": correct,
                        "first_ms": round(first * 1e3, 2),
                        "p50_ms": round(float(np.median(times[form])) * 1e3, 3),
                        "min_ms": round(float(np.min(times[form])) * 1e3, 3),
                        "new_kv_keys": new_keys[:12], "n_new_kv_keys": len(new_keys),
                    })
    # Does a family program need the other groups' processes? Only the members of rank 0's
    # "tp" group call the family allreduce; the others skip it.
    import threading

    g = grid
    group0 = [int(r) for r in g[0]]
    mesh_devs = np.array([[devs[r] for r in row] for row in g], dtype=object)
    f, sh, total, _ = make("allreduce", mesh_devs, ("other", "x"), 1024)
    members_only = "not a member: did not call"
    if rank in group0:
        arr = jax.make_array_from_single_device_arrays(
            (total * 1024,), sh, [jax.device_put(np.full(1024, rank + 1.0, np.float32), me)])
        box = {}

        def call():
            try:
                box["out"] = np.asarray(f(arr).addressable_data(0))
            except Exception as err:  # noqa: BLE001
                box["err"] = repr(err)[:300]

        th = threading.Thread(target=call, daemon=True)
        th.start()
        th.join(30)
        if th.is_alive():
            members_only = "HUNG (30 s) without the other groups' processes"
        elif "err" in box:
            members_only = "error: " + box["err"]
        else:
            want = float(sum(r + 1 for r in group0))
            members_only = f"completed, result {box['out'][0]} (expected {want})"
    results.append({"members_only_family_call": members_only, "rank": rank})
    with open(outfile, "w") as fh:
        json.dump({"results": results, "all_kv_keys": kvkeys()[:200]}, fh)
    if "HUNG" in members_only:
        os._exit(0)  # a thread is stuck in a collective: no clean shutdown possible
    jax.distributed.shutdown()


def run_cpu(args):
    import socket
    import tempfile


    sizes = args.sizes
    for nprocs in args.nprocs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp = tempfile.mkdtemp(prefix="family_cpu_")
        procs = []
        for r in range(nprocs):
            cmd = [sys.executable, __file__, "_cpu_worker", str(r), str(nprocs), str(port),
                   str(args.iters), ",".join(map(str, sizes)), os.path.join(tmp, f"{r}.json"),
                   ",".join(args.kinds)]
            procs.append(subprocess.Popen(cmd))
        rcs = [p.wait() for p in procs]
        print(f"== {nprocs} processes, exit codes {rcs}, raw results in {tmp}")
        per = [_read_json(os.path.join(tmp, f"{r}.json")) for r in range(nprocs)
               if os.path.exists(os.path.join(tmp, f"{r}.json"))]
        if not per:
            continue
        rows = {}
        for p in per:
            for res in p["results"]:
                if "members_only_family_call" in res:
                    print(f"members-only family call, rank {res['rank']}: "
                          f"{res['members_only_family_call']}")
                    continue
                rows.setdefault((res["axis"], res["kind"], res["bytes"], res["form"]), []).append(res)
        print(f"{'axis':<4} {'kind':<15} {'bytes':>9} {'form':<7} {'correct':<7} "
              f"{'first ms':>9} {'p50 ms (max over ranks)':>24} {'new gloo contexts (all ranks)'}")
        for (axis, kind, nbytes, form), rs in rows.items():
            print(f"{axis:<4} {kind + '/' + rs[0]['algorithm'][:3]:<15} {nbytes:>9} {form:<7} {all(r['correct'] for r in rs)!s:<7} "
                  f"{max(r['first_ms'] for r in rs):>9.1f} "
                  f"{max(r['p50_ms'] for r in rs):>24.3f} "
                  f"{sorted({k.rsplit('/', 1)[0] for r in rs for k in r['new_kv_keys']})}")
        print("gloo contexts at the end (cpu:gloo/<device ids>):",
              sorted({k.rsplit("/", 1)[0] for k in per[0]["all_kv_keys"]}))


# ---------------------------------------------------------------------------------------------
# part "groups": what a c10d backend creator learns


def _groups_worker(rank, world, port, outfile):
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import device_mesh

    class _Log(list):
        def append(self, item):  # written as it happens: a hang still leaves the log
            super().append(item)
            with open(outfile, "w") as fh:
                json.dump(self, fh)

    log = _Log()

    def creator(opts, backend_options):
        log.append({"creator": True, "group_id": opts.group_id,
                    "global_ranks_in_group": list(opts.global_ranks_in_group),
                    "group_rank": opts.group_rank, "group_size": opts.group_size,
                    "timeout_s": opts.timeout.total_seconds(),
                    "backend_options": repr(backend_options)})
        return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)

    dist.Backend.register_backend("logpg", creator, extended_api=True, devices=["cpu"])
    helper = c10d._new_process_group_helper

    def spy(group_size, group_rank, global_ranks_in_group, backend, store, group_name,
            *a, **kw):
        log.append({"helper": True, "group_name": group_name,
                    "global_ranks_in_group": list(global_ranks_in_group),
                    "group_desc": kw.get("group_desc"), "member": rank in global_ranks_in_group
                    or not global_ranks_in_group})
        return helper(group_size, group_rank, global_ranks_in_group, backend, store, group_name,
                      *a, **kw)

    c10d._new_process_group_helper = spy
    dist.init_process_group("logpg", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    steps = []

    def step(name, fn):
        log.append({"step": name})
        try:
            res = fn()
            log.append({"step_result": name, "result": repr(res)[:300]})
        except Exception as err:  # noqa: BLE001
            log.append({"step_error": name, "error": f"{type(err).__name__}: {err}"[:400]})
        steps.append(name)

    def mesh22():
        m = device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return {"mesh": m.mesh.tolist(),
                "dim_groups": [(g.group_name, g.group_desc, dist.get_process_group_ranks(g))
                               for g in m.get_all_groups()]}

    step("torch init_device_mesh cpu (2,2)", mesh22)
    class FamilyOptions:  # anything with _timeout passes through DeviceMesh to the creator
        _timeout = None

        def __init__(self, family):
            self.family = family

        def __repr__(self):
            return f"FamilyOptions({self.family})"

    step("torch init_device_mesh cpu (2,2) backend_override pg_options",
         lambda: device_mesh.init_device_mesh(
             "cpu", (2, 2), mesh_dim_names=("a", "b"),
             backend_override={"b": ("logpg", FamilyOptions([[0, 1], [2, 3]]))}).mesh.tolist())
    step("new_subgroups(2)", lambda: [
        dist.get_process_group_ranks(g) for g in dist.new_subgroups(2, group_desc="sub")[1]])
    step("new_subgroups_by_enumeration([[0,2],[1,3]])", lambda: [
        dist.get_process_group_ranks(g)
        for g in dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[1]])
    step("split_group([[0,1],[2,3]])",
         lambda: dist.get_process_group_ranks(dist.split_group(split_ranks=[[0, 1], [2, 3]])))
    def tpu_dist_mesh():
        os.environ.setdefault("TPU_DIST_TOPOLOGY", "v5p:2x2x1")
        from tpu_dist.mesh import init_device_mesh

        m = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        return {"mesh": m.mesh.tolist(),
                "dim_groups": [(g.group_name, g.group_desc, dist.get_process_group_ranks(g))
                               for g in m.get_all_groups()]}

    step("tpu_dist.mesh.init_device_mesh (2,2) on logpg (before any member-only group: its hashed names count the groups each rank has)", tpu_dist_mesh)
    step("new_group([0,1])", lambda: str(dist.new_group([0, 1])))
    step("new_group([0,1]) use_local_synchronization",
         lambda: str(dist.new_group([0, 1], use_local_synchronization=True))
         if rank in (0, 1) else "not called")

    log.append({"step": "done"})
    dist.destroy_process_group()


def run_groups(args):
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="family_groups_")
    world = 4
    procs = [subprocess.Popen([sys.executable, __file__, "_groups_worker", str(r), str(world),
                               str(port), os.path.join(tmp, f"{r}.json")]) for r in range(world)]
    try:
        rcs = [p.wait(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        rcs = "timeout"
        for p in procs:
            p.kill()
    print(f"exit codes {rcs}; raw logs in {tmp}")
    for r in range(world):
        path = os.path.join(tmp, f"{r}.json")
        if not os.path.exists(path):
            print(f"rank {r}: no log")
            continue
        print(f"---- rank {r}")
        for e in _read_json(path):
            if "step" in e:
                print(f"  # {e['step']}")
            elif "step_result" in e:
                print(f"    -> {e['result']}")
            elif "step_error" in e:
                print(f"    !! {e['error']}")
            elif "helper" in e:
                print(f"    new_group seen: name={e['group_name']} ranks={e['global_ranks_in_group']}"
                      f" desc={e['group_desc']} member={e['member']}")
            else:
                print(f"    CREATOR: group_id={e['group_id']} ranks={e['global_ranks_in_group']}"
                      f" rank={e['group_rank']}/{e['group_size']} opts={e['backend_options']}")


# ---------------------------------------------------------------------------------------------
# part "probe": single compiles, each in a child process


def _probe_child(spec):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import mesh_utils, topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    what = spec["what"]
    n = 1024
    if what == "subset-psum":  # psum over the devices of ``ranks`` of a tpu_dist topology
        from tpu_dist.collectives.compile_only import topology_devices
        from tpu_dist.mesh import Topology

        gen, shape = spec["topology"].split(":")
        devices = topology_devices(Topology.create(gen, shape))
        devs = [devices[r] for r in spec["ranks"]]
        mesh = Mesh(np.array(devs, dtype=object), ("x",))
        spec_ = P("x")
        shape_ = (len(devs) * n,)

        def body(x):
            return lax.psum(x, "x")
        label = f"ranks {spec['ranks']} device ids {[d.id for d in devs]}"
    else:  # all-gather forms over a (devices/8, 8) mesh of a whole libtpu topology
        desc = topologies.get_topology_desc(topology_name=spec["topology"], platform="tpu")
        devs = list(desc.devices)
        label = f"{len(devs)} devices"
        shape_ = (len(devs) * n,)
        if what == "allgather-world1d":
            mesh = Mesh(np.array(devs, dtype=object), ("x",))
            spec_ = P("x")
        else:
            mesh = Mesh(mesh_utils.create_device_mesh((len(devs) // 8, 8), devices=devs),
                        ("other", "x"))
            spec_ = P(("other", "x"))
        size = mesh.shape["x"]

        def body(x):
            if what == "allgather-psum":  # each block placed at its index, summed
                full = jnp.zeros((size * n,), x.dtype)
                return lax.psum(lax.dynamic_update_slice(full, x, (lax.axis_index("x") * n,)),
                                "x")
            if what == "allgather-alltoall":  # tpu_dist's "exchange" all-gather
                return lax.all_to_all(jnp.broadcast_to(x, (size, n)), "x", 0, 0,
                                      tiled=True).reshape(-1)
            return lax.all_gather(x, "x", axis=0, tiled=True)  # allgather-world1d / -axis
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec_, out_specs=spec_,
                              check_vma=False))
    arg = jax.ShapeDtypeStruct(shape_, jnp.float32, sharding=NamedSharding(mesh, spec_))
    try:
        text = f.lower(arg).compile().as_text()
        ops = sorted(set(re.findall(r"\s(all-gather|all-reduce|all-to-all)(?:-start)?\(", text)))
        result = "OK " + ",".join(ops)
    except Exception as err:  # noqa: BLE001
        result = "FAIL " + " ".join(str(err).split())[:200]
    print(f"RESULT {spec['topology']} {what} {label}: {result}", flush=True)


PROBES = [
    # v6e: which subsets compile (tpu_dist rank order; device ids are printed)
    *({"what": "subset-psum", "topology": "v6e:16x16", "ranks": r} for r in (
        [0, 1], [2, 3], [0, 2], [8, 9], [254, 255], [0, 1, 2, 3], [4, 5, 6, 7],
        list(range(8)), list(range(8, 16)), list(range(16, 24)))),
    # TPU7x: an all-gather over a program spanning the whole slice
    *({"what": w, "topology": t} for t in ("tpu7x:2x2x1", "tpu7x:4x4x4") for w in (
        "allgather-world1d", "allgather-axis", "allgather-psum", "allgather-alltoall")),
    *({"what": "allgather-world1d", "topology": t} for t in (
        "tpu7x:2x2x2", "tpu7x:4x4x8", "v5p:4x4x4", "v6e:16x16", "v5e:16x16")),
]


def run_probe(args):
    for spec in PROBES:
        proc = subprocess.run([sys.executable, __file__, "_probe_child", json.dumps(spec)],
                              check=False, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
        print(lines[0] if lines else f"RESULT {spec}: process died rc={proc.returncode}",
              flush=True)


# ---------------------------------------------------------------------------------------------
# part "table": the tpu / pair JSON lines as markdown


def _cell(row):
    if row is None:
        return "-"
    if row.get("ok"):
        verdict = row.get("verdict", "")
        return "ok" if verdict in ("equal", "pairs-in-groups", "equal-per-slice",
                                   "dcn-groups-equal") else f"ok ({verdict})"
    err = row.get("error", "")
    if "died" in err:
        return "CRASH (SIGABRT)" if "rc=-6" in err else "CRASH"
    if "LogicalDeviceCount" in err:
        return "F1"
    if "kMaxDeviceCount" in err:
        return "F2"
    if "async-update" in err:
        return "F3"
    return "F: " + " ".join(err.split())[:60]


def run_table(args):
    with open(args.jsonl) as fh:
        rows = [json.loads(line) for line in fh]
    topos = list(dict.fromkeys(r["topology"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cols = list(dict.fromkeys((r["axis"], r["form"]) for r in rows))
    at = {(r["topology"], r["axis"], r["form"], r["case"]): r for r in rows}
    for topo in topos:
        sizes = {r["axis"]: (r.get("group_size"), r.get("n_groups")) for r in rows
                 if r["topology"] == topo and r.get("group_size")}
        print(f"\n{topo}: " + ", ".join(f"{a} = {n} groups of {g}" for a, (g, n) in sizes.items()))
        present = [c for c in cols if any(k[:3] == (topo, *c) for k in at)]
        print("| case | " + " | ".join(f"{a} {f}" for a, f in present) + " |")
        print("|---" * (len(present) + 1) + "|")
        for case in cases:
            if not any((topo, a, f, case) in at for a, f in present):
                continue
            print(f"| {case} | " + " | ".join(_cell(at.get((topo, a, f, case)))
                                             for a, f in present) + " |")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_tpu_child":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return _tpu_child(json.loads(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "_pair_child":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return _pair_child(json.loads(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "_probe_child":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return _probe_child(json.loads(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "_cpu_worker":
        r, n, port, iters, sizes, out, kinds = sys.argv[2:9]
        return _cpu_worker(int(r), int(n), int(port), int(iters),
                           [int(s) for s in sizes.split(",")], out, kinds.split(","))
    if len(sys.argv) > 1 and sys.argv[1] == "_groups_worker":
        r, n, port, out = sys.argv[2:6]
        return _groups_worker(int(r), int(n), int(port), out)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("tpu")
    p.add_argument("--topologies", default="")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--forms", nargs="+", default=[], help="family and/or subset (default: both)")
    p.add_argument("--mesh3d", action="store_true",
                   help="a (dp, fsdp 8, tp 8) mesh; the dp and fsdp families")
    p.add_argument("--out", default="")
    p = sub.add_parser("pair")
    p.add_argument("--topologies", default="")
    p.add_argument("--out", default="")
    p = sub.add_parser("cpu")
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16 * 1024 * 1024],
                   help="bytes per rank")
    p.add_argument("--kinds", nargs="+",
                   default=["allreduce", "allgather", "reduce_scatter", "alltoall"])
    p = sub.add_parser("groups")
    p.add_argument("--timeout", type=float, default=120)
    p = sub.add_parser("table")
    p.add_argument("jsonl")
    sub.add_parser("probe")
    args = parser.parse_args()
    try:
        {"tpu": run_tpu, "pair": run_pair, "cpu": run_cpu, "groups": run_groups,
         "table": run_table, "probe": run_probe}[args.part](args)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
