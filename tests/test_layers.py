"""The package's import graph is a DAG whose layers only import downwards (issue 32).

Read from the source with ``ast``, so every import counts: at module top, inside functions
(a lazy import still ties two modules together), and under ``TYPE_CHECKING``. Layers, lowest
first (``docs/architecture.md``)::

    _settings, _process < mesh < collectives < dtensor_ext, compile_job < launch < bench
    < tpu_dist

A module may import its own subpackage and any lower layer; ``dtensor_ext`` and
``compile_job`` (one layer) do not import each other. Across subpackages only public modules
are imported (no ``_``-prefixed module of another subpackage), except ``tpu_dist._settings``
(every knob of the package, declared once), ``tpu_dist._process`` (every piece of
process-wide state, declared once) and the few named in :data:`_REACHES` with the reason.

Per-process state has one owner (docs/architecture.md, "Per-process state"), read from the source
with ``ast`` too: :func:`test_module_state_has_one_owner` fails on a ``global`` statement, a
module-level container mutated inside a function, an assignment to another tpu_dist module's
attribute, or a ``functools`` cache not listed in :data:`_MEMOISED`, anywhere but in
``tpu_dist._process`` and the owners :data:`_OTHER_OWNERS` names with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tpu_dist"

_LAYERS = {
    "tpu_dist._settings": 0,
    "tpu_dist._process": 0,
    "tpu_dist.mesh": 1,
    "tpu_dist.collectives": 2,
    "tpu_dist.dtensor_ext": 3,
    "tpu_dist.compile_job": 3,
    "tpu_dist.launch": 4,
    "tpu_dist.bench": 5,
    "tpu_dist": 6,
}

_REACHES = {
    # The benchmark times the bare XLA program of each op beside the backend's call; it
    # builds it from the backend's own plan and lowering so that both run the same program.
    ("tpu_dist.bench._xla", "tpu_dist.collectives._lowering"),
    ("tpu_dist.bench._xla", "tpu_dist.collectives._plan_algorithms"),
}
"""(importer, imported) pairs allowed to cross into another subpackage's private module."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the tpu_dist modules it imports (anywhere in its source)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                if target == "tpu_dist" or target.startswith("tpu_dist."):
                    resolved = _resolve(target, modules)
                    if resolved is not None and resolved != module:
                        graph[module].add(resolved)
    return graph


def _layer(module: str) -> tuple[str, int]:
    for prefix in sorted(_LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, _LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add its subpackage to _LAYERS")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the source walk found too few modules"
    assert _cycles(graph) == []


def test_layers_only_import_downwards() -> None:
    wrong = []
    for module, targets in sorted(import_graph().items()):
        home, level = _layer(module)
        for target in sorted(targets):
            where, target_level = _layer(target)
            if where == home:
                continue
            if target_level > level or (target_level == level and where != home):
                wrong.append(f"{module} ({home}) imports {target} ({where})")
    assert wrong == []


def test_no_reach_into_another_subpackages_private_modules() -> None:
    wrong = []
    for module, targets in sorted(import_graph().items()):
        home, _ = _layer(module)
        for target in sorted(targets):
            where, _ = _layer(target)
            private = any(part.startswith("_") for part in target.split(".")[1:])
            # The package's one table of knobs, and its one owner of process-wide state.
            shared = target in ("tpu_dist._settings", "tpu_dist._process")
            if where != home and private and not shared and (module, target) not in _REACHES:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path, monkeypatch) -> None:
    """The checks themselves, on a made-up package: a lazy import that closes a cycle and
    reaches up a layer is found."""
    pkg = tmp_path / "tpu_dist"
    (pkg / "mesh").mkdir(parents=True)
    (pkg / "collectives").mkdir()
    for name in ("__init__.py", "_settings.py", "mesh/__init__.py", "collectives/__init__.py"):
        (pkg / name).write_text("")
    (pkg / "mesh" / "_a.py").write_text("def f():\n    from tpu_dist.collectives import _b\n")
    (pkg / "collectives" / "_b.py").write_text("from tpu_dist.mesh import _a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", pkg)
    graph = import_graph()
    assert _cycles(graph) == [["tpu_dist.collectives._b", "tpu_dist.mesh._a"]]
    assert "tpu_dist.collectives._b" in graph["tpu_dist.mesh._a"]


