"""What MLX is handed of a kernel's source: its backend's branch, no comments, the same lines."""

from __future__ import annotations

import pytest

from graphkern.kernels.registry import LIBRARY
from graphkern.launching.source_text import for_backend, two_backend_header

KERNELS = {entry.kernel.name: entry.kernel for entry in LIBRARY.values()}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_backend_gets_its_own_branch_of_a_library_header_line_for_line(name: str) -> None:
    header = KERNELS[name].header
    cuda, metal = for_backend(header, "cuda"), for_backend(header, "metal")
    assert cuda.count("\n") == metal.count("\n") == header.count("\n")
    assert "__device__" in cuda and "__device__" not in metal
    assert "threadgroup" in metal and "threadgroup float" not in cuda
    assert "//" not in cuda and "/*" not in cuda and "#else" not in cuda
    assert len(cuda) < len(header) * 0.6  # about half of the text never reached NVRTC before


def test_comments_go_and_literals_stay() -> None:
    text = 'printf("a // b /* c */"); // gone\nx = \'/\'; /* gone\ntoo */ y = 1;'
    assert for_backend(text, "cuda") == 'printf("a // b /* c */");\nx = \'/\';\ny = 1;'


def test_a_header_without_branches_is_only_compacted() -> None:
    assert for_backend("  int a;\n\n  int b;  ", "metal") == "int a;\n\nint b;"
    h = two_backend_header("int c;", "int m;")
    assert for_backend(h, "cuda").split() == ["int", "c;"]
