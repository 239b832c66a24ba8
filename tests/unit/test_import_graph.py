"""The package's import graph, read statically: no module of the package imports itself back through
others (:func:`cycles_touching` names the cycles through one part of it).

Every ``import`` statement counts, at module level or inside a function: a deferred import that
dodges a cycle at runtime still ties the modules together. An edge goes to the module an import
names (``from .backends.base import X`` -> ``beat.backends.base``; ``from . import entries`` ->
``beat.entries``), not to the packages Python initialises on the way.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import celery_safe_time

PACKAGE = "celery_safe_time"
ROOT = Path(celery_safe_time.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _targets(module: str, path: Path, known: set[str]) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            # ``from pkg import name``: the submodule when ``name`` is one, else the module itself
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # ``import a.b.c`` of an attribute path: the module part
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    modules = _modules()
    known = set(modules)
    return {name: set(_targets(name, path, known)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycles_touching(part: str, graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The import cycles with a module of ``part`` in them: a dotted path under the package (``"beat"``,
    ``"locks.backends"``), or ``""`` for the whole package."""
    prefix = f"{PACKAGE}.{part}" if part else PACKAGE

    def inside(module: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    return [c for c in cycles(import_graph() if graph is None else graph) if any(inside(m) for m in c)]


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert "celery_safe_time.beat.backends.postgres" in graph["celery_safe_time.beat.backends"]
    assert "celery_safe_time.beat.state" in graph["celery_safe_time.beat.lease"]


def test_a_cycle_is_found_when_two_modules_import_each_other() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_cycle_counts_for_a_part_only_when_one_of_its_modules_is_in_it() -> None:
    graph = {f"{PACKAGE}.locks.a": {f"{PACKAGE}.core"}, f"{PACKAGE}.core": {f"{PACKAGE}.locks.a"}}
    assert cycles_touching("locks", graph) == [[f"{PACKAGE}.core", f"{PACKAGE}.locks.a"]]
    assert cycles_touching("beat", graph) == []
    assert cycles_touching("", graph) == cycles_touching("locks", graph)
    assert cycles_touching("lock", graph) == []  # a part is a whole package name, not a prefix of one


def test_no_module_of_the_package_is_in_an_import_cycle() -> None:
    assert cycles_touching("") == []


def test_beat_modules_import_in_one_order_backends_then_state_and_slots_then_entries_then_scheduler() -> None:
    graph = import_graph()
    beat = f"{PACKAGE}.beat."
    later = {"entries": ["scheduler"], "slots": ["entries", "scheduler"], "state": ["slots", "entries", "scheduler"]}
    for module, successors in later.items():
        assert not {beat + s for s in successors} & graph[beat + module], module
    for backend in ("redis", "postgres", "memory"):
        imported = graph[f"{beat}backends.{backend}"]
        assert not {beat + m for m in ("slots", "entries", "scheduler", "base")} & imported, backend
