"""graphkern's imports, read from the source (``ast``, nothing is imported): who imports whom.

    python scripts/package_deps.py              # package-level dependencies, lazy ones marked
    python scripts/package_deps.py --modules    # every import between graphkern modules
    python scripts/package_deps.py --cycles     # import cycles between modules, if any

A package is a top-level name under ``graphkern/`` (``tracing``, ``runtime``, ...); the package
``graphkern`` itself (``graphkern/__init__.py``) is the facade. Imports inside a function count
(they are marked ``lazy``): a cycle dodged by importing inside a function is still a cycle.
``tests/test_layering.py`` checks these imports against the package order of
``docs/architecture.md``.
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACADE = "graphkern"


@dataclass(frozen=True)
class Import:
    """One import of a graphkern module by another."""

    module: str  # the importing module, dotted
    target: str  # the graphkern module imported (a name imported from a module resolves to the module)
    line: int
    lazy: bool  # inside a function
    commented: bool  # a comment on its line or above its group of imports (see _commented)
    path: Path


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """``graphkern.tracing.graph`` -> ``tracing``; the facade ``graphkern`` -> ``graphkern``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "graphkern").rglob("*.py"))}


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of a graphkern module in ``graphkern/``, at module level or inside a function."""
    known = modules(root)

    def resolve(name: str) -> str:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    found = []
    for module, path in known.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        functions = [fn for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_function = {id(node) for fn in functions for node in ast.walk(fn)
                       if isinstance(node, (ast.Import, ast.ImportFrom))}
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    above = package[:len(package) - node.level + 1]
                    base = ".".join(above + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            commented = _commented(lines, node.lineno)
            for target in targets:
                if target.split(".")[0] == FACADE:
                    found.append(Import(module, resolve(target), node.lineno, id(node) in in_function,
                                        commented, path))
    return sorted(set(found), key=lambda i: (i.module, i.line, i.target))


def _commented(lines: list[str], line: int) -> bool:
    """Whether the import on ``line`` (1-based) says why it is where it is: a comment on its line,
    or on the line above the group of imports it belongs to (or on any import of that group)."""
    if "#" in lines[line - 1]:
        return True
    for text in (lines[at].strip() for at in range(line - 2, -1, -1)):
        if text.startswith("#"):
            return True
        if not text.startswith(("from ", "import ")):
            return False
        if "#" in text:
            return True
    return False


def cycles(found: list[Import]) -> list[list[str]]:
    """Import cycles between modules (a package's ``__init__`` importing its own modules included)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for i in found:
        if i.target != i.module:
            graph[i.module].add(i.target)
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modules", action="store_true", help="every import between graphkern modules")
    parser.add_argument("--cycles", action="store_true", help="import cycles between modules")
    options = parser.parse_args()
    found = imports()
    if options.modules:
        for i in found:
            print(f"{i.module}:{i.line} -> {i.target}{'  (lazy)' if i.lazy else ''}")
        return 0
    if options.cycles:
        for cycle in cycles(found):
            print(" <-> ".join(cycle))
        return 0
    counts = collections.Counter((package_of(i.module), package_of(i.target), i.lazy) for i in found
                                 if package_of(i.module) != package_of(i.target))
    for (source, target, lazy), n in sorted(counts.items()):
        print(f"{source:12} -> {target:12} {n:3}{'  (lazy)' if lazy else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
