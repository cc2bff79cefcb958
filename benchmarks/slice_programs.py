"""Issue 31: which whole-slice all-gather / reduce-scatter programs libtpu 0.0.52 accepts on TPU7x.

A pure-FSDP job over a whole TPU7x slice (MaxText's layout) needs an all-gather and a reduce-scatter
over *every* device of the slice. libtpu rejects XLA's native all-gather there (``RET_CHECK ...
async-update instruction should have 1 operands but sees 2``, F3 in
docs/decisions/0020-family-programs-study.md). This script compiles many forms of the same
collective over libtpu's compile-only devices and records, per form: compiled or how it failed, the
collective ops of the compiled HLO (kind, replica groups, operand shapes), the scratch memory
(``memory_analysis().temp_size_in_bytes``) and the compile time. Reports; asserts nothing.

    python benchmarks/slice_programs.py sweep [--topologies tpu7x:4x4x4 ...] [--blocks 128,1024]
        [--dtypes float32,bfloat16] [--forms ag_native,...] [--options NAME=VALUE ...]
        [--env LIBTPU_INIT_ARGS=...] [--out FILE.jsonl]
    python benchmarks/slice_programs.py flags [--topology tpu7x:2x2x1] [--out FILE.jsonl]
    python benchmarks/slice_programs.py plan [--topologies ...] [--out FILE.jsonl]
    python benchmarks/slice_programs.py table [--matrix | --versus] FILE.jsonl [...]

Every compile runs in a child process under an address-space limit (``--limit-gib``, default
8): libtpu's compiler can kill its process (SIGABRT/SIGFPE). A child that dies is restarted
after the case that killed it, which is recorded with its signal.

Forms (``--forms``; the program is ``jax.jit(shard_map(body))`` over a 1-D mesh ``"x"`` of
every device of the topology, in rank order, unless the form says otherwise). ``block`` is the
per-rank element count of the all-gather's input / the reduce-scatter's output:

* ``ag_native``: ``lax.all_gather(x, "x", tiled=True)`` (what tpu_dist's ``"xla"`` runs);
* ``ag_native_untiled``: the same, ``tiled=False`` (a new leading axis);
* ``ag_native_2d``: the block as ``(block // 128, 128)`` rows, gathered on axis 0;
* ``ag_psum``: each block placed at its index in a zero buffer, then ``psum``;
* ``ag_alltoall``: tpu_dist's ``"exchange"`` all-gather (one all-to-all of ``size`` copies);
* ``ag_ring``: ``size - 1`` ``ppermute`` steps in a ``fori_loop``;
* ``ag_two_level``: mesh ``(rest, core)`` (the chip's two cores as the inner axis), gather
  over ``core`` then over ``rest``;
* ``ag_native_family_order``: ``ag_native`` with the devices in ``jax.devices()`` id order
  rather than tpu_dist's rank order;
* ``rs_native``: ``lax.psum_scatter(x, "x", tiled=True)`` (tpu_dist's ``"xla"``);
* ``rs_psum_slice``: ``psum`` of the whole buffer, then this rank's slice;
* ``rs_alltoall``: tpu_dist's ``"exchange"`` reduce-scatter;
* ``ar_native``: ``psum`` of a ``block``-element buffer (tpu_dist's ``"xla"`` all-reduce);
* ``ar_exchange``: tpu_dist's ``"exchange"`` all-reduce (two all-to-alls);
* ``a2a_native``: tpu_dist's all-to-all, ``block`` elements to each rank.

``plan``: tpu_dist's own plan (``_plan_collectives.all_gather_into_tensor`` / ``reduce_scatter_tensor`` on
a ``GroupView`` of every device, as the "tpu" backend plans a whole-slice group) compiled with
``compile_only.compile_collective``: what the package does today, for the same blocks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

AG_FORMS = (
    "ag_native", "ag_native_untiled", "ag_native_2d", "ag_psum", "ag_alltoall", "ag_ring",
    "ag_two_level", "ag_native_family_order",
)
RS_FORMS = ("rs_native", "rs_psum_slice", "rs_alltoall")
FORMS = AG_FORMS + RS_FORMS + ("ar_native", "ar_exchange", "a2a_native")
DEFAULT_FORMS = ("ag_native", "ag_psum", "ag_alltoall", "ag_two_level", "rs_native",
                 "rs_psum_slice", "rs_alltoall")
DEFAULT_BLOCKS = (128, 129, 256, 512, 516, 1024, 1032, 2048, 4096, 8192, 65536)

_F3 = "async-update instruction should have 1 operands"


def _failure_code(message: str) -> str:
    if _F3 in message:
        return "F3"
    if "LogicalDeviceCount" in message:
        return "F1"
    if "kMaxDeviceCount" in message:
        return "F2"
    m = re.search(r"(RET_CHECK[^\n]{0,160}|INVALID_ARGUMENT[^\n]{0,160}|UNIMPLEMENTED[^\n]{0,160}"
                  r"|Unknown flag[^\n]{0,120}|[A-Za-z]*Error[^\n]{0,160})", message)
    return m.group(1) if m else message[-200:]


# ---------------------------------------------------------------------------------------------
# child: compiles a list of cases, one JSON line each on stdout


def _devices(topology: str, cache: dict):
    if topology not in cache:
        from tpu_dist.collectives.compile_only import topology_devices
        from tpu_dist.mesh import Topology

        gen, _, shape = topology.partition(":")
        cache[topology] = topology_devices(Topology.create(gen, shape))
    return cache[topology]


def _body(form: str, size: int, block: int):
    import jax.numpy as jnp
    from jax import lax

    if form in ("ag_native", "ag_native_family_order"):
        return lambda x: lax.all_gather(x, "x", tiled=True)
    if form == "ag_native_untiled":
        return lambda x: lax.all_gather(x, "x", tiled=False).reshape(-1)
    if form == "ag_native_2d":
        return lambda x: lax.all_gather(x.reshape(-1, 128), "x", tiled=True).reshape(-1)
    if form == "ag_psum":
        def body(x):
            buf = jnp.zeros((size, x.shape[0]), x.dtype)
            buf = lax.dynamic_update_slice(buf, x[None], (lax.axis_index("x"), 0))
            return lax.psum(buf, "x").reshape(-1)
        return body
    if form == "ag_alltoall":
        return lambda x: lax.all_to_all(
            jnp.broadcast_to(x, (size, x.shape[0])), "x", 0, 0, tiled=True
        ).reshape(-1)
    if form == "ag_ring":
        def body(x):
            me = lax.axis_index("x")
            out = jnp.zeros((size, x.shape[0]), x.dtype)
            out = lax.dynamic_update_slice(out, x[None], (me, 0))
            perm = [(i, (i + 1) % size) for i in range(size)]

            def step(i, carry):
                out, cur = carry
                cur = lax.ppermute(cur, "x", perm)
                src = (me - i - 1) % size
                return lax.dynamic_update_slice(out, cur[None], (src, 0)), cur

            out, _ = lax.fori_loop(0, size - 1, step, (out, x))
            return out.reshape(-1)
        return body
    if form == "ag_two_level":
        def body(x):
            pair = lax.all_gather(x, "c", tiled=True)
            return lax.all_gather(pair, "r", tiled=True)
        return body
    if form == "rs_native":
        return lambda x: lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True)
    if form == "rs_psum_slice":
        def body(x):
            total = lax.psum(x, "x")
            return lax.dynamic_slice(total, (lax.axis_index("x") * block,), (block,))
        return body
    if form == "rs_alltoall":
        return lambda x: jnp.sum(
            lax.all_to_all(x.reshape(size, -1), "x", 0, 0, tiled=True), axis=0, dtype=x.dtype
        )
    if form == "ar_native":
        return lambda x: lax.psum(x, "x")
    if form == "a2a_native":  # tpu_dist's all_to_all_single: block elements to each rank
        return lambda x: lax.all_to_all(x.reshape(size, -1), "x", 0, 0, tiled=True).reshape(-1)
    if form == "ar_exchange":  # tpu_dist's "exchange" all-reduce: two all-to-alls
        from tpu_dist.collectives import _lowering

        body = _lowering._allreduce_direct(size, "SUM")
        return lambda x: body(x)[0]
    raise ValueError(form)


def _compile_case(case: dict, cache: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpu_dist.collectives.compile_only import hlo_collectives

    devices = _devices(case["topology"], cache)
    if case.get("ranks"):  # a group of the first N ranks, not the whole slice
        devices = devices[: case["ranks"]]
    if case.get("stride"):  # every stride-th rank (stride 2: one core of every TPU7x chip)
        devices = devices[:: case["stride"]]
    size, block, form = len(devices), case["block"], case["form"]
    dtype = jnp.dtype(case["dtype"])
    if form == "ag_native_family_order":
        devices = sorted(devices, key=lambda d: d.id)
    if form == "ag_two_level":
        # rank order of tpu_dist.mesh puts a chip's cores next to each other: (rest, core)
        mesh = Mesh(np.array(devices, dtype=object).reshape(-1, 2), ("r", "c"))
        spec = P(("r", "c"))
    else:
        mesh = Mesh(np.array(devices, dtype=object), ("x",))
        spec = P("x")
    per_rank_in = block * size if form in RS_FORMS or form == "a2a_native" else block
    sharding = NamedSharding(mesh, spec)
    mapped = jax.shard_map(
        _body(form, size, block), mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False
    )
    arg = jax.ShapeDtypeStruct((size * per_rank_in,), dtype, sharding=sharding)
    t0 = time.perf_counter()
    lowered = jax.jit(mapped).lower(arg)
    options = case.get("options") or None
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    try:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001
        temp = None
    ops = []
    for c in hlo_collectives(text):
        groups = c.replica_groups
        ops.append({
            "op": c.op,
            "groups": len(groups),
            "group_size": len(groups[0]) if groups else 0,
            "whole": bool(groups) and sorted(i for g in groups for i in g) == list(range(size))
            and len(groups) == 1,
        })
    shapes = re.findall(
        r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
        r"(?:-start)?\(", text
    )
    return {"status": "ok", "seconds": round(seconds, 3), "temp_bytes": temp, "ops": ops,
            "op_shapes": sorted({f"{op} {shape}" for shape, op in shapes})[:6],
            "input_bytes_per_rank": per_rank_in * dtype.itemsize, "hlo_sha1": _digest(text)}


def _digest(text: str) -> str:
    """The compiled HLO's digest without instruction names, metadata, backend configs (cost
    estimates) and instruction order: two compiles of one program that differ only in how a
    pass named or ordered instructions get the same digest."""
    lines = []
    for line in text.splitlines():
        if line.startswith("HloModule"):
            continue
        line = re.sub(r", (metadata|backend_config)=(\{.*?\}|\"[^\"]*\")(?=, [a-z_]+=|$)", "", line)
        lines.append(re.sub(r"%[\w.\-]+", "%", line))
    return hashlib.sha1("\n".join(sorted(lines)).encode()).hexdigest()[:12]


def _compile_plan_case(case: dict, cache: dict) -> dict:
    """tpu_dist's own plan of the call over every device (a whole-slice group)."""
    import torch
    import torch.distributed as dist

    from tpu_dist.collectives import _plan, _plan_collectives
    from tpu_dist.collectives.compile_only import compile_collective

    devices = _devices(case["topology"], cache)
    n, block = len(devices), case["block"]
    dtype = getattr(torch, case["dtype"])
    view = _plan.GroupView(0, n, tuple(d.id for d in devices), "tpu",
                           device_kind=devices[0].device_kind)
    if case["form"] == "plan_allgather":
        plan = _plan_collectives.all_gather_into_tensor(view, torch.empty(block * n, dtype=dtype),
                                            torch.ones(block, dtype=dtype))
    else:
        plan = _plan_collectives.reduce_scatter_tensor(view, torch.empty(block, dtype=dtype),
                                           torch.ones(block * n, dtype=dtype),
                                           dist.ReduceOp.SUM)
    t0 = time.perf_counter()
    result = compile_collective(plan.key, devices)
    seconds = time.perf_counter() - t0
    ops = [{"op": c.op, "groups": len(c.replica_groups),
            "group_size": len(c.replica_groups[0]) if c.replica_groups else 0}
           for c in result.collectives]
    return {"status": "ok", "seconds": round(seconds, 3), "temp_bytes": result.temp_bytes,
            "ops": ops, "key_blocks": [list(b) for b in plan.key.blocks],
            "algorithm": plan.key.algorithm, "hlo_sha1": _digest(result.hlo_text)}


