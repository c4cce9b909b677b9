"""import-linter contract type `acyclic_modules` (pyproject.toml, [tool.importlinter]): no import
cycle between modules anywhere in the root packages. Every import counts, a lazy one inside a
function too: a cycle through a lazy import is still two modules that cannot be understood (or
tested) one without the other.

import-linter's own `acyclic_siblings` compares whole packages (eagle3.train against
eagle3.capture, ...), which reports shared helpers as cycles; this one looks at modules.
`lint-imports` runs from the repo root, which it puts on sys.path, so `scripts.import_contracts`
imports without being installed.
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter.application import contract_utils, output
from importlinter.application.contract_utils import AlertLevel
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def find_cycles(graph: ImportGraph, modules: set[str]) -> list[list[str]]:
    """The import cycles among `modules`: each strongly connected component of two or more modules,
    as one cycle through it (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    edges = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules)
        for m in modules
    }
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return [_one_cycle(graph, comp) for comp in sorted(components)]


def _one_cycle(graph: ImportGraph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module: [a, b, ..., a]."""
    start = component[0]
    best: list[str] | None = None
    for nxt in graph.find_modules_directly_imported_by(start):
        if nxt in component:
            back = graph.find_shortest_chain(importer=nxt, imported=start)
            if back and (best is None or len(back) + 1 < len(best)):
                best = [start, *back]
    return best or [*component, start]


class AcyclicModulesContract(Contract):
    type_name = "acyclic_modules"

    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)
    unmatched_ignore_imports_alerting = fields.EnumField(AlertLevel, default=AlertLevel.ERROR)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=self.unmatched_ignore_imports_alerting,  # type: ignore[arg-type]
        )
        ours = {m for m in graph.modules if not graph.is_module_squashed(m)}
        cycles = find_cycles(graph, ours)
        return ContractCheck(
            kept=not cycles,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={"cycles": cycles},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            output.print_error("import cycle: " + " -> ".join(cycle), bold=True)
            output.new_line()
        output.print("Break each cycle: move what both need into a lower module, or pass it in.")
