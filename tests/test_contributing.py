"""CONTRIBUTING.md's recipe for adding a kernel works as written: its code blocks, taken from the
file, declare a kernel, find it in the registry and launch it on the reference backend; the checks
the recipe names next (``gk.check``, the Metal check) pass on what it declared."""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

import graphkern as gk
import graphkern.kernels as gkk
from graphkern.kernels import registry

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "CONTRIBUTING.md"


def recipe_blocks() -> list[str]:
    """The ```python blocks of the guide's "Adding a kernel" section, in order."""
    text = GUIDE.read_text()
    section = text.split("\n## Adding a kernel\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture
def declared() -> Iterator[types.ModuleType]:
    """The recipe's module, run as ``graphkern.kernels.ops.softsign`` would be; its registry
    entries are forgotten afterwards, so the library is as it was for the other tests."""
    before = set(registry.LIBRARY)
    module = types.ModuleType("graphkern.kernels.ops.softsign")
    try:
        exec(compile(recipe_blocks()[0], "CONTRIBUTING.md: the kernel module", "exec"), vars(module))
        yield module
    finally:
        for name in set(registry.LIBRARY) - before:
            registry.forget(name)


def test_the_guide_has_the_module_then_its_use() -> None:
    blocks = recipe_blocks()
    assert len(blocks) == 2
    assert blocks[0].startswith("# graphkern/kernels/ops/softsign.py\n")
    assert "@declare(" in blocks[0] and ".layer" in blocks[0]


def test_the_recipe_declares_registers_and_launches_a_kernel(declared: types.ModuleType) -> None:
    assert registry.LIBRARY["softsign"].kernel is declared.SOFTSIGN
    assert gkk.SOFTSIGN is declared.SOFTSIGN and gkk.softsign is declared.softsign
    # the second block, in the module's namespace (it names the layer function it declared)
    exec(compile(recipe_blocks()[1], "CONTRIBUTING.md: its use", "exec"), vars(declared))
    # eagerly, in a compiled graph, and against its reference on every float dtype
    x = mx.array([-2.0, 0.5, 8.0])
    assert mx.allclose(gk.compile(declared.softsign)(x), x / (1 + mx.abs(x))).item()
    report = gk.check("softsign", backend="reference")
    assert report.ok, str(report)


def test_the_recipes_metal_source_compiles(declared: types.ModuleType) -> None:
    """What ``graphkern metal-check softsign`` runs: the Metal bodies as MLX would generate them,
    through clang (skipped where libclang is missing, as the Metal check tests are)."""
    pytest.importorskip("clang.cindex")
    from graphkern.metal_check import check_library_metal

    report = check_library_metal(["softsign"], jobs=1)
    assert report.ok, str(report)
