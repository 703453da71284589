"""The layout rules the code review asked for, checked on every lint run:

* no module of ``packages/*/src`` passes MAX_LINES lines unless its first lines say why,
  in a comment ``# size: <the reason>``;
* no import cycle between the modules of ``lightrft``: an import that runs (at module
  level or inside a function; imports under ``if TYPE_CHECKING:`` excluded) is an edge,
  and every strongly connected group of two or more modules is reported with the lines
  that close it.

    python tools/check_layout.py          # exit 1 naming each problem
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500
SIZE_MARK = "# size:"


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_imports_of(child))
            continue
        yield from _runtime_imports_of(node)


def _runtime_imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _runtime_imports(node)


def _targets(name: str, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> set[str]:
    """The lightrft modules an import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = node.module or ""
    if node.level:
        package = name.split(".")
        if known[name].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    found = {f"{base}.{alias.name}" for alias in node.names} & known.keys()
    if base in known:
        found.add(base)
    return found


def import_graph(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {imported lightrft module: first line}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges: dict[str, int] = {}
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(name, node, known):
                if target != name and not name.startswith(target + "."):
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def problems() -> list[str]:
    known = modules()
    found: list[str] = []
    for path in known.values():
        lines = path.read_text().splitlines()
        head = "\n".join(lines[:40])
        if len(lines) > MAX_LINES and SIZE_MARK not in head:
            found.append(
                f"{path.relative_to(ROOT)}: {len(lines)} lines > {MAX_LINES}; split it by "
                f"concern, or say why it stays whole in a '{SIZE_MARK} ...' comment at its top"
            )
    graph = import_graph(known)
    for group in cycles(graph):
        edges = [
            f"{a} -> {b} ({known[a].relative_to(ROOT)}:{line})"
            for a in group
            for b, line in graph[a].items()
            if b in group
        ]
        found.append("import cycle between " + ", ".join(group) + ":\n    " + "\n    ".join(edges))
    return found


def main() -> int:
    found = problems()
    for problem in found:
        print(problem)
    print(f"check_layout: {len(found)} problem(s) in {len(modules())} modules")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
