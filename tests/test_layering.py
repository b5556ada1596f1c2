"""graphkern's packages are layered: a module imports its own package and the packages below it,
never one above, and no two modules import each other, even through imports inside functions.

The imports are read from the source (``scripts/package_deps.py``: ``ast``, module-level and
function-level imports alike), so a cycle dodged by importing inside a function is still caught.
A lower layer that needs something of a higher one declares a slot the higher one fills
(``graphkern.tracing.extensions``, ``graphkern.compiling.extensions``); docs/architecture.md tells
the order and why.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("package_deps", ROOT / "scripts" / "package_deps.py")
assert _spec is not None and _spec.loader is not None
package_deps = importlib.util.module_from_spec(_spec)
sys.modules["package_deps"] = package_deps  # dataclasses look their module up
_spec.loader.exec_module(package_deps)

#: graphkern's packages (top-level modules and subpackages), lowest first: a module may import its
#: own package and the packages before it.
ORDER = [
    "nodes",        # Kernel, OutputSpec, TemplateArg, Status, KernelError: the shared vocabulary
    "errors",       # the error classes by kind
    "launching",    # backends, validation, MLX's kernel objects, launch paths, launch caches, autodiff
    "runtime",      # apply, apply_in_graph, launch, bind: a kernel launched
    "kernels",      # the kernel library, one @declare'd module a kernel
    "metal_check",  # Metal sources compiled as MLX would (it walks the library's variants)
    "tracing",      # gk.trace, the Graph, capture, replay, state, guards
    "compiling",    # gk.compile: compiled graphs guarded by their traces
    "viz",          # drawing graphs: DOT, the HTML viewer, Model Explorer, diffs
    "debugging",    # gk.inspect, gk.compare, gk.check (comparisons are drawn with viz)
    "distributed",  # several processes: collective stand-ins, the ranks' agreement, the watchdog
    "models",       # gk.patch, gk.wrap: kernel-backed layers, model families, segments
    "graphkern",    # the facade, graphkern/__init__.py: the public names, and it fills the slots
    "demo",         # the demo model the command line runs
    "cli",          # the command line
    "__main__",     # python -m graphkern
]

#: What ``import graphkern`` loads (the facade's module-level imports): the core, no further.
FACADE_CORE = set(ORDER[:ORDER.index("compiling") + 1])
#: The packages the facade reaches only lazily, on first use, so that ``import graphkern`` stays
#: light: its ``_LAZY`` names (``gk.wrap``, ``gk.inspect``, ``gk.diff``...) and the slot fillers
#: that load ``graphkern.distributed`` and ``graphkern.debugging`` at the first trace or compile
#: that needs them. The only imports of the facade allowed past ``FACADE_CORE``.
FACADE_LAZY = {"kernels", "viz", "debugging", "distributed", "models"}

#: The command line imports each command's modules when the command runs (``graphkern --help``
#: loads neither the models nor the viewer): its lazy imports need no comment each.
LAZY_BY_DESIGN = ("graphkern.cli",)

IMPORTS = package_deps.imports(ROOT)


def test_every_package_has_a_place_in_the_order() -> None:
    packages = {package_deps.package_of(module) for module in package_deps.modules(ROOT)}
    assert sorted(packages - set(ORDER)) == [], "add the new package to ORDER (and docs/architecture.md)"
    assert sorted(set(ORDER) - packages) == []


def test_no_module_imports_a_package_above_its_own() -> None:
    def level(module: str) -> int:
        return ORDER.index(package_deps.package_of(module))

    upward = [f"{i.module}:{i.line} imports {i.target}{' (inside a function)' if i.lazy else ''}"
              for i in IMPORTS if level(i.target) > level(i.module)]
    assert upward == []


def test_no_import_cycles_between_modules() -> None:
    assert package_deps.cycles(IMPORTS) == []


def test_the_facade_loads_the_core_and_reaches_the_rest_lazily() -> None:
    eager = {package_deps.package_of(i.target) for i in IMPORTS if i.module == "graphkern" and not i.lazy}
    lazy = {package_deps.package_of(i.target) for i in IMPORTS if i.module == "graphkern" and i.lazy}
    assert eager - FACADE_CORE == set()
    assert lazy - FACADE_CORE - FACADE_LAZY == set()
    # the names gk.__getattr__ imports by module name (importlib), which no import statement shows
    tree = ast.parse((ROOT / "graphkern" / "__init__.py").read_text())
    [table] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)]
    named = {package_deps.package_of(value) for value in ast.literal_eval(table).values()}
    assert named - FACADE_LAZY == set()


def test_imports_inside_functions_say_why() -> None:
    """An import inside a function keeps something light (``import graphkern``, a command, a page
    that is never drawn): a comment says so. None may dodge a cycle (the test above)."""
    silent = [f"{i.module}:{i.line} -> {i.target}" for i in IMPORTS
              if i.lazy and not i.commented and not i.module.startswith(LAZY_BY_DESIGN)]
    assert silent == []


def test_the_reader_of_imports_sees_relative_function_level_and_facade_imports(tmp_path: Path) -> None:
    """``package_deps`` itself, on a package made for it."""
    package = tmp_path / "graphkern"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("from .low import thing\n")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "thing.py").write_text(
        "def f():\n    from graphkern.high import x\n    return x\n")
    (package / "high.py").write_text("from graphkern.low.thing import f  # the low layer\nx = 1\n")
    found = {(i.module, i.target, i.lazy, i.commented) for i in package_deps.imports(tmp_path)}
    assert found == {("graphkern", "graphkern.low.thing", False, False),
                     ("graphkern.low.thing", "graphkern.high", True, False),
                     ("graphkern.high", "graphkern.low.thing", False, True)}
    assert package_deps.cycles(package_deps.imports(tmp_path)) == [["graphkern.high", "graphkern.low.thing"]]


def test_the_architecture_page_lists_this_order() -> None:
    """docs/architecture.md tells the order and why; the first block of its section on the order
    is this list."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("\n## The packages, in order\n", 1)[1]
    block = re.findall(r"```text\n(.*?)```", section, flags=re.S)[0]
    assert block.split() == ORDER