# -- per-process state has one owner ----------------------------------------------------------

_STATE_OWNER = "tpu_dist._process"
"""The one module that declares the package's process-wide state (its docstring says why each
piece is process-wide, who writes it and who reads it)."""

_OTHER_OWNERS = {
    ("tpu_dist.mesh._generations", "_GENERATIONS"): "the registry of TPU generations: "
    "register_generation (the public seam for generations to come) writes it, at import and "
    "from user code; one table of hardware facts, kept with its accessors",
    ("tpu_dist.mesh._generations", "_BY_ALIAS"): "the same registry, by alias",
    ("tpu_dist.mesh._generations", "_BY_DEVICE_KIND"): "the same registry, by JAX device kind",
    ("tpu_dist.launch._rendezvous", "_waiting"): "tpu-launch's own process (never a worker): "
    "what it waits for, read by its signal handler, which is process-wide",
    ("tpu_dist.launch._rendezvous", "_services"): "tpu-launch's own process: the coordination "
    "services it started, stopped at exit and on a signal",
    ("tpu_dist.launch._run", "_stopped_pids"): "tpu-launch's own process: the workers elastic "
    "signalled, noted by a handler on elastic's (process-wide) logger",
    ("tpu_dist.launch._run", "_paused_pids"): "tpu-launch's own process: of those, the workers "
    "that were stopped (SIGSTOP) when elastic signalled them, noted by the same handler",
}
"""(module, name) -> why this module-level container is mutated outside :data:`_STATE_OWNER`."""

_MEMOISED = {
    ("tpu_dist.mesh._layout", "_plan_slice"): "a device layout of constant shapes",
    ("tpu_dist.collectives._plan_algorithms", "_itemsize"): "a dtype's size",
    ("tpu_dist.collectives._plan_algorithms", "choose_algorithm"): "a pure function of its arguments",
    ("tpu_dist.collectives._call_forms", "_signature"): "a function's signature",
    ("tpu_dist.collectives._compile_cache", "_code_fingerprint"): "a digest of the installed "
    "source files",
}
"""(module, function) -> the constant fact its ``functools`` cache memoises. Only pure facts of
constants may be memoised this way; anything that can change belongs to an owner."""

_CONTAINERS = {
    "dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "deque", "Counter",
    "local", "WeakValueDictionary", "WeakKeyDictionary", "WeakSet",
}
_MUTATORS = {
    "append", "extend", "insert", "add", "update", "pop", "popitem", "remove", "discard",
    "clear", "setdefault", "appendleft", "popleft", "extendleft", "sort", "reverse",
    "difference_update", "intersection_update", "symmetric_difference_update",
    "__setitem__", "__delitem__",
}
_CACHES = {"cache", "lru_cache"}
_WHERE = (
    "Per-process state belongs to an object the Runtime owns and hands down "
    "(collectives/_runtime.py), or, when what it mirrors is process-wide, in tpu_dist/_process.py "
    "with a docstring saying why, who writes it and who reads it; a memoised pure fact of "
    "constants may be a functools cache listed in tests/test_layers.py's _MEMOISED "
    "(docs/architecture.md, 'Per-process state')."
)


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in _CONTAINERS
    return False


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """The module's own statements, including those under a top-level if / try / with."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        found.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    todo.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return found


def _locals(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names bound in ``function`` itself (arguments, assignments), not declared global."""
    args = function.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    declared = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Global):
            declared.update(node.names)
    return names - declared


