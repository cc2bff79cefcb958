"""The package's import graph is a DAG whose layers only import downwards (issue 32).

Read from the source with ``ast``, so every import counts: at module top, inside functions
(a lazy import still ties two modules together), and under ``TYPE_CHECKING``. Layers, lowest
first (``tpu_dist/ARCHITECTURE.md``)::

    _settings < mesh < collectives < dtensor_ext, compile_job < launch < bench < tpu_dist

A module may import its own subpackage and any lower layer; ``dtensor_ext`` and
``compile_job`` (one layer) do not import each other. Across subpackages only public modules
are imported (no ``_``-prefixed module of another subpackage), except ``tpu_dist._settings``
(every knob of the package, declared once) and the few named in :data:`_REACHES` with the
reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tpu_dist"

_LAYERS = {
    "tpu_dist._settings": 0,
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
    ("tpu_dist.bench._xla", "tpu_dist.collectives._plan"),
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
            shared = target == "tpu_dist._settings"  # the package's one table of knobs
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
