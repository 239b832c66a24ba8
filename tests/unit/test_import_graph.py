"""The package's import graph, read statically: no module of the package imports itself back through
others (:func:`cycles_touching` names the cycles through one part of it), and every import runs down
the layers (:data:`LAYERS`, :func:`against_the_layers`).

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


#: The layers, lowest first. A module imports modules of its own part, or of a part on a lower layer;
#: two parts on one layer never import each other. What no entry names is core (``clock``, ``config``,
#: ``sql``, ``handoff``, ``health``, ``messages``: the Celery message plumbing every capability uses).
#: ``locks`` is the lowest capability: the store's ``SafeTask`` and beat's overlap guard build on the
#: locks, and the locks reach the store only through the core seam ``handoff``. The integrations wire
#: the capabilities into an app: the package's face, ``install``, ``checks``, ``metrics``, ``testing``,
#: the CLI and the Django add-on.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("locks",),
    ("delays", "beat"),
    ("", "install", "checks", "metrics", "testing", "cli", "contrib"),
)


def part_of(module: str) -> tuple[int, str]:
    """(layer, part) of a module of the package: layer 0 is core, the parts' layers follow in :data:`LAYERS`."""
    inside = module.removeprefix(PACKAGE).removeprefix(".")
    for layer, parts in enumerate(LAYERS, start=1):
        for part in parts:
            if inside == part or (part and inside.startswith(part + ".")):
                return layer, part
    return 0, "core"


def against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    """Every edge that runs up the layers, or sideways between two capabilities of one layer (the
    integrations, on the top layer, may import each other), as "importer -> imported (why)"."""
    found = []
    for module, imported in sorted(graph.items()):
        layer, part = part_of(module)
        for target in sorted(imported):
            target_layer, target_part = part_of(target)
            sideways = target_layer == layer and 0 < layer < len(LAYERS) and target_part != part
            if target_layer > layer or sideways:
                way = "up" if target_layer > layer else "sideways"
                found.append(f"{module} -> {target} ({way}: {part} imports {target_part})")
    return found


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert "celery_safe_time.beat.backends.postgres" in graph["celery_safe_time.beat.backends"]
    assert "celery_safe_time.beat.state" in graph["celery_safe_time.beat.backends.redis"]


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


def test_a_part_is_named_by_its_longest_path_and_the_rest_is_core() -> None:
    assert part_of(PACKAGE) == (3, "")
    assert part_of(f"{PACKAGE}.contrib.django.store") == (3, "contrib")
    assert part_of(f"{PACKAGE}.delays.backends.sql.store") == (2, "delays")
    assert part_of(f"{PACKAGE}.locks") == (1, "locks")
    assert part_of(f"{PACKAGE}.sql.engine") == (0, "core")
    assert part_of(f"{PACKAGE}.messages.requeue") == (0, "core")
    assert part_of(f"{PACKAGE}.installer") == (0, "core")  # a part is a whole name, not a prefix of one


def test_an_edge_up_or_sideways_between_capabilities_is_named() -> None:
    core, locks, delays, beat, cli = (f"{PACKAGE}.{m}" for m in ("clock", "locks.a", "delays.b", "beat.c", "cli"))
    graph = {core: {locks}, locks: {delays, core}, delays: {beat, locks}, beat: {locks}, cli: {beat, core}}
    graph[cli].add(f"{PACKAGE}.install")  # the integrations may import each other
    assert against_the_layers(graph) == [
        f"{core} -> {locks} (up: core imports locks)",
        f"{delays} -> {beat} (sideways: delays imports beat)",
        f"{locks} -> {delays} (up: locks imports delays)",
    ]


def test_every_import_of_the_package_runs_down_the_layers() -> None:
    edges = against_the_layers(import_graph())
    assert not edges, "imports against the layers:\n" + "\n".join(edges)


def test_checks_ask_each_backend_through_its_seam() -> None:
    reached = import_graph()[f"{PACKAGE}.checks"]
    backends = [m for m in reached if ".backends." in m]
    assert backends == [], f"checks imports a backend module instead of its package's seam: {backends}"
