"""An import-linter contract that no module of a package takes part in an import cycle.

import-linter's `acyclic_siblings` looks at one level at a time, with each child package
squashed into one node; this contract looks at the modules themselves, every level at once:
a package's `__init__` counts as a module, and imports under `if TYPE_CHECKING:` count as
grimp records them. A broken contract names each circle (a strongly connected component of
the import graph) and one cycle through it, import by import, with the line of each import.

Registered in pyproject.toml under `[tool.importlinter] contract_types`; `lint-imports` runs
it from the repository root, where `tests` is importable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


@dataclass(frozen=True)
class Circle:
    """Modules that import each other, directly or through one another, and one cycle among them."""

    modules: tuple[str, ...]  # every module of the circle, sorted
    cycle: tuple[str, ...]  # a shortest cycle through the first of them; the first module is not repeated


def _inside(module: str, containers: Iterable[str]) -> bool:
    return any(module == c or module.startswith(c + ".") for c in containers)


def circles(graph: grimp.ImportGraph, containers: Iterable[str]) -> list[Circle]:
    """Every circle among the modules in `containers` (and their descendants), sorted by first module.

    Only imports between two such modules count: a path that leaves the containers and comes
    back is the other package's concern.
    """
    scope = sorted(containers)
    modules = sorted(m for m in graph.modules if _inside(m, scope))
    inside = set(modules)
    edges = {m: sorted(t for t in graph.find_modules_directly_imported_by(m) if t in inside) for m in modules}
    found = [_circle(component, edges) for component in _components(modules, edges)]
    return sorted(found, key=lambda c: c.modules)


def _components(modules: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle in them (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = edges[node]
            while next_edge < len(targets):
                target = targets[next_edge]
                next_edge += 1
                if target not in index:
                    work.append((node, next_edge))
                    work.append((target, 0))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in edges[node]:
                        result.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return result


def _circle(component: list[str], edges: dict[str, list[str]]) -> Circle:
    """The component with a shortest cycle through its first module (breadth first, inside it)."""
    start = component[0]
    members = set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in edges[node]:
            if target not in members:
                continue
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return Circle(modules=tuple(component), cycle=tuple(reversed(path)))
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")  # pragma: no cover


class AcyclicModulesContract(Contract):
    """No import cycle among the modules of the `containers` packages.

    [[tool.importlinter.contracts]]
    type = "acyclic_modules"
    containers = ["gateway"]
    """

    type_name = "acyclic_modules"

    containers = fields.SetField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        containers: set[str] = self.containers  # type: ignore[assignment]
        missing = sorted(c for c in containers if c not in graph.modules)
        if missing:
            raise ValueError(f"acyclic_modules: no such module: {', '.join(missing)}")
        found = circles(graph, containers)
        output.verbose_print(verbose, f"{len(found)} import circle(s) among the modules of {', '.join(sorted(containers))}")
        imports = {c.modules: _imports(graph, c.cycle) for c in found}
        return ContractCheck(kept=not found, metadata={"circles": found, "imports": imports})

    def render_broken_contract(self, check: ContractCheck) -> None:
        found: list[Circle] = check.metadata["circles"]
        imports: dict[tuple[str, ...], list[tuple[str, str, str]]] = check.metadata["imports"]
        for circle in found:
            output.print_error(f"{len(circle.modules)} modules import each other in a circle: {', '.join(circle.modules)}.")
            output.print_error("One cycle through them:")
            output.new_line()
            for importer, imported, where in imports[circle.modules]:
                output.print_error(f"- {importer} -> {imported} ({where})", bold=False)
            output.new_line()


def _imports(graph: grimp.ImportGraph, cycle: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """Each hop of the cycle with where the import is: `l.N` (the lines, where one module imports another twice)."""
    hops = []
    for position, importer in enumerate(cycle):
        imported = cycle[(position + 1) % len(cycle)]
        details = graph.get_import_details(importer=importer, imported=imported)
        lines = sorted({d["line_number"] for d in details})
        hops.append((importer, imported, "l." + ", ".join(str(n) for n in lines) if lines else "line unknown"))
    return hops
