"""Public names resolve to what the README says, whatever has been imported before.

A package attribute that names both a submodule and a public function flips from one to the other
when the submodule is first imported; so every public name is checked after importing every
module of the package (the README's Python blocks run after ``gk.patch`` in tests/test_docs.py).
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import graphkern

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["graphkern", "graphkern.viz", "graphkern.models", "graphkern.kernels"]
#: Public names that are subpackages on purpose.
SUBPACKAGES = {("graphkern", "kernels")}


def _import_everything() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(graphkern.__path__, "graphkern."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def test_no_public_name_is_a_module_after_every_module_was_imported() -> None:
    assert len(_import_everything()) > 30
    shadowed = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for name in package.__all__:
            value = getattr(package, name)
            if isinstance(value, types.ModuleType) and (package_name, name) not in SUBPACKAGES:
                shadowed.append(f"{package_name}.{name}")
    assert shadowed == []


def test_no_module_is_named_like_a_public_function_beside_it() -> None:
    _import_everything()
    clashes = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        modules = {info.name for info in pkgutil.iter_modules(package.__path__)}
        clashes += [f"{package_name}.{name}" for name in sorted(modules & set(package.__all__))
                    if (package_name, name) not in SUBPACKAGES]
    assert clashes == []
    assert callable(graphkern.trace) and not isinstance(graphkern.trace, types.ModuleType)


def test_gk_check_is_the_function_after_the_models_were_used() -> None:
    code = textwrap.dedent("""
        import mlx.core as mx, mlx.nn as nn, graphkern as gk
        gk.patch(nn.Sequential(nn.RMSNorm(8)))
        import graphkern.models, graphkern.viz
        report = gk.check("rms_norm")
        assert report.ok, report
        assert callable(gk.diff) and callable(gk.check_model) and callable(gk.wrap)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_import_graphkern_loads_only_the_core() -> None:
    """``import graphkern`` loads no distributed, drawing or model module (nor mlx-lm): the
    collective stand-ins and the ranks' agreement load on the first trace or compile."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import graphkern"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = [line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "graphkern.tracing.traceable" in loaded and "graphkern.compiling.compiled" in loaded
    heavy = [m for m in loaded if m.startswith(("graphkern.distributed", "graphkern.viz", "graphkern.models",
                                                "mlx_lm"))]
    assert heavy == []


def test_the_graph_draws_through_a_backend_it_names_never_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing uses the graph, not the reverse: ``graph.py`` imports nothing of ``graphkern.viz``
    and finds its drawing module by name at the first picture, as pandas finds its plotting
    backend; another module set there draws instead."""
    import ast

    import mlx.core as mx

    tree = ast.parse((ROOT / "graphkern" / "tracing" / "graph.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [name for name in imported if "viz" in name]
    graph = graphkern.trace(lambda x: mx.exp(x) * 2, mx.ones((2,)))
    assert graph.to_dot().startswith("digraph")  # graphkern.viz, by default
    drawing = types.ModuleType("my_drawing")
    drawing.to_dot = lambda g, **options: f"{len(g.nx)} nodes {options}"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_drawing", drawing)
    graph.drawing_backend = "my_drawing"
    assert graph.to_dot(stats=True) == f"{len(graph.nx)} nodes {{'stats': True}}"