def child(cases: list[dict]) -> None:
    cache: dict = {}
    for i, case in enumerate(cases):
        row = dict(case, index=i)
        try:
            if case["form"].startswith("plan_"):
                row.update(_compile_plan_case(case, cache))
            else:
                row.update(_compile_case(case, cache))
        except Exception as err:  # noqa: BLE001
            message = f"{type(err).__name__}: {err}"
            row.update(status="error", code=_failure_code(message), message=message[:600])
        print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------
# parent


def run_cases(cases: list[dict], out: str | None, limit_gib: float, env_extra: dict | None = None,
              timeout: float = 600.0) -> list[dict]:
    """Compile ``cases`` in child processes (restarted after a case that kills one)."""
    rows: list[dict] = []
    env = dict(os.environ)
    env.update(env_extra or {})
    pending = list(cases)
    while pending:
        with tempfile.TemporaryFile(mode="w+") as err:
            proc = subprocess.Popen(
                ["prlimit", f"--as={int(limit_gib * 2**30)}", sys.executable,
                 os.path.abspath(__file__), "_child", json.dumps(pending)],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            )
            timer = threading.Timer(timeout * len(pending), proc.kill)
            timer.start()
            done = []
            for line in proc.stdout:  # one line per case, as it is compiled
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                row.pop("index", None)
                if env_extra:
                    row["env"] = env_extra
                done.append(row)
                rows.append(row)
                _emit(row, out)
            proc.wait()
            timer.cancel()
            err.seek(0)
            stderr = err.read()
        pending = pending[len(done):]
        if pending and proc.returncode != 0:
            rc = proc.returncode
            what = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            tail = [line for line in stderr.splitlines() if line.strip()][-3:]
            row = dict(pending[0], status="crash", code=f"CRASH ({what})",
                       message=" | ".join(tail)[-600:])
            if env_extra:
                row["env"] = env_extra
            rows.append(row)
            _emit(row, out)
            pending = pending[1:]
        elif pending:
            break  # the child ended early without a crash: stop (a bug here)
    return rows


