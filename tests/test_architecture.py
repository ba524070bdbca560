"""The package's import graph: no import cycle between files, and layers only look down.

Every module of ``nvalchemi/`` is parsed with :mod:`ast`. An import anywhere in a file
counts (module level or inside a function, ``importlib.import_module("nvalchemi...")``
included); imports under ``if TYPE_CHECKING:`` do not (they never run). A package
``__init__`` that re-exports names lazily (``lazy_exports``) imports the modules its table
names, so those count too.

Layers, bottom to top (the project's ARCHITECTURE.md)::

    bottom (_serialization, _fileio, _lazy, _optional, spec, __init__)
      <- data <- models <- distributed <- hooks <- training <- app

A module may import its own layer and the layers below it, never one above; nothing
imports the application (``nvalchemi.app``) but the application itself and
``nvalchemi.training.cli``, the documented path of the console script, which re-exports the
application's entry point and belongs to the ``app`` layer. ``nvalchemi.training.checkpoint.store`` is bottom-layer code that
lives in the checkpoint package (``models/calculator.py`` reads weights through it), so it
may import only the bottom layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nvalchemi

PACKAGE_DIR = Path(nvalchemi.__file__).resolve().parent
ROOT = "nvalchemi"

BOTTOM = frozenset(
    {
        "nvalchemi",
        "nvalchemi._serialization",
        "nvalchemi._errors",
        "nvalchemi._fileio",
        "nvalchemi._lazy",
        "nvalchemi._optional",
        "nvalchemi.checkpoint_files",
        "nvalchemi.spec",
    }
)
CHECKPOINT_STORE = "nvalchemi.training.checkpoint.store"
"""Bottom-layer code in the checkpoint package: the one declared exception."""
LAYERS = ("bottom", "data", "models", "distributed", "hooks", "training", "app")
CLI_SHIM = "nvalchemi.training.cli"
"""The console script's documented path: a re-export of :mod:`nvalchemi.app.cli`."""
TOP_LEVEL_LAYER = {"nvalchemi.neighbors": "data"}
"""Top-level modules outside the bottom layer: documented import paths of a layer's code."""


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (both module names) at ``line`` of the source file."""

    source: str
    target: str
    line: int
    lazy: bool = False  # a name in a ``lazy_exports`` table (imported on first use)

    def __str__(self) -> str:
        how = " (lazy export)" if self.lazy else ""
        return f"{self.source}:{self.line} -> {self.target}{how}"


def _module_name(path: Path) -> str:
    parts = (ROOT, *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(package: str, module: str | None, level: int) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``package``."""
    if level == 0:
        return module or ""
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _known(name: str) -> str | None:
    """The module file that an import of ``name`` runs last (``a.b.c`` -> ``a.b`` if no ``c``)."""
    while name.startswith(ROOT):
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.edges: list[Edge] = []
        self.strings: dict[str, str] = {}  # module-level ``NAME = "..."`` (lazy tables use them)
        self.lazy_tables: list[ast.Dict] = []

    def _add(self, target: str | None, node: ast.stmt | ast.expr, lazy: bool = False) -> None:
        if target is not None and target != self.module:
            self.edges.append(Edge(self.module, target, node.lineno, lazy))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:  # only the ``else`` branch runs
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(_known(alias.name), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.package, node.module, node.level)
        for alias in node.names:
            # ``from pkg import submodule`` imports the submodule; ``from pkg import name``
            # runs ``pkg`` (its ``__init__``, or the module itself).
            self._add(_known(f"{base}.{alias.name}") or _known(base), node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        first = node.args[0] if node.args else None
        if (
            name == "import_module"
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and not first.value.startswith(".")
        ):
            self._add(_known(first.value), node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.strings[target.id] = node.value.value
        if isinstance(node.value, ast.Dict):
            self.lazy_tables.append(node.value)
        self.generic_visit(node)

    def lazy_edges(self, tree: ast.Module) -> Iterator[Edge]:
        calls_lazy_exports = any(
            isinstance(n, ast.Call) and getattr(n.func, "id", None) == "lazy_exports"
            for n in ast.walk(tree)
        )
        if not calls_lazy_exports:
            return
        for table in self.lazy_tables:
            for value in table.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    text = value.value
                elif isinstance(value, ast.Name) and value.id in self.strings:
                    text = self.strings[value.id]
                else:
                    continue
                level = len(text) - len(text.lstrip("."))
                target = _known(_resolve(self.package, text.lstrip(".") or None, level))
                if target is not None and target != self.module:
                    yield Edge(self.module, target, value.lineno, lazy=True)


def _edges_of(module: str, source: str | None = None, is_package: bool = False) -> list[Edge]:
    """The imports of ``module`` (its file, or ``source`` for a module that is not one)."""
    if source is None:
        source = MODULES[module].read_text(encoding="utf-8")
        is_package = MODULES[module].name == "__init__.py"
    tree = ast.parse(source, filename=module)
    visitor = _Imports(module, is_package)
    visitor.visit(tree)
    return [*visitor.edges, *visitor.lazy_edges(tree)]


EDGES = sorted(
    {edge for module in MODULES for edge in _edges_of(module)}, key=lambda e: (e.source, e.line)
)


def _layer(module: str) -> int:
    """Position of ``module``'s layer in :data:`LAYERS` (-1: a module no layer claims)."""
    if module in BOTTOM or module == CHECKPOINT_STORE:
        return LAYERS.index("bottom")
    if module in TOP_LEVEL_LAYER:
        return LAYERS.index(TOP_LEVEL_LAYER[module])
    if module == CLI_SHIM or module.startswith(CLI_SHIM + "."):
        return LAYERS.index("app")
    package = module.split(".")[1]
    return LAYERS.index(package) if package in LAYERS and "." in module else -1


def _cycles(edges: Iterable[Edge]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for edge in edges:
        graph[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _describe_cycles(components: list[set[str]]) -> str:
    lines = []
    for component in components:
        lines.append("cycle between " + ", ".join(sorted(component)) + ":")
        inside = [e for e in EDGES if e.source in component and e.target in component]
        lines.extend(f"  {edge}" for edge in sorted(inside, key=str))
    return "\n".join(lines)


def test_the_walk_sees_the_package() -> None:
    """A guard for the test itself: it finds the modules and imports it must judge."""
    assert {"nvalchemi.data.atomic_data", "nvalchemi.app.cli", CLI_SHIM, CHECKPOINT_STORE} <= set(
        MODULES
    )
    assert Edge("nvalchemi.spec", "nvalchemi._serialization", 0) in {
        Edge(e.source, e.target, 0) for e in EDGES
    }
    # lazy re-exports are imports: the data package's table names the AtomicData module
    assert any(
        e.lazy and (e.source, e.target) == ("nvalchemi.data", "nvalchemi.data.atomic_data")
        for e in EDGES
    )


def test_the_walk_counts_imports_in_functions_and_lazy_tables_but_not_type_checking() -> None:
    source = """
from typing import TYPE_CHECKING
from . import fields
if TYPE_CHECKING:
    from nvalchemi.hooks.context import TrainContext
else:
    import nvalchemi.distributed.runtime
def build():
    from ..models.base import BaseModelMixin
    return importlib.import_module("nvalchemi.hooks.context")
_TABLE = "nvalchemi.training.spec"
_EXPORTS = {"Batch": ".batch", "BaseSpec": _TABLE}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
"""
    edges = {(e.target, e.lazy) for e in _edges_of("nvalchemi.data", source, is_package=True)}
    assert edges == {
        ("nvalchemi.data.fields", False),
        ("nvalchemi.distributed.runtime", False),
        ("nvalchemi.models.base", False),
        ("nvalchemi.hooks.context", False),
        ("nvalchemi.data.batch", True),
        ("nvalchemi.training.spec", True),
    }


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if _layer(m) < 0)
    assert not unplaced, (
        f"modules outside every layer: {unplaced}; move them into a layer's package, or add "
        "them to BOTTOM / TOP_LEVEL_LAYER here if ARCHITECTURE.md places them"
    )


def test_no_import_cycle_between_files() -> None:
    components = _cycles(EDGES)
    assert not components, "import cycles:\n" + _describe_cycles(components)


def test_layers_only_look_down() -> None:
    upward = [e for e in EDGES if _layer(e.target) > _layer(e.source)]
    assert not upward, (
        "imports of a higher layer ("
        + " <- ".join(LAYERS)
        + "):\n"
        + "\n".join(f"  {e}" for e in upward)
    )


def test_the_engine_never_imports_the_application() -> None:
    app = LAYERS.index("app")
    into_app = [e for e in EDGES if _layer(e.target) == app and _layer(e.source) != app]
    assert not into_app, "imports of the application:\n" + "\n".join(f"  {e}" for e in into_app)


def test_the_console_script_path_only_reexports_the_application() -> None:
    shim = [e for e in EDGES if e.source.startswith(CLI_SHIM)]
    assert shim and {e.target for e in shim} == {"nvalchemi.app.cli"}, shim


def test_checkpoint_store_imports_only_the_bottom_layer() -> None:
    # Importing the store also runs the packages it lives in: they may re-export lazily
    # (a name's module is imported on first use) but import nothing else up front.
    packages = ("nvalchemi.training", "nvalchemi.training.checkpoint")
    above = [
        e
        for e in EDGES
        if e.target not in BOTTOM
        and (e.source == CHECKPOINT_STORE or (e.source in packages and not e.lazy))
    ]
    assert not above, "the checkpoint store imports above the bottom layer:\n" + "\n".join(
        f"  {e}" for e in above
    )
