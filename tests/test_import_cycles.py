"""No file of the project imports itself back through other files.

The graph is grimp's (the library import-linter checks its contracts on): every import is an
edge, whether at the top of a file, inside a function or under ``TYPE_CHECKING``, since each
ties the two files together as much as the others. The ``layers`` contract in
``pyproject.toml`` orders the packages; this test also covers the files inside one package.
"""

from __future__ import annotations

from collections.abc import Iterator

import grimp

PACKAGES = ("app", "engine", "kv_transport", "deployments", "autoscaling", "bench", "workloads", "planner")


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The graph's strongly connected components of two modules or more (each holds at least
    one cycle), sorted; Tarjan's algorithm without recursion. A module that imports itself
    by its own name (a worker pickled by module name while it runs as ``__main__``) ties no
    two files together and is left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        _visit(graph, root, index, low, stack, on_stack, work)
        while work:
            module, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    _visit(graph, successor, index, low, stack, on_stack, work)
                elif successor in on_stack:
                    low[module] = min(low[module], index[successor])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = _pop_component(module, stack, on_stack)
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _visit(
    graph: grimp.ImportGraph,
    module: str,
    index: dict[str, int],
    low: dict[str, int],
    stack: list[str],
    on_stack: set[str],
    work: list[tuple[str, Iterator[str]]],
) -> None:
    index[module] = low[module] = len(index)
    stack.append(module)
    on_stack.add(module)
    work.append((module, iter(sorted(graph.find_modules_directly_imported_by(module) - {module}))))


def _pop_component(root: str, stack: list[str], on_stack: set[str]) -> list[str]:
    component = []
    while True:
        module = stack.pop()
        on_stack.discard(module)
        component.append(module)
        if module == root:
            return component


def describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    """The imports inside one component, each with its line."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members - {importer}):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer} -> {imported} (line {detail['line_number']}: {detail['line_contents']})")
    return "\n".join(lines)


def test_no_file_level_import_cycle():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    cycles = import_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(describe(graph, c) for c in cycles)


def test_cycles_are_found_through_any_import_and_self_imports_are_left_out():
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.d", "p.d")]:
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="import")
    graph.add_import(importer="q.x", imported="q.y", line_number=7, line_contents="from q import y")
    graph.add_import(importer="q.y", imported="q.x", line_number=9, line_contents="    from q import x")
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"], ["q.x", "q.y"]]
    assert describe(graph, ["q.x", "q.y"]).splitlines() == [
        "q.x <-> q.y",
        "    q.x -> q.y (line 7: from q import y)",
        "    q.y -> q.x (line 9:     from q import x)",
    ]