def _emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    if out:
        with open(out, "a") as fh:
            fh.write(line + "\n")
    status = row["status"] if row["status"] == "ok" else row.get("code", row["status"])
    ops = ",".join(f"{o['op']}x{o['groups']}/{o['group_size']}" for o in row.get("ops", []))
    where = row["topology"] + (f"[:{row['ranks']}]" if row.get("ranks") else "") + (
        f"[::{row['stride']}]" if row.get("stride") else "")
    print(f"{where:>16} {row['form']:>22} {row['dtype']:>9} {row['block']:>7} "
          f"{json.dumps(row.get('options') or {}):>12} {status} {ops} "
          f"temp={row.get('temp_bytes')} t={row.get('seconds')}", flush=True)


def _parse_options(items: list[str]) -> dict:
    options = {}
    for item in items or []:
        name, _, value = item.partition("=")
        low = value.lower()
        options[name] = True if low == "true" else False if low == "false" else (
            int(value) if value.lstrip("-").isdigit() else value)
    return options


def run_sweep(args) -> None:
    options = _parse_options(args.options)
    env_extra = dict(item.split("=", 1) for item in args.env or [])
    cases = []
    for topology in args.topologies.split(","):
        for form in args.forms.split(","):
            for dtype in args.dtypes.split(","):
                for block in (int(b) for b in args.blocks.split(",")):
                    case = {"topology": topology, "form": form, "dtype": dtype, "block": block}
                    if options:
                        case["options"] = options
                    if args.ranks:
                        case["ranks"] = args.ranks
                    if args.stride:
                        case["stride"] = args.stride
                    cases.append(case)
    run_cases(cases, args.out, args.limit_gib, env_extra)