def _mutated_name(node: ast.AST) -> tuple[str, str] | None:
    """(name, how) when ``node`` mutates the object a plain name refers to."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            if isinstance(target, (ast.Subscript, ast.Attribute)) and isinstance(
                target.value, ast.Name
            ):
                kind = "item" if isinstance(target, ast.Subscript) else "attribute"
                return target.value.id, f"sets an {kind} of"
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Attribute) and func.attr in _MUTATORS and isinstance(
        func.value, ast.Name
    ):
        return func.value.id, f"calls .{func.attr}() on"
    return None


def _module_aliases(tree: ast.Module, modules: set[str]) -> set[str]:
    """Names this module binds to a tpu_dist module (``from tpu_dist import _settings``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.asname and a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {
                a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in modules
            }
    return names


def state_outside_its_owner() -> list[str]:
    """Every piece of mutable module-level state outside :data:`_STATE_OWNER` and
    :data:`_OTHER_OWNERS`, as ``path:line: what``."""
    modules = _modules()
    wrong = []
    for module, path in sorted(modules.items()):
        if module == _STATE_OWNER:
            continue
        where = path.relative_to(ROOT.parent)
        tree = ast.parse(path.read_text(), str(path))
        containers = {}
        for node in _top_level(tree):
            targets = (
                node.targets if isinstance(node, ast.Assign)
                else [node.target] if isinstance(node, ast.AnnAssign) else []
            )
            if _is_container(getattr(node, "value", None)):
                for target in targets:
                    if isinstance(target, ast.Name):
                        containers[target.id] = node.lineno
        aliases = _module_aliases(tree, set(modules))
        functions = [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                wrong.append(f"{where}:{node.lineno}: global {', '.join(node.names)}")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id in aliases
                    ):
                        wrong.append(
                            f"{where}:{node.lineno}: sets {target.value.id}.{target.attr} "
                            "(another module's state)"
                        )
        for function in functions:
            own = _locals(function)
            nested = {
                id(n) for inner in ast.walk(function) if inner is not function
                and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(inner)
            }
            for node in ast.walk(function):
                if id(node) in nested:
                    continue  # judged with the inner function's own locals
                found = _mutated_name(node)
                if found is None:
                    continue
                name, how = found
                if name in containers and name not in own and (module, name) not in _OTHER_OWNERS:
                    wrong.append(
                        f"{where}:{node.lineno}: {function.name}() {how} module-level {name} "
                        f"(line {containers[name]})"
                    )
            for decorator in function.decorator_list:
                call = decorator.func if isinstance(decorator, ast.Call) else decorator
                name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "")
                if name in _CACHES and (module, function.name) not in _MEMOISED:
                    wrong.append(
                        f"{where}:{function.lineno}: functools.{name} on {function.name}() "
                        "(not in _MEMOISED)"
                    )
    return wrong


def test_module_state_has_one_owner() -> None:
    wrong = state_outside_its_owner()
    assert not wrong, "\n".join([*wrong, _WHERE])