def run_flags(args) -> None:
    """Each candidate compiler option alone, on ``ag_native`` and ``rs_native`` at two blocks:
    whether libtpu knows it and whether it makes the program compile."""
    candidates = args.flags.split(",")
    cases = []
    for flag in candidates:
        for value in args.values.split(","):
            opt = _parse_options([f"{flag}={value}"])
            for form in ("ag_native", "rs_native"):
                for block in (128, 1024):
                    cases.append({"topology": args.topology, "form": form, "dtype": "float32",
                                  "block": block, "options": opt})
    run_cases(cases, args.out, args.limit_gib)


def run_plan(args) -> None:
    cases = [
        {"topology": t, "form": f, "dtype": d, "block": int(b)}
        for t in args.topologies.split(",")
        for f in ("plan_allgather", "plan_reduce_scatter")
        for d in args.dtypes.split(",")
        for b in args.blocks.split(",")
    ]
    run_cases(cases, args.out, args.limit_gib)


def _short(row: dict) -> str:
    """A matrix cell: the HLO collectives (AR all-reduce, AG all-gather, RS reduce-scatter, A2A
    all-to-all, CP collective-permute) and the scratch if 1 MiB or more; or the failure."""
    if row["status"] != "ok":
        return row.get("code", row["status"]).replace("CRASH (signal ", "").rstrip(")")
    names = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
             "collective-permute": "CP"}
    ops = "+".join(sorted({names.get(o["op"], o["op"]) for o in row.get("ops", [])}))
    temp = row.get("temp_bytes") or 0
    return f"{ops}" + (f" ({temp / 2**20:.0f} MiB)" if temp >= 2**20 else "")


def _abbrev(flag: str) -> str:
    return flag.replace("xla_tpu_", "").replace("enable_sparse_core_collective_offload_", "sc_")


def run_matrix(rows: list[dict], versus: bool = False) -> None:
    """One line per (where, form, dtype, options), one column per block; with ``versus`` one
    line per (where, form, dtype), each cell ``without options / with options``."""
    blocks = sorted({r["block"] for r in rows})
    lines: dict[tuple, dict[int, dict[bool, str]]] = {}
    for r in rows:
        where = r["topology"] + (f" first {r['ranks']}" if r.get("ranks") else "") + (
            f" stride {r['stride']}" if r.get("stride") else "")
        opts = ", ".join(f"{_abbrev(k)}={v}" for k, v in (r.get("options") or {}).items())
        key = (where, r["form"], r["dtype"]) + (() if versus else (opts,))
        lines.setdefault(key, {}).setdefault(r["block"], {})[bool(opts)] = _short(r)

    def cell(found: dict[bool, str]) -> str:
        if not versus:
            return next(iter(found.values()), "")
        return f"{found.get(False, '')} / {found.get(True, '')}"

    head = "| devices | form | dtype | " + ("" if versus else "options | ")
    print(head + " | ".join(map(str, blocks)) + " |")
    print("|---|---|---|" + ("" if versus else "---|") + "---|" * len(blocks))
    for key, cells in lines.items():
        first = list(key[:3]) + ([] if versus else [key[3] or "-"])
        print("| " + " | ".join(first) + " | "
              + " | ".join(cell(cells.get(b, {})) for b in blocks) + " |")


def run_table(args) -> None:
    rows = []
    for path in args.files:
        with open(path) as fh:
            rows += [json.loads(line) for line in fh if line.strip()]
    if args.matrix or args.versus:
        run_matrix(rows, args.versus)
        return
    print("| topology | form | dtype | block | options / env | result | HLO collectives | "
          "temp bytes | compile s |")
    print("|---|---|---|---:|---|---|---|---:|---:|")
    for r in rows:
        opts = json.dumps(r.get("options") or r.get("env") or {}) if (
            r.get("options") or r.get("env")) else ""
        result = "ok" if r["status"] == "ok" else r.get("code", r["status"])
        ops = ", ".join(f"{o['op']} {o['groups']}x{o['group_size']}" for o in r.get("ops", []))
        temp = "" if r.get("temp_bytes") is None else f"{r['temp_bytes']:,}"
        where = r["topology"] + (f" first {r['ranks']}" if r.get("ranks") else "") + (
            f" stride {r['stride']}" if r.get("stride") else "")
        print(f"| {where} | {r['form']} | {r['dtype']} | {r['block']} | {opts} | "
              f"{result} | {ops} | {temp} | {r.get('seconds', '')} |")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sweep = sub.add_parser("sweep")
    sweep.add_argument("--topologies", default="tpu7x:4x4x4")
    sweep.add_argument("--forms", default=",".join(DEFAULT_FORMS))
    sweep.add_argument("--dtypes", default="float32,bfloat16")
    sweep.add_argument("--blocks", default=",".join(map(str, DEFAULT_BLOCKS)))
    sweep.add_argument("--options", nargs="*", help="compiler options NAME=VALUE")
    sweep.add_argument("--env", nargs="*", help="child environment NAME=VALUE")
    sweep.add_argument("--ranks", type=int, help="a group of the first N ranks only")
    sweep.add_argument("--stride", type=int, help="a group of every N-th rank only")
    flags = sub.add_parser("flags")
    flags.add_argument("--topology", default="tpu7x:4x4x4")
    flags.add_argument("--flags", required=True)
    flags.add_argument("--values", default="false")
    plan = sub.add_parser("plan")
    plan.add_argument("--topologies", default="tpu7x:4x4x4")
    plan.add_argument("--dtypes", default="float32,bfloat16")
    plan.add_argument("--blocks", default="128,129,1024,4096")
    for p in (sweep, flags, plan):
        p.add_argument("--out")
        p.add_argument("--limit-gib", type=float, default=8.0)
    table = sub.add_parser("table")
    table.add_argument("files", nargs="+")
    table.add_argument("--matrix", action="store_true",
                       help="one row per form, one column per block (cells: HLO op or failure)")
    table.add_argument("--versus", action="store_true",
                       help="as --matrix, each cell 'without options / with options'")
    args = parser.parse_args()
    {"sweep": run_sweep, "flags": run_flags, "plan": run_plan, "table": run_table}[args.cmd](args)


if __name__ == "__main__":
    main()