def test_the_state_check_sees_each_kind_of_state(tmp_path, monkeypatch) -> None:
    """The check itself, on a made-up package: each kind of module state is found, a table
    built at import and a function's own local of the same name are not."""
    pkg = tmp_path / "tpu_dist"
    (pkg / "collectives").mkdir(parents=True)
    for name in ("__init__.py", "_settings.py", "collectives/__init__.py"):
        (pkg / name).write_text("")
    (pkg / "collectives" / "_a.py").write_text(
        "import functools\n"
        "from tpu_dist import _settings\n"
        "_seen = set()\n"
        "_TABLE = {}\n"
        "_TABLE['x'] = 1\n"
        "_flag = False\n"
        "def note(what):\n"
        "    _seen.add(what)\n"
        "def shadow():\n"
        "    _seen = set()\n"
        "    _seen.add(1)\n"
        "def flip():\n"
        "    global _flag\n"
        "    _flag = True\n"
        "def poke():\n"
        "    _settings.X = 1\n"
        "@functools.lru_cache(maxsize=8)\n"
        "def fact(n):\n"
        "    return n\n"
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", pkg)
    assert state_outside_its_owner() == [
        "tpu_dist/collectives/_a.py:13: global _flag",
        "tpu_dist/collectives/_a.py:16: sets _settings.X (another module's state)",
        "tpu_dist/collectives/_a.py:8: note() calls .add() on module-level _seen (line 3)",
        "tpu_dist/collectives/_a.py:18: functools.lru_cache on fact() (not in _MEMOISED)",
    ]


# -- the Kind table and the bodies ----------------------------------------------------------------


def test_every_kind_has_a_body_and_every_body_a_kind() -> None:
    """A new :class:`~tpu_dist.collectives._types.Kind` needs its body factory in
    ``_lowering._BODIES`` (the ``"xla"`` algorithm; docs/architecture.md, "Where a new program kind
    goes"); the bodies stay in ``_lowering`` (they need JAX, ``_types`` must not import it)."""
    import typing

    from tpu_dist.collectives import _lowering, _plan_algorithms
    from tpu_dist.collectives._types import _BENCH_OPS, Kind

    missing = [k.name for k in Kind if k not in _lowering._BODIES]
    assert not missing, (
        f"Kind members without a body in tpu_dist/collectives/_lowering.py's _BODIES: "
        f"{missing}. Add each one's body factory (size, *params) -> body there."
    )
    for algorithm, table in _lowering._ALGORITHMS.items():
        strays = [key for key in table if not isinstance(key, Kind)]
        assert not strays, f"_lowering's {algorithm!r} bodies have non-Kind keys: {strays}"
    assert set(_lowering._ALGORITHMS) == set(typing.get_args(_plan_algorithms.Algorithm)), (
        "_lowering._ALGORITHMS and _plan_algorithms.Algorithm name different algorithms"
    )
    assert set(_BENCH_OPS) == set(Kind), "every Kind needs its bench op in _types._BENCH_OPS"


# -- what wraps each op of the backend's group ----------------------------------------------------


def test_each_op_method_takes_its_call_forms_and_routes_other_devices() -> None:
    """``ProcessGroupTPU``'s op methods carry their wrappers at their definitions
    (``@call_forms(op)``, ``@other_devices_to(name)``, ``_backend.py``): every op of
    ``_call_forms.FORMS`` accepts its forms (c10d's aliased names bound to the trampoline's
    methods), and exactly these methods hand other devices' tensors to the c10d ``Backend``
    method of the same collective."""
    from tpu_dist.collectives._backend import ProcessGroupTPU
    from tpu_dist.collectives._call_forms import ALIASES, FORMS

    routed = {
        "allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced",
        "reduce": "reduce", "allgather": "allgather", "all_gather_single": "_allgather_base",
        "gather": "gather", "reduce_scatter": "reduce_scatter",
        "reduce_scatter_single": "_reduce_scatter_base", "broadcast": "broadcast",
        "scatter": "scatter", "all_to_all_single": "alltoall_base", "alltoall": "alltoall",
        "send": "send", "recv": "recv",
    }
    for op in FORMS:
        method = getattr(ProcessGroupTPU, op)
        assert getattr(method, "call_forms", None) == op, f"{op} lacks @call_forms({op!r})"
        if op in ALIASES:
            assert method.__wrapped__ is getattr(ProcessGroupTPU, ALIASES[op]), op
    aliased = {ALIASES.get(op, op) for op in FORMS}
    for name, value in vars(ProcessGroupTPU).items():
        if not callable(value) or name in ALIASES:
            continue
        assert getattr(value, "other_devices_to", None) == routed.get(name), name
        if name not in FORMS and name not in aliased:
            assert not hasattr(value, "call_forms"), name
    assert all(callable(vars(ProcessGroupTPU).get(name)) for name in routed)
